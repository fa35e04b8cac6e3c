"""LoraMLP on CPU: fc1's delta applied inside SwiGLU (swiglu_lora's torch path here; its Triton kernels
are compared with that path in test_lora_swiglu.py and on the GPU) gives the output and gradients of
the unfused MLP (fc1 with its delta added, SwiGLU, fc2), and fc2's adapter recomputes its input with
the function that made it. fp32, rel 1e-5 (summation order only; measured <= 2.6e-7 over 10 seeds).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_lora_support import randomize_layer, single_rank  # noqa: F401  (fixture)

from twinkle_specs.lora import mlp as lora_mlp
from twinkle_specs.lora.config import SlotSpec
from twinkle_specs.lora.model import link_input_recipes, swiglu_eager

REL_TOL = 1e-5


def _mlp(bias_activation_fusion: bool = True, one_rank: bool = False):
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from twinkle_specs.lora.layers import LoraColumnParallelLinear, LoraRowParallelLinear

    config = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        ffn_hidden_size=48,
        num_attention_heads=4,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=bias_activation_fusion,
        use_cpu_initialization=True,
    )

    def adapted(cls, site, slots):
        return ModuleSpec(module=cls, params={"lora_site": site, "lora_slots": slots, "lora_dropout": 0.0})

    slots = {"gate_proj": SlotSpec(4, 8, False), "up_proj": SlotSpec(2, 4, True)}  # rank_pattern, rsLoRA
    if one_rank:  # SwiGLU gets fc1's own B, h's gate and up columns apart
        slots = {"gate_proj": SlotSpec(4, 8, False), "up_proj": SlotSpec(4, 12, True)}
    sub = MLPSubmodules(
        linear_fc1=adapted(LoraColumnParallelLinear, "linear_fc1", slots),
        linear_fc2=adapted(LoraRowParallelLinear, "linear_fc2", {"down_proj": SlotSpec(4, 8, False)}),
    )
    m = lora_mlp.LoraMLP(config, sub)
    for lin in (m.linear_fc1, m.linear_fc2):
        randomize_layer(lin)
        lin.weight.requires_grad_(False)
    return m


def _unfused(m, x):
    """fc1 with its delta added to its output, SwiGLU, fc2: what megatron's MLP does with the adapters."""
    pre, _ = m.linear_fc1(x)
    return m.linear_fc2(swiglu_eager(pre))[0]


def _run(m, forward, x, grad):
    x = x.clone().requires_grad_(True)
    factors = [m.linear_fc1.lora_A, m.linear_fc1.lora_B, m.linear_fc2.lora_A, m.linear_fc2.lora_B]
    for p in factors:
        p.grad = None
    y = forward(x)
    (y * grad).sum().backward()
    return [y.detach(), x.grad, *(p.grad for p in factors)]


@pytest.mark.parametrize("one_rank", [False, True], ids=["fused-b", "halves"])
@pytest.mark.parametrize("fc2_path", ["deferred", "recipe"])
def test_adapters_inside_swiglu_equal_the_unfused_mlp(single_rank, monkeypatch, fc2_path, one_rank):  # noqa: F811
    """Output and every gradient as the unfused MLP's. ``deferred`` (training without dropout): fc2's
    A gradient and input-gradient share come from SwiGLU's backward, and nothing of fc2's input
    [tokens, ffn] is saved. ``recipe`` (fc2 cannot hand over its input gradient, e.g. with dropout):
    fc2's adapter recomputes its input once, through the recipe LoraMLP hands it. Gate and up at one
    rank: SwiGLU takes fc1's own B (no fused B is built); at two ranks, the fused one."""
    import megatron.core.fusions.fused_bias_swiglu as megatron_swiglu

    # fc2's recipe is megatron's SwiGLU, torch.compile'd: inductor builds it with the C++ toolchain on the
    # CPU (24 s a process with torch 2.11's CUDA build); its eager equivalent here, as in the test below
    monkeypatch.setattr(megatron_swiglu, "swiglu", swiglu_eager)
    m = _mlp(one_rank=one_rank)
    fused_b = []
    real_fused = m.linear_fc1.lora_B_fused
    monkeypatch.setattr(m.linear_fc1, "lora_B_fused", lambda: fused_b.append(1) or real_fused())
    assert m.lora_fuses_activation
    link_input_recipes(m)
    if fc2_path == "recipe":
        monkeypatch.setattr(m.linear_fc2, "lora_links_grad", lambda x: False)
    calls = []
    real = lora_mlp.swiglu_lora_forward
    monkeypatch.setattr(lora_mlp, "swiglu_lora_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(0)
    x, grad = torch.randn(8, 2, 32, generator=g), torch.randn(8, 2, 32, generator=g)
    got = _run(m, lambda x: m(x)[0], x, grad)
    assert calls == ([1] if fc2_path == "recipe" else [])
    assert bool(fused_b) is not one_rank
    if fc2_path == "deferred":  # (recording saves is itself saved-tensor hooks, which switch recipes off)
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t
        ):
            m(x.clone().requires_grad_(True))
        assert (8, 2, 48) not in shapes and (16, 48) not in shapes  # fc2's input is not kept
    assert m.linear_fc2.lora_input_recipe.pending is None
    want = _run(m, lambda x: _unfused(m, x), x, grad)
    scale = max(w.abs().max().item() for w in want)
    assert max((a - b).abs().max().item() for a, b in zip(got, want, strict=True)) / scale <= REL_TOL
    assert all(t.abs().max() > 0 for t in got[1:])


@pytest.mark.parametrize("why", ["no-fusion", "merged"])
def test_megatron_forward_where_it_does_not_fuse(single_rank, why, monkeypatch):  # noqa: F811
    """Without megatron's fused SwiGLU, or with the adapters merged, LoraMLP is megatron's MLP."""
    import megatron.core.transformer.mlp as megatron_mlp

    # megatron's fused SwiGLU is torch.compile'd: its eager equivalent here (no compiler on CPU)
    monkeypatch.setattr(megatron_mlp, "bias_swiglu_impl", lambda y, bias, *_: swiglu_eager(y))
    m = _mlp(bias_activation_fusion=why != "no-fusion")
    if why == "merged":
        m.linear_fc1.merge()
    x = torch.randn(4, 2, 32)
    calls = []
    monkeypatch.setattr(lora_mlp, "swiglu_lora", lambda *a: calls.append(1))  # the fused path's op
    out, _ = m(x)
    assert not calls
    assert torch.allclose(out, m.linear_fc2(swiglu_eager(m.linear_fc1(x)[0]))[0], rtol=1e-6, atol=1e-6)
