"""Every Triton kernel of twinkle_specs compiled for the H100/H200 (sm90) on CPU, with the arguments its
Python wrapper launches it with.

The GPU tests run the kernels, but only on the device; the CPU tests run them under Triton's
interpreter, which executes a kernel as Python and so accepts code the compiler refuses (for
example a constexpr branch returning a tensor on one side and a scalar on the other). Compiling (Triton's
frontend down to PTX, then ptxas, which ships in the triton wheel) needs no GPU. Each wrapper runs on CPU
tensors with its launches recorded instead of made; each recorded launch is compiled with the
compile-time arguments a CUDA launch has (``DOT_F32`` off: tensor-core ``tl.dot``).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

POINTER = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int64: "*i64",
}
GPU_CONSTANTS = {"DOT_F32": False}  # what the wrappers pass for CUDA tensors


class _Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the launch, runs nothing."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def _compile(kernel, args: tuple, kwargs: dict):
    """``triton.compile`` of one recorded launch for sm90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    constants = {k: GPU_CONSTANTS.get(k, v) for k, v in kwargs.items() if k in names}
    options = {k: v for k, v in kwargs.items() if k not in names}
    signature = {}
    for name, value in zip(names, args, strict=False):
        if torch.is_tensor(value):
            signature[name] = POINTER[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if abs(value) < 2**31 else "i64"
        else:
            signature[name] = "fp32"
    signature |= dict.fromkeys(constants, "constexpr")
    source = ASTSource(kernel, signature, {(names.index(k),): v for k, v in constants.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _record(monkeypatch, module, *names: str) -> list[_Recorder]:
    recorders = [_Recorder(getattr(module, n)) for n in names]
    for name, rec in zip(names, recorders, strict=True):
        monkeypatch.setattr(module, name, rec)
    return recorders


def _compile_all(recorders: list[_Recorder], launches: int) -> None:
    assert sum(len(r.launches) for r in recorders) == launches
    for rec in recorders:
        for args, kwargs in rec.launches:
            compiled = _compile(rec.kernel, args, kwargs)
            assert compiled.asm["cubin"], rec.kernel.fn.__name__


def test_qk_rope_kernels_compile_for_sm90(monkeypatch):
    """Forward and backward at a Qwen3-8B layer's attention (8 groups of 4 query heads, head 128)."""
    from twinkle_specs.lora import qk_rope as R

    recorders = _record(monkeypatch, R, "_qk_rope_fwd_kernel", "_qk_rope_bwd_kernel")
    s, groups, head = 64, 8, 128
    mixed = torch.zeros(s, 1, groups * 6 * head, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(head, dtype=torch.bfloat16)
    outs = R.QKNormRope.apply(mixed, w, w, torch.zeros(s, head), groups, head, 1e-6, 1e-6)
    torch.autograd.backward(outs, [torch.zeros_like(t) for t in outs])
    _compile_all(recorders, 2)


@pytest.mark.parametrize("halves", [False, True], ids=["fused-b", "halves"])
def test_swiglu_kernels_compile_for_sm90(monkeypatch, halves):
    """Forward and backward (with fc2's deferred A GEMM) at the Qwen3-8B MLP width, rank 16."""
    from twinkle_specs.lora import swiglu as S
    from twinkle_specs.lora.functions import GradLink, LowRankDown

    recorders = _record(monkeypatch, S, "_fwd_kernel", "_bwd_kernel")
    monkeypatch.setattr(S, "_use_triton", lambda *_: True)
    monkeypatch.setattr(S, "_sm_count", lambda _: 132)
    t, ffn, r = 64, 12288, 16
    bf16 = {"dtype": torch.bfloat16}
    pre = torch.zeros(t, 2 * ffn, **bf16, requires_grad=True)
    h = torch.zeros(t, 2 * r if halves else r, **bf16, requires_grad=True)
    b = torch.zeros(2 * ffn, r, **bf16, requires_grad=True)
    a2 = torch.zeros(r, ffn, **bf16, requires_grad=True)
    link = GradLink(deferred=True)
    out = S.swiglu_lora(pre, h, b, a2, link)
    h2 = LowRankDown.apply(out, a2, link, None, None, 2.0)
    torch.autograd.backward([out, h2], [torch.zeros_like(out), torch.zeros_like(h2)])
    _compile_all(recorders, 2)


def test_frozen_norm_kernels_compile_for_sm90(monkeypatch):
    """Forward and backward of the frozen q/k norm on [tokens, heads, 128]."""
    from twinkle_specs.lora import norm as N

    recorders = _record(monkeypatch, N, "_fwd_kernel", "_bwd_kernel")
    x = torch.zeros(64, 32, 128, dtype=torch.bfloat16, requires_grad=True)
    y = N.FrozenRMSNorm.apply(x, torch.ones(128, dtype=torch.bfloat16), 1e-6)
    y.backward(torch.zeros_like(y))
    _compile_all(recorders, 2)


@pytest.mark.parametrize("n", [1536, 2048], ids=["fc1", "fc2"])
def test_grouped_low_rank_kernel_compiles_for_sm90(monkeypatch, n):
    """The routed adapters' in-place rank-r sum at Qwen3-30B-A3B's expert fc1 and fc2 widths (128
    experts, r = 16), ``m`` as the forward's transposed B."""
    from twinkle_specs.lora import grouped_low_rank as G

    recorders = _record(monkeypatch, G, "_add_kernel")
    rows, experts, r = 256, 128, 16
    out = torch.zeros(rows, n, dtype=torch.bfloat16)
    h = torch.zeros(rows, r, dtype=torch.bfloat16)
    b = torch.zeros(experts, n, r, dtype=torch.bfloat16)
    G._triton_add_(out, h, b.transpose(1, 2), torch.full((experts,), rows, dtype=torch.int32))
    _compile_all(recorders, 1)


def test_a_compile_error_fails_the_check():
    """The check can fail: a kernel whose constexpr branch returns a tensor on one side and a scalar on
    the other (what the interpreter ran and the compiler refused) does not compile."""
    import triton
    import triton.language as tl

    @triton.jit
    def _rows(p, n, ON: tl.constexpr):
        if ON:
            return tl.load(p + tl.arange(0, 16), mask=tl.arange(0, 16) < n)
        return 0.0

    @triton.jit
    def _kernel(p, q, n, ON: tl.constexpr):
        tl.store(q + tl.arange(0, 16), _rows(p, n, ON), mask=tl.arange(0, 16) < n)

    from triton.compiler.errors import CompilationError

    p = torch.zeros(16, dtype=torch.bfloat16)
    with pytest.raises(CompilationError) as err:
        _compile(_kernel, (p, p, 16), {"ON": True, "num_warps": 1})
    assert "Inconsistent return types" in repr(err.value.__cause__) + str(err.value)
