"""twinkle_specs.lora.swiglu: ``swiglu(pre + h @ b.T)`` in one op (with fc2's deferred A GEMM gradient:
``h2 = out @ a2.T``), against plain autograd of the unfused expression, on CPU (the torch reference
path), and its Triton kernels under the Triton interpreter (and on the GPU, gpu-marked).

Tolerances, max |Δ| relative to the largest value compared (output and every gradient):
- fp32 vs unfused autograd: 1e-5 (the same math in another order and a closed-form SwiGLU gradient;
  measured <= 1.6e-7).
- bf16 vs unfused bf16 autograd: 3e-2, about 8 bf16 ulps. The unfused path rounds ``h @ b.T``, the sum,
  ``silu`` and the product to bf16 one by one, the op rounds once per stage (measured <= 1.25e-2).
- Triton (interpreted) vs reference: fp16 2e-3 (products summed in another order, and Triton's sigmoid,
  can move a value across a rounding boundary; fc2's scaling, here 0.7, rounded onto a2 in the kernel:
  measured <= 8.0e-4); bf16 4e-2: the Triton 3.6
  interpreter truncates fp32 -> bf16 casts where the GPU rounds to nearest, so every rounding may be
  one bf16 ulp off (measured <= 1.8e-2). An indexing, masking or formula error shows as O(1).
The no-grad entry is compared bit for bit with the autograd forward, and the kernels' amax (FP8 current
scaling) exactly with the largest magnitude of what they wrote.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys

import pytest
import torch
import torch.nn.functional as F
from test_lora_support import CountingKernel, hopper_resources, interpreted

from twinkle_specs.lora import swiglu as S
from twinkle_specs.lora.functions import GradLink, LowRankDown

# torch and Triton only (the SwiGLU-with-LoRA op and its kernels; no megatron-core code): one leg of
# scripts/test.sh (pyproject.toml's one_leg marker).
pytestmark = pytest.mark.one_leg

FP32_TOL, BF16_TOL = 1e-5, 3e-2
INTERP_TOL = {"float16": 2e-3, "bfloat16": 4e-2}
GRADS = {"all": (True, True, True), "frozen-pre": (False, True, True), "pre-only": (True, False, False)}


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _inputs(lead: tuple[int, ...], ffn: int, rank: int, dtype: torch.dtype, seed: int = 0, halves=False):
    """pre [*lead, 2F] as a column slice of a wider tensor (rows not contiguous), h [*lead, R] (with
    ``halves`` [*lead, 2R]: gate's columns, then up's), b [2F, R], dout [*lead, F]; b scaled so the
    delta is of the order of pre."""
    g = torch.Generator().manual_seed(seed)
    pre = torch.randn(*lead, 2 * ffn + 6, generator=g)[..., 2 : 2 + 2 * ffn]
    h = torch.randn(*lead, 2 * rank if halves else rank, generator=g)
    b = torch.randn(2 * ffn, rank, generator=g) / rank**0.5
    dout = torch.randn(*lead, ffn, generator=g)
    return pre.to(dtype), h.to(dtype), b.to(dtype), dout.to(dtype)


def _unfused(pre: torch.Tensor, h: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if h.shape[-1] == b.shape[-1]:
        y1, y2 = (pre + h @ b.t()).chunk(2, -1)
    else:  # halves: gate's columns of h meet gate's rows of b, up's up's
        (pg, pu), (hg, hu), (bg, bu) = pre.chunk(2, -1), h.chunk(2, -1), b.chunk(2, 0)
        y1, y2 = pg + hg @ bg.t(), pu + hu @ bu.t()
    return F.silu(y1) * y2


def _run(fn, tensors, needs: tuple[bool, bool, bool]) -> list[torch.Tensor]:
    """fn(pre, h, b) and the gradients of those of (pre, h, b) that require one, for dout."""
    pre, h, b, dout = (t.detach().clone() for t in tensors)
    leaves = [t.requires_grad_(n) for t, n in zip((pre, h, b), needs, strict=True)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, [t for t in leaves if t.requires_grad], dout)
    return [out, *grads]


def _fc2_inputs(tensors: list[torch.Tensor], rank2: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """fc2's A [R2, F] and the gradient of its A GEMM's output [*lead, R2], for ``tensors``' shapes."""
    pre, _, _, dout = tensors
    g = torch.Generator().manual_seed(seed)
    a2 = torch.randn(rank2, dout.shape[-1], generator=g) / dout.shape[-1] ** 0.5
    return a2.to(pre.dtype), torch.randn(*dout.shape[:-1], rank2, generator=g).to(pre.dtype)


def _run_fc2(
    fused: bool, tensors, a2: torch.Tensor, dh2: torch.Tensor, s2: float = 1.0
) -> list[torch.Tensor]:
    """``out`` and ``h2 = s2 * out @ a2.T`` (fc2's A GEMM with its scaling, its link deferred to the op
    when ``fused``), and the gradients of pre, h, b and a2 for the upstream gradients ``dout`` of out
    and ``dh2`` of h2."""
    pre, h, b, dout = (t.detach().clone().requires_grad_(True) for t in tensors)
    a2 = a2.detach().clone().requires_grad_(True)
    if fused:
        link = GradLink(deferred=True)
        out = S.swiglu_lora(pre, h, b, a2, link)
        h2 = LowRankDown.apply(out, a2, link, None, None, s2)
    else:
        out = _unfused(pre, h, b)
        h2 = (out @ a2.t()) * s2
    grads = torch.autograd.grad([out, h2], [pre, h, b, a2], [dout.detach(), dh2])
    return [out.detach(), *grads]


@pytest.mark.parametrize("halves", [False, True], ids=["fused-b", "halves"])
@pytest.mark.parametrize("grads", list(GRADS))
@pytest.mark.parametrize("rank", [5, 16, 48])
@pytest.mark.parametrize("lead", [(6, 3), (17,)], ids=["s,b", "T"])
def test_reference_matches_unfused_autograd(lead, rank, grads, halves):
    needs = GRADS[grads]
    for dtype, tol in ((torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)):
        tensors = _inputs(lead, 40, rank, dtype, halves=halves)
        got, want = _run(S.swiglu_lora, tensors, needs), _run(_unfused, tensors, needs)
        assert len(got) == len(want) == 1 + sum(needs)
        for name, g, w in zip(
            ["out", *(n for n, x in zip("pre h b".split(), needs, strict=True) if x)], got, want, strict=True
        ):
            assert g.shape == w.shape and g.dtype == dtype, (name, g.shape, w.shape, g.dtype)
            assert _rel(g, w) <= tol, (dtype, name, _rel(g, w))


@pytest.mark.parametrize("s2", [1.0, 2.0], ids=["unscaled", "scaled"])
@pytest.mark.parametrize("halves", [False, True], ids=["fused-b", "halves"])
@pytest.mark.parametrize("rank2", [4, 16])
def test_deferred_fc2_gradients_match_unfused_autograd(rank2, halves, s2):
    """With fc2's A GEMM deferring to the op: fc2's input-gradient share and a2's gradient from the op's
    backward equal plain autograd's (pre, h, b and a2), fp32 and bf16, with fc2's scaling ``s2`` as the
    A GEMM's alpha (carried on the link)."""
    for dtype, tol in ((torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)):
        tensors = _inputs((6, 3), 40, 5, dtype, halves=halves)
        a2, dh2 = _fc2_inputs(tensors, rank2)
        got, want = _run_fc2(True, tensors, a2, dh2, s2), _run_fc2(False, tensors, a2, dh2, s2)
        for name, g, w in zip(("out", "pre", "h", "b", "a2"), got, want, strict=True):
            assert g.shape == w.shape and _rel(g, w) <= tol, (dtype, name, _rel(g, w))
        if s2 != 1.0:  # the scaling reaches a2's and the input's gradients (the comparison can fail)
            plain = _run_fc2(False, tensors, a2, dh2)
            assert _rel(got[4], plain[4]) > 10 * tol and _rel(got[1], plain[1]) > tol


@pytest.mark.parametrize("halves", [False, True], ids=["fused-b", "halves"])
def test_no_grad_entry_is_bitwise_the_autograd_forward(halves):
    pre, h, b, _ = _inputs((9, 2), 24, 5, torch.bfloat16, halves=halves)
    out = S.swiglu_lora(pre, h.requires_grad_(), b.requires_grad_())
    assert out.requires_grad
    assert torch.equal(S.swiglu_lora_forward(pre, h, b), out.detach())


def test_saves_inputs_not_the_preactivation():
    """Backward keeps pre, h and b (the [T, 2F] sum is recomputed), nothing else."""
    pre, h, b, _ = _inputs((8,), 16, 4, torch.float32)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        S.swiglu_lora(pre.requires_grad_(), h.requires_grad_(), b.requires_grad_())
    assert [t.data_ptr() for t in saved if t is not None] == [pre.data_ptr(), h.data_ptr(), b.data_ptr()]


def test_rejects_mismatched_inputs():
    pre, h, b, _ = _inputs((4,), 8, 3, torch.float32)
    with pytest.raises(ValueError, match="shapes"):
        S.swiglu_lora(pre, h, b[:, :2])
    with pytest.raises(ValueError, match="shapes"):  # neither R nor 2R columns
        S.swiglu_lora(pre, torch.cat([h, h[..., :1]], -1), b)
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


def _kernel_errors(device: str, cases: tuple, s2: float) -> dict[str, float]:
    """The op with its Triton path forced vs the reference path on ``device`` tensors, output and every
    gradient, with and without fc2's deferred A GEMM (at scaling ``s2``, which the kernel puts on a2,
    rounded: exact for a power of two); no-grad bit-equality; kernel launches."""
    fwd, bwd = CountingKernel(S._fwd_kernel), CountingKernel(S._bwd_kernel)
    S._fwd_kernel, S._bwd_kernel, use_triton = fwd, bwd, S._use_triton
    errors: dict[str, float] = {}
    try:
        for dtype in (torch.float16, torch.bfloat16):
            for lead, ffn, rank, rank2, halves in cases:
                tensors = [t.to(device) for t in _inputs(lead, ffn, rank, dtype, seed=1, halves=halves)]
                a2, dh2 = (t.to(device) for t in _fc2_inputs(tensors, rank2))
                runs = {}
                for path in ("triton", "reference"):
                    S._use_triton = (lambda *_: True) if path == "triton" else (lambda *_: False)
                    runs[path] = _run(S.swiglu_lora, tensors, (True, True, True)) + _run_fc2(
                        True,
                        tensors,
                        a2,
                        dh2,
                        s2,
                    )
                    if path == "triton":
                        nograd = S.swiglu_lora_forward(*tensors[:3])
                S._use_triton = use_triton
                names = ("out", "pre", "h", "b", "fc2/out", "fc2/pre", "fc2/h", "fc2/b", "fc2/a2")
                for name, t, r in zip(names, runs["triton"], runs["reference"], strict=True):
                    errors[f"{str(dtype)[6:]}/{lead}/{ffn}/{rank}/{halves}/{name}"] = _rel(t, r)
                errors[f"nograd-differs/{str(dtype)[6:]}/{lead}/{halves}"] = float(
                    not torch.equal(nograd, runs["triton"][0])
                )
    finally:
        S._fwd_kernel, S._bwd_kernel, S._use_triton = fwd.kernel, bwd.kernel, use_triton
    errors["launches"] = (fwd.launches, bwd.launches)
    return errors


def _amax_errors(device: str, cases: tuple, s2: float) -> dict[str, float]:
    """With their amax on (FP8 current scaling, :mod:`twinkle_specs.lora.fp8_amax`), the kernels' largest
    partial against the largest |value| of what they wrote: SwiGLU's output, and its gradient with and
    without fc2's deferred A GEMM; the output and gradient themselves against the kernels without amax.
    Every entry should be 0 (the same rounded values)."""
    errors: dict[str, float] = {}
    for dtype in (torch.float16, torch.bfloat16):
        for lead, ffn, rank, rank2, halves in cases:
            pre, h, b, dout = (t.to(device) for t in _inputs(lead, ffn, rank, dtype, seed=2, halves=halves))
            a2, dh2 = (t.to(device) for t in _fc2_inputs([pre, h, b, dout], rank2))
            key = f"{str(dtype)[6:]}/{lead}/{ffn}/{rank}/{halves}"
            out, partials = S._triton_forward(pre, h, b, amax=True)
            errors[f"amax/fwd/{key}"] = (partials.max() - out.float().abs().max()).abs().item()
            errors[f"amax/fwd-out/{key}"] = float(not torch.equal(out, S._triton_forward(pre, h, b)[0]))
            for fc2, extra in (("no-fc2", (None, None)), ("fc2", (dh2, a2))):
                dy, *_, partials = S._triton_backward(dout, pre, h, b, *extra, s2, amax=True)
                plain = S._triton_backward(dout, pre, h, b, *extra, s2)[0]
                errors[f"amax/bwd/{fc2}/{key}"] = (partials.max() - dy.float().abs().max()).abs().item()
                errors[f"amax/bwd-dy/{fc2}/{key}"] = float(not torch.equal(dy, plain))
    return errors


def _chunk_errors(device: str, cases: tuple, s2: float) -> dict[str, float]:
    """The backward at other token-chunk counts than its own choice (one chunk; more chunks than the
    default, with a ragged last one): its gradient bit for bit, the factor gradients (partial sums added in
    another grouping) relative to the default's."""
    errors: dict[str, float] = {}
    for lead, ffn, rank, rank2, halves in cases:
        pre, h, b, dout = (
            t.to(device) for t in _inputs(lead, ffn, rank, torch.bfloat16, seed=3, halves=halves)
        )
        a2, dh2 = (t.to(device) for t in _fc2_inputs([pre, h, b, dout], rank2))
        default = S._triton_backward(dout, pre, h, b, dh2, a2, s2)
        for chunks in (1, 3):
            dy, d_b, d_a2, _ = S._triton_backward(dout, pre, h, b, dh2, a2, s2, chunks=chunks)
            key = f"chunks/{chunks}/{lead}/{ffn}/{rank}/{halves}"
            errors[f"{key}/dy-differs"] = float(not torch.equal(dy, default[0]))
            errors[f"{key}/b"], errors[f"{key}/a2"] = _rel(d_b, default[1]), _rel(d_a2, default[2])
    return errors


# several tiles with ragged edges (T 70 > the token blocks, F 200 > the F blocks), R below/at/above 16,
# fused B and halves
INTERPRETED = (((70,), 200, 5, 4, False), ((7, 3), 130, 48, 16, False), ((5,), 16, 16, 3, False))
INTERPRETED += (((70,), 200, 5, 4, True), ((7, 3), 130, 16, 16, True))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_under_interpreter():
    errors = interpreted(__file__)
    # per dtype and case: forward twice and backward twice (without and with fc2), forward for no-grad
    assert errors.pop("launches") == [2 * len(INTERPRETED) * 3, 2 * len(INTERPRETED) * 2], errors
    assert sum(key.startswith("amax/") for key in errors) == 2 * len(INTERPRETED) * 6, errors
    assert sum(key.startswith("chunks/") for key in errors) == len(INTERPRETED) * 2 * 3, errors
    for key, err in errors.items():
        if key.startswith("chunks/"):  # bf16 factor gradients, summed over other partials: 2 ulps
            tol = 0.0 if key.endswith("dy-differs") else 1.6e-2
        else:
            tol = 0.0 if key.startswith(("nograd", "amax/")) else INTERP_TOL[key.split("/")[0]]
        assert err <= tol, (key, err, tol)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernels_compile_for_hopper_within_the_grids_register_budget():
    """Every variant of the kernels (gate's and up's halves or a fused B; the backward with and without
    fc2's deferred gradient; with and without the amax) compiles for sm_90a without spills, and the
    backward within the registers that let ``BWD_BLOCKS``' resident programs share an SM: its grid takes
    the token chunks that fill those slots once, so one register more would leave a second wave (the
    amax's variant with halves and fc2 took 130 of the 128 before its cap). At rank 16, as the models run."""
    bt, bf, warps, _, resident = S.BWD_BLOCKS
    budget = S.SM_REGISTERS // (resident * warps * 32)
    fp32 = {"db_ptr": "*fp32", "da2_ptr": "*fp32", "amax_ptr": "*fp32", "S2": "fp32"}
    backward, forward = {}, {}
    for amax, halves, fc2 in itertools.product((False, True), repeat=3):
        constexprs = dict(TCH=2048, BT=bt, BF=bf, BR=16, BR2=16, HALVES=halves, HAS_FC2=fc2, DOT_F32=False)
        constexprs["AMAX"] = amax
        backward[amax, halves, fc2] = hopper_resources(S._bwd_kernel, constexprs, S._bwd_options(amax), fp32)
    fbt, fbf, fwarps = S.FWD_BLOCKS
    for amax, halves in itertools.product((False, True), repeat=2):
        constexprs = dict(BT=fbt, BF=fbf, BR=16, HALVES=halves, DOT_F32=False, AMAX=amax)
        forward[amax, halves] = hopper_resources(S._fwd_kernel, constexprs, {"num_warps": fwarps}, fp32)
    assert all(spills == 0 for _, spills in (*backward.values(), *forward.values())), (backward, forward)
    assert all(registers <= budget for registers, _ in backward.values()), (budget, backward)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or S.triton is None, reason="needs a CUDA GPU and Triton")
def test_triton_kernels_on_cuda_match_the_reference():
    """The compiled kernels against the reference path on the GPU, output and every gradient with and
    without fc2's deferred A GEMM, at the Qwen3-8B MLP width for a few hundred tokens and at ragged
    small shapes. Tolerance: 2 ulps of the dtype relative to the largest value (bf16 1.6e-2, fp16 2e-3:
    the products are summed in another order, which can move a value across a rounding boundary); the
    no-grad entry is the autograd forward bit for bit."""
    cases = (((300,), 12288, 32, 16, False), ((300,), 12288, 16, 16, True), ((7, 3), 200, 5, 4, True))
    errors = _kernel_errors("cuda", cases, 2.0) | _amax_errors("cuda", cases, 2.0)
    errors.pop("launches")
    for key, err in errors.items():
        tol = (
            0.0
            if key.startswith(("nograd", "amax/"))
            else {"float16": 2e-3, "bfloat16": 1.6e-2}[key.split("/")[0]]
        )
        assert err <= tol, (key, err, tol)


if __name__ == "__main__":
    errors = _kernel_errors("cpu", INTERPRETED, 0.7) | _amax_errors("cpu", INTERPRETED, 0.7)
    print(json.dumps(errors | _chunk_errors("cpu", INTERPRETED, 0.7)))
