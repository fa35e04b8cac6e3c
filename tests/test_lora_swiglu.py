"""twinkle_specs.lora.swiglu: ``swiglu(pre + h @ b.T)`` in one op, against plain autograd of the unfused
expression, on CPU (the torch reference path), and its Triton kernels under the Triton interpreter.

Tolerances, max |Δ| relative to the largest value compared (output and every gradient):
- fp32 vs unfused autograd: 1e-5 (the same math in another order and a closed-form SwiGLU gradient;
  measured <= 1.6e-7).
- bf16 vs unfused bf16 autograd: 3e-2, about 8 bf16 ulps. The unfused path rounds ``h @ b.T``, the sum,
  ``silu`` and the product to bf16 one by one, the op rounds once per stage (measured <= 1.25e-2).
- Triton (interpreted) vs reference: fp16 2e-3 (products summed in another order, and Triton's sigmoid,
  can move a value across a rounding boundary: measured <= 1.3e-4); bf16 4e-2: the Triton 3.6
  interpreter truncates fp32 -> bf16 casts where the GPU rounds to nearest, so every rounding may be
  one bf16 ulp off (measured <= 1.8e-2). An indexing, masking or formula error shows as O(1).
The no-grad entry is compared bit for bit with the autograd forward.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from twinkle_specs.lora import swiglu as S

FP32_TOL, BF16_TOL = 1e-5, 3e-2
INTERP_TOL = {"float16": 2e-3, "bfloat16": 4e-2}
GRADS = {"all": (True, True, True), "frozen-pre": (False, True, True), "pre-only": (True, False, False)}


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _inputs(lead: tuple[int, ...], ffn: int, rank: int, dtype: torch.dtype, seed: int = 0):
    """pre [*lead, 2F] as a column slice of a wider tensor (rows not contiguous), h [*lead, R],
    b [2F, R], dout [*lead, F]; b scaled so the delta is of the order of pre."""
    g = torch.Generator().manual_seed(seed)
    pre = torch.randn(*lead, 2 * ffn + 6, generator=g)[..., 2 : 2 + 2 * ffn]
    h = torch.randn(*lead, rank, generator=g)
    b = torch.randn(2 * ffn, rank, generator=g) / rank**0.5
    dout = torch.randn(*lead, ffn, generator=g)
    return pre.to(dtype), h.to(dtype), b.to(dtype), dout.to(dtype)


def _unfused(pre: torch.Tensor, h: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    y1, y2 = (pre + h @ b.t()).chunk(2, -1)
    return F.silu(y1) * y2


def _run(fn, tensors, needs: tuple[bool, bool, bool]) -> list[torch.Tensor]:
    """fn(pre, h, b) and the gradients of those of (pre, h, b) that require one, for dout."""
    pre, h, b, dout = (t.detach().clone() for t in tensors)
    leaves = [t.requires_grad_(n) for t, n in zip((pre, h, b), needs, strict=True)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, [t for t in leaves if t.requires_grad], dout)
    return [out, *grads]


@pytest.mark.parametrize("grads", list(GRADS))
@pytest.mark.parametrize("rank", [5, 16, 48])
@pytest.mark.parametrize("lead", [(6, 3), (17,)], ids=["s,b", "T"])
def test_reference_matches_unfused_autograd(lead, rank, grads):
    needs = GRADS[grads]
    for dtype, tol in ((torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)):
        tensors = _inputs(lead, 40, rank, dtype)
        got, want = _run(S.swiglu_lora, tensors, needs), _run(_unfused, tensors, needs)
        assert len(got) == len(want) == 1 + sum(needs)
        for name, g, w in zip(
            ["out", *(n for n, x in zip("pre h b".split(), needs, strict=True) if x)], got, want, strict=True
        ):
            assert g.shape == w.shape and g.dtype == dtype, (name, g.shape, w.shape, g.dtype)
            assert _rel(g, w) <= tol, (dtype, name, _rel(g, w))


def test_no_grad_entry_is_bitwise_the_autograd_forward():
    pre, h, b, _ = _inputs((9, 2), 24, 5, torch.bfloat16)
    out = S.swiglu_lora(pre, h.requires_grad_(), b.requires_grad_())
    assert out.requires_grad
    assert torch.equal(S.swiglu_lora_forward(pre, h, b), out.detach())


def test_saves_inputs_not_the_preactivation():
    """Backward keeps pre, h and b (the [T, 2F] sum is recomputed), nothing else."""
    pre, h, b, _ = _inputs((8,), 16, 4, torch.float32)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        S.swiglu_lora(pre.requires_grad_(), h.requires_grad_(), b.requires_grad_())
    assert [t.data_ptr() for t in saved] == [pre.data_ptr(), h.data_ptr(), b.data_ptr()]


def test_rejects_mismatched_inputs():
    pre, h, b, _ = _inputs((4,), 8, 3, torch.float32)
    with pytest.raises(ValueError, match="shapes"):
        S.swiglu_lora(pre, h, b[:, :2])
    with pytest.raises(ValueError, match="dtypes"):
        S.swiglu_lora(pre, h.double(), b)


def test_imports_and_runs_without_triton(monkeypatch):
    """The module must import where Triton is missing (CPU CI): a fresh copy with ``import triton``
    failing takes the torch path."""
    monkeypatch.setitem(sys.modules, "triton", None)
    spec = importlib.util.spec_from_file_location("swiglu_no_triton", S.__file__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    assert fresh.triton is None
    pre, h, b, _ = _inputs((5,), 8, 3, torch.bfloat16)
    assert torch.equal(fresh.swiglu_lora(pre, h, b), S.swiglu_lora_forward(pre, h, b))


def _interpreted_errors() -> dict[str, float]:
    """Run in a child with TRITON_INTERPRET=1: the op with its Triton path forced on CPU tensors vs the
    reference path, output and all three gradients; plus kernel launches and no-grad bit-equality."""
    launches = 0
    launch = S._launch

    def counting(*args, **kwargs):
        nonlocal launches
        launches += 1
        launch(*args, **kwargs)

    S._launch, use_triton = counting, S._use_triton
    errors: dict[str, float] = {}
    for dtype in (torch.float16, torch.bfloat16):
        # several tiles with ragged edges (T 70 > BLOCK_T, F 200 > BLOCK_F), R below/at/above 16
        for lead, ffn, rank in (((70,), 200, 5), ((7, 3), 130, 48), ((5,), 16, 16)):
            tensors = _inputs(lead, ffn, rank, dtype, seed=1)
            ref = _run(S.swiglu_lora, tensors, (True, True, True))
            S._use_triton = lambda *_: True
            tri = _run(S.swiglu_lora, tensors, (True, True, True))
            nograd = S.swiglu_lora_forward(*tensors[:3])
            S._use_triton = use_triton
            for name, t, r in zip(("out", "pre", "h", "b"), tri, ref, strict=True):
                errors[f"{str(dtype)[6:]}/{lead}/{ffn}/{rank}/{name}"] = _rel(t, r)
            errors[f"nograd-differs/{str(dtype)[6:]}/{lead}"] = float(not torch.equal(nograd, tri[0]))
    errors["launches"] = launches
    return errors


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(
        [sys.executable, str(Path(__file__))], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    errors = json.loads(run.stdout.strip().splitlines()[-1])
    # per case: forward and backward kernel with the forced Triton path, forward kernel for no-grad
    assert errors.pop("launches") == 2 * 3 * 3, errors
    for key, err in errors.items():
        tol = 0.0 if key.startswith("nograd") else INTERP_TOL[key.split("/")[0]]
        assert err <= tol, (key, err, tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or S.triton is None, reason="needs a CUDA GPU and Triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_triton_kernels_on_cuda_match_the_reference(dtype):
    """The compiled kernels against the reference path on the GPU, output and every gradient, for the
    Qwen3-8B MLP width at a few hundred tokens, ragged edges and a rank below 16 included. Tolerance:
    2 ulps of the dtype relative to the largest value (bf16 1.6e-2, fp16 2e-3; the products are summed
    in another order, which can move a value across a rounding boundary); the no-grad entry is the
    autograd forward bit for bit."""
    tol = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    for lead, ffn, rank in (((300,), 12288, 32), ((7, 3), 200, 5)):
        tensors = [t.cuda() for t in _inputs(lead, ffn, rank, dtype, seed=2)]
        ref_use, S._use_triton = S._use_triton, lambda *_: False
        try:
            ref = _run(S.swiglu_lora, tensors, (True, True, True))
        finally:
            S._use_triton = ref_use
        got = _run(S.swiglu_lora, tensors, (True, True, True))
        assert torch.equal(S.swiglu_lora_forward(*tensors[:3]), got[0])
        for name, t, r in zip(("out", "pre", "h", "b"), got, ref, strict=True):
            assert _rel(t, r) <= tol, (lead, ffn, rank, name, _rel(t, r))


if __name__ == "__main__":
    print(json.dumps(_interpreted_errors()))
