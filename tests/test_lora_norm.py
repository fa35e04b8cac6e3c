"""The adapted attention's q/k norm (twinkle_specs.lora.norm.TorchRMSNorm) on CPU.

Against an independent fp64 RMSNorm: fp32 output and gradients to rel 1e-6 (measured <= 1.6e-7
over 20 seeds), bf16 output within one rounding of the exact value (rel 8e-3; measured <= 2.5e-3).
With the weight frozen the backward gives the input gradient only; trainable, the weight's too. Checkpoint keys are a TE
norm's (``weight``, ``_extra_state``). The swap in the LoRA spec is tests/test_lora_te_standin.py's.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from twinkle_specs.lora.norm import TorchRMSNorm

EPS = 1e-6


def _config(**kw) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True, **kw
    )


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * w.double()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def _norm(train_weight: bool, dtype=torch.float32, seed: int = 0) -> TorchRMSNorm:
    norm = TorchRMSNorm(_config(normalization="RMSNorm"), hidden_size=16, eps=EPS).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(16, generator=torch.Generator().manual_seed(seed)) + 0.5)
    norm.weight.requires_grad_(train_weight)
    return norm


@pytest.mark.parametrize("train_weight", [False, True], ids=["frozen", "trainable"])
def test_matches_rmsnorm_and_its_gradients(train_weight):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 2, 4, 16, generator=g) * 3).requires_grad_(True)
    grad = torch.randn(5, 2, 4, 16, generator=g)
    norm = _norm(train_weight)
    out = norm(x)
    out.backward(grad)

    xr = x.detach().double().requires_grad_(True)
    wr = norm.weight.detach().double().requires_grad_(True)
    want = _reference(xr, wr)
    want.backward(grad.double())
    assert _rel(out.detach(), want.detach()) <= 1e-6
    assert _rel(x.grad, xr.grad) <= 1e-6
    if train_weight:
        assert _rel(norm.weight.grad, wr.grad) <= 1e-6
    else:
        assert norm.weight.grad is None
    # the weight matters: without it the output differs by far more than the tolerance
    assert _rel(_reference(x.detach(), torch.ones(16)), want.detach()) > 0.1


def test_bf16_output_is_rounded_once():
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    norm = _norm(False, torch.bfloat16, seed=3)
    out = norm(x)
    assert out.dtype == torch.bfloat16
    assert _rel(out, _reference(x, norm.weight)) <= 8e-3


def test_checkpoint_keys_are_a_te_norms():
    sd = _norm(False).state_dict()
    assert set(sd) == {"weight", "_extra_state"}
    assert sd["_extra_state"].dtype == torch.uint8 and sd["_extra_state"].numel() == 0


def test_other_norms_are_refused():
    with pytest.raises(ValueError, match="LayerNorm"):
        TorchRMSNorm(_config(normalization="LayerNorm"), hidden_size=16)
    with pytest.raises(ValueError, match="zero_centered_gamma=True"):
        TorchRMSNorm(_config(normalization="RMSNorm", layernorm_zero_centered_gamma=True), hidden_size=16)
