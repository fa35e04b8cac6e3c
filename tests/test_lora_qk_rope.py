"""The fused QKV split + frozen q/k norms + RoPE (twinkle_specs.lora.qk_rope) and the attention that uses it.

Kernels, interpreted on CPU, against an fp64 reference that rounds where the unfused GPU path rounds
(norm output, RoPE's gradient), with strided gradients: 2 ulps of the dtype relative to the largest value
(fp32 1e-5, fp16 2e-3, bf16 1.6e-2; measured fp32 1.7e-7, fp16 4.5e-4, bf16 1.3e-2 on the interpreter,
which truncates bf16 casts). With the backward's amax on (FP8 current scaling) the gradient is the same
bit for bit and the partial maxima's largest is the gradient's largest magnitude exactly. The attention (:class:`LoraSelfAttention`, fp32, interpreted) against
megatron's own SelfAttention path on the same weights (QKNorm, megatron's unfused RoPE): output, input
gradient and linear_qkv's weight gradient to rel 1e-5 (measured <= 3.2e-7). The fallback conditions:
each one that the fused kernels do not cover sends the forward down megatron's path."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from conftest import free_port
from test_lora_support import CountingKernel, interpreted, single_rank  # noqa: F401  (fixture)

from twinkle_specs.lora import qk_rope as R

TRITON = importlib.util.find_spec("triton") is not None
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def _freqs(s: int, head: int, base: float = 1e4) -> torch.Tensor:
    """megatron's rotary embedding: [s, 1, 1, head], the half-width angles repeated (non-interleaved)."""
    inv = 1.0 / base ** (torch.arange(0, head, 2, dtype=torch.float32) / head)
    f = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    return torch.cat([f, f], -1)[:, None, None, :]


def _reference(mixed, wq, wk, freqs, groups, head, eps, dtype):
    """The unfused path in fp64 with its roundings: split, norm (rounded), RoPE (rounded)."""
    s, b, _ = mixed.shape
    rows = mixed.double().view(s, b, groups, -1, head)  # per group: qpg query heads, key, value
    q, k, v = rows[..., :-2, :].reshape(s, b, -1, head), rows[..., -2, :], rows[..., -1, :]
    cos, sin = freqs.double().cos(), freqs.double().sin()

    def rnd(t):
        return t.to(dtype).double()

    def norm_rope(x, w):
        y = rnd(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double())
        y1, y2 = y.chunk(2, -1)
        return torch.cat([-y2, y1], -1) * sin + y * cos

    return norm_rope(q, wq), norm_rope(k, wk), v


def _kernel_errors(device: str, cases: tuple) -> dict:
    """The fused function (kernels, forced) against :func:`_reference`: outputs and the QKV gradient
    (reference gradient by fp64 autograd through the roundings' values), per dtype and case."""
    fwd, bwd = CountingKernel(R._qk_rope_fwd_kernel), CountingKernel(R._qk_rope_bwd_kernel)
    R._qk_rope_fwd_kernel, R._qk_rope_bwd_kernel = fwd, bwd
    errors: dict = {}
    try:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for s, b, groups, qpg, head in cases:
                g = torch.Generator().manual_seed(s * 7 + groups + head)
                width = groups * (qpg + 2) * head
                mixed = (torch.randn(s, b, width, generator=g) * 2).to(device=device, dtype=dtype)
                wq, wk = (torch.rand(head, generator=g) + 0.5 for _ in range(2))
                freqs = _freqs(s, head)
                grads = [torch.randn(s, b, n, head, generator=g) for n in (groups * qpg, groups, groups)]
                # strided gradients, as attention backwards may hand them over
                grads = [
                    t.transpose(0, 1).contiguous().transpose(0, 1).to(device=device, dtype=dtype)
                    for t in grads
                ]
                link, plain = _AmaxRecorder(), mixed.detach().clone().requires_grad_(True)
                x = mixed.detach().clone().requires_grad_(True)
                for inp, amax in (
                    (x, link),
                    (plain, None),
                ):  # with the amax (FP8 current scaling) and without
                    outs = R.QKNormRope.apply(
                        inp, wq.to(device, dtype), wk.to(device, dtype), freqs.view(s, head).to(device),
                        groups, head, 1e-6, 1e-6, amax,
                    )  # fmt: skip
                    torch.autograd.backward(outs, grads)
                xr = mixed.detach().double().cpu().requires_grad_(True)
                wq_r, wk_r = wq.to(dtype).double(), wk.to(dtype).double()
                want = _reference(xr, wq_r, wk_r, freqs, groups, head, 1e-6, dtype)
                torch.autograd.backward(want, [t.double().cpu() for t in grads])
                key = f"{str(dtype)[6:]}/{s}x{b}x{groups}x{qpg}x{head}"
                for name, got, ref in zip("qkv", outs, want, strict=True):
                    errors[f"{key}/{name}"] = _rel(got.detach().cpu(), ref.detach())
                    errors[f"{key}/{name}-shape"] = float(got.shape != ref.shape or not got.is_contiguous())
                errors[f"{key}/dqkv"] = _rel(x.grad.cpu(), xr.grad)
                errors[f"{key}/dqkv-same-exact"] = float(not torch.equal(x.grad, plain.grad))
                errors[f"{key}/amax-exact"] = (link.partials.max() - x.grad.float().abs().max()).abs().item()
    finally:
        R._qk_rope_fwd_kernel, R._qk_rope_bwd_kernel = fwd.kernel, bwd.kernel
    errors["launches"] = (fwd.launches, bwd.launches)
    return errors


class _AmaxRecorder:
    """Stands in for fp8_amax.GradAmax: keeps the partial maxima the backward gives."""

    def give(self, grad: torch.Tensor, partials: torch.Tensor) -> None:
        self.partials = partials


# (s, b, groups, query heads per group, head): one token block and ragged ones, MHA-like and GQA,
# micro-batch 1 and 2 (the sequence position is the token index // b), a head of 24 (masked columns)
INTERPRETED = ((5, 1, 1, 1, 16), (7, 2, 2, 3, 16), (33, 1, 2, 2, 32), (6, 2, 2, 2, 24))


def _assert_kernels(errors: dict) -> None:
    for key, err in errors.items():
        tol = 0.0 if key.endswith(("-shape", "-exact")) else TOL[key.split("/")[0]]
        assert err <= tol, (key, err, tol)


# -- the attention -------------------------------------------------------------------------------


def _attention(apply_rope_fusion: bool):
    """A LoraSelfAttention as the LoRA spec builds it around the portable path's linears and core
    attention (fp32, CPU), QKNorm q/k norms with frozen random weights."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from twinkle_specs.lora.attention import LoraSelfAttention
    from twinkle_specs.lora.norm import QKNorm
    from twinkle_specs.spec import SDPACoreAttention

    config = TransformerConfig(
        num_layers=1, hidden_size=48, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        normalization="RMSNorm", qk_layernorm=True, use_cpu_initialization=True,
        layernorm_epsilon=1e-6, attention_dropout=0.0,
    )  # fmt: skip
    config.apply_rope_fusion = apply_rope_fusion  # after the config's check that TE is installed
    sub = SelfAttentionSubmodules(
        linear_qkv=ColumnParallelLinear, core_attention=SDPACoreAttention, linear_proj=RowParallelLinear,
        q_layernorm=QKNorm, k_layernorm=QKNorm,
    )  # fmt: skip
    attn = LoraSelfAttention(config, sub, layer_number=1, attn_mask_type=AttnMaskType.causal)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(
                torch.rand(p.shape, generator=g) + 0.5
                if "layernorm" in name
                else torch.randn(p.shape, generator=g) * 0.2
            )
    attn.q_layernorm.weight.requires_grad_(False)
    attn.k_layernorm.weight.requires_grad_(False)
    return attn


def _attention_errors() -> dict:
    """The fused forward (kernels interpreted; the CUDA condition forced) against megatron's path on
    the same module: output, input gradient, linear_qkv's weight gradient."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import twinkle_specs.lora.attention as A

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    s, b = 9, 2
    x = torch.randn(s, b, 48, generator=torch.Generator().manual_seed(5))
    grad = torch.randn(s, b, 48, generator=torch.Generator().manual_seed(6))
    results = []
    fusable = A.fusable
    for fused in (False, True):  # unfused: megatron's own RoPE (its fusion needs TE)
        attn = _attention(apply_rope_fusion=fused)
        launches = R._qk_rope_fwd_kernel = CountingKernel(R._qk_rope_fwd_kernel)
        A.fusable = (lambda *_: True) if fused else fusable
        try:
            xi = x.clone().requires_grad_(True)
            out, _ = attn(xi, None, rotary_pos_emb=_freqs(s, 16))
            out.backward(grad)
        finally:
            R._qk_rope_fwd_kernel, A.fusable = launches.kernel, fusable
        results.append((out.detach(), xi.grad, attn.linear_qkv.weight.grad.clone(), launches.launches))
    (o0, dx0, dw0, n0), (o1, dx1, dw1, n1) = results
    return {"out": _rel(o1, o0), "dx": _rel(dx1, dx0), "dw_qkv": _rel(dw1, dw0), "launches": [n0, n1]}


@pytest.mark.skipif(not TRITON, reason="triton is not installed")
def test_kernels_and_attention_under_interpreter():
    """The kernels against fp64 (module docstring's tolerances), and the attention's fused path against
    megatron's: 1e-5 relative in fp32; the fused forward launches the kernel once, megatron's never."""
    errors = interpreted(__file__)
    attention = errors.pop("attention")
    assert errors.pop("launches") == [2 * 3 * len(INTERPRETED)] * 2, errors  # with the amax and without
    _assert_kernels(errors)
    assert attention.pop("launches") == [0, 1], attention
    for key, err in attention.items():
        assert err <= 1e-5, (key, err)


def test_unsupported_forwards_take_megatrons_path(single_rank, monkeypatch):  # noqa: F811
    """Each condition the kernels do not cover (here on CPU with the device check forced) leaves the
    rotary embedding to megatron; the supported case hands it to the fused path."""
    import twinkle_specs.lora.attention as A

    monkeypatch.setattr(A, "fusable", lambda *a: True)
    attn = _attention(apply_rope_fusion=True)
    x, freqs = torch.zeros(4, 1, 48), _freqs(4, 16)
    args = {"hidden_states": x, "attention_mask": None, "rotary_pos_emb": freqs}
    assert attn._fused_rope(args) is freqs
    assert attn._fused_rope({**args, "rotary_pos_emb": (freqs, freqs)}) is freqs
    assert attn._fused_rope({**args, "rotary_pos_emb": (freqs, freqs.clone())}) is None
    assert attn._fused_rope({**args, "rotary_pos_emb": None}) is None
    assert attn._fused_rope({**args, "rotary_pos_emb": freqs[..., :8]}) is None  # partial rotary
    assert attn._fused_rope({**args, "rotary_pos_emb": freqs.double()}) is None
    assert attn._fused_rope({**args, "packed_seq_params": object()}) is None
    assert attn._fused_rope({**args, "inference_context": object()}) is None
    for field in ("rotary_interleaved", "flash_decode"):
        monkeypatch.setattr(attn.config, field, True)
        assert attn._fused_rope(args) is None, field
        monkeypatch.setattr(attn.config, field, False)
    monkeypatch.setattr(attn.config, "apply_rope_fusion", False)
    assert attn._fused_rope(args) is None
    monkeypatch.setattr(attn.config, "apply_rope_fusion", True)
    monkeypatch.setattr(A, "fusable", lambda *a: False)  # CPU, no Triton, or trainable norm weights
    assert attn._fused_rope(args) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or R.triton is None, reason="needs a CUDA GPU and Triton")
def test_kernels_on_cuda_match_the_reference():
    """The compiled kernels against fp64 at a Qwen3-8B layer's shape (4096 tokens, 8 groups of 4 query
    heads, head 128) and a ragged small one; the interpreted test's tolerances."""
    errors = _kernel_errors("cuda", ((1024, 4, 8, 4, 128), (7, 2, 2, 3, 16)))
    print(json.dumps(errors))
    errors.pop("launches")
    _assert_kernels(errors)


if __name__ == "__main__":
    result = _kernel_errors("cpu", INTERPRETED)
    result["attention"] = _attention_errors()
    print(json.dumps(result))
