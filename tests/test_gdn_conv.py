"""twinkle_specs.gdn_conv: the Gated DeltaNet's short convolution + SiLU, channel-last, against torch.

The fp32 reference (``_reference``) is first checked against torch's depthwise ``conv1d`` (the
layer's portable path) and, for packed rows, against each sequence alone. The Triton kernels then run under
the Triton interpreter on CPU tensors (and on the GPU, gpu-marked) against that reference: output, input
gradient and weight gradient, max |Δ| relative to the largest value compared.

Tolerances: fp32 1e-5 (the same sums in another order; measured <= 1.7e-7). bf16 4e-2 under the interpreter,
which truncates fp32 -> bf16 casts where the GPU rounds to nearest, on a gradient that is rounded twice
(SiLU's gradient, then the input gradient; measured <= 9.5e-3); on the GPU 2 bf16 ulps, 1.6e-2. An
indexing, masking or sequence-boundary error shows as O(1).
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch
import torch.nn.functional as F

from twinkle_specs import gdn_conv as G

# torch and Triton only (the short convolution and its kernels; no megatron-core code): one leg of
# scripts/test.sh (pyproject.toml's one_leg marker).
pytestmark = pytest.mark.one_leg

INTERP_TOL = {"float32": 1e-5, "bfloat16": 4e-2}
# (batch, tokens, channels, packed sequence starts): ragged token and channel blocks, a row stride wider
# than the channels; packed: a one-token sequence and sequences shorter than the kernel
CASES = ((2, 70, 200, None), (1, 90, 130, (0, 5, 6, 8, 40)), (1, 33, 16, (0, 1, 2, 3, 4, 31)))


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _starts(bounds: tuple[int, ...] | None, tokens: int) -> torch.Tensor | None:
    if bounds is None:
        return None
    ends = (*bounds[1:], tokens)
    return torch.cat([torch.full((e - a,), a, dtype=torch.int32) for a, e in zip(bounds, ends, strict=True)])


def _inputs(batch: int, tokens: int, channels: int, dtype: torch.dtype, seed: int = 0):
    """x [b, s, c] as a column slice of a wider tensor (as the in_proj output's q/k/v columns), weight
    [c, 4], the output gradient."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, tokens, channels + 9, generator=g)[..., 3 : 3 + channels]
    w = torch.randn(channels, 4, generator=g) / 2
    return x.to(dtype), w.to(dtype), torch.randn(batch, tokens, channels, generator=g).to(dtype)


def _reference(x: torch.Tensor, weight: torch.Tensor, starts: torch.Tensor | None = None) -> torch.Tensor:
    """silu(causal depthwise conv) of ``x`` [b, s, c] with ``weight`` [c, K], in fp32,
    each packed sequence from its own start."""
    b, s, c = x.shape
    k = weight.shape[1]
    xs = x.float()
    out = torch.zeros(b, s, c, dtype=torch.float32, device=x.device)
    t = torch.arange(s, device=x.device)
    lo = torch.zeros_like(t) if starts is None else starts.long()
    for j in range(k):
        src = t - (k - 1) + j
        ok = src >= lo
        tap = xs[:, src.clamp(min=0)] * ok[None, :, None]
        out = out + tap * weight[:, j].float()
    return F.silu(out)


def _torch_conv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The layer's portable path: silu(conv1d) over a [b, c, s] copy."""
    k = w.shape[1]
    y = F.conv1d(x.transpose(1, 2), w[:, None], padding=k - 1, groups=w.shape[0])[..., : x.shape[1]]
    return F.silu(y).transpose(1, 2)


def test_reference_is_torch_conv1d_and_restarts_at_each_packed_sequence():
    x, w, _ = _inputs(2, 70, 24, torch.float64)
    torch.testing.assert_close(_reference(x, w), _torch_conv(x, w).float(), rtol=1e-6, atol=1e-6)
    bounds, tokens = (0, 5, 6, 8, 40), 50
    x, w, _ = _inputs(1, tokens, 24, torch.float64)
    packed = _reference(x, w, _starts(bounds, tokens))
    for a, e in zip(bounds, (*bounds[1:], tokens), strict=True):
        # fp32 sums over other tensor shapes (vectorised differently): 1 ulp apart at most
        torch.testing.assert_close(packed[:, a:e], _reference(x[:, a:e], w), rtol=1e-6, atol=1e-6)


def test_kernels_are_for_cuda_half_precision_silu():
    x, w, _ = _inputs(1, 8, 16, torch.bfloat16)
    assert not G.usable(x, w, "silu")  # host tensors: the torch path
    with pytest.raises(ValueError, match="one row"):
        G.conv_silu(torch.zeros(2, 4, 8), torch.zeros(8, 4), torch.zeros(4, dtype=torch.int32))


def _kernel_errors(device: str, cases: tuple, dtypes: tuple[torch.dtype, ...]) -> dict[str, float]:
    """The kernels (:func:`gdn_conv.conv_silu`) against the fp32 reference on ``device`` tensors: output,
    input and weight gradients, and the input gradient with the weight frozen."""
    errors: dict[str, float] = {}
    for dtype in dtypes:
        for batch, tokens, channels, bounds in cases:
            x, w, dy = (t.to(device) for t in _inputs(batch, tokens, channels, dtype, seed=1))
            starts = _starts(bounds, tokens)
            starts = None if starts is None else starts.to(device)
            key = f"{str(dtype)[6:]}/{batch}x{tokens}x{channels}/{'packed' if bounds else 'rows'}"
            xk, wk = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
            y = G.conv_silu(xk, wk, starts)
            y.backward(dy)
            xr, wr = x.detach().float().requires_grad_(True), w.detach().float().requires_grad_(True)
            yr = _reference(xr, wr, starts)
            yr.backward(dy.float())
            errors[f"{key}/out"] = _rel(y, yr)
            errors[f"{key}/dx"] = _rel(xk.grad, xr.grad)
            errors[f"{key}/dw"] = _rel(wk.grad, wr.grad)
            xf = x.detach().requires_grad_(True)
            G.conv_silu(xf, w, starts).backward(dy)  # frozen weight: no weight-gradient partials
            errors[f"{key}/dx-frozen-w"] = _rel(xf.grad, xr.grad)
        for case in (cases[0], cases[-1]):  # whole rows (the GPU test: at the 9B width), packed
            errors.update(_split_errors(device, dtype, case))
    return errors


def _split_errors(device: str, dtype: torch.dtype, case: tuple) -> dict[str, float]:
    """:func:`gdn_conv.split_conv_silu` on a whole in_proj-like output (three convolved sections, three
    passed through) against a split of the fp32 reference: every section's output, and the one gradient of
    the input it writes, with one output left unused (its gradient None)."""
    batch, tokens, channels, bounds = case
    g = torch.Generator().manual_seed(2)
    third, extra = channels // 3, (7, 1, 1)
    sections = (third, third, channels - 2 * third, *extra)
    x = torch.randn(batch, tokens, sum(sections), generator=g).to(dtype).to(device)
    w = (torch.randn(channels, 4, generator=g) / 2).to(dtype).to(device)
    dys = [torch.randn(batch, tokens, n, generator=g).to(dtype).to(device) for n in sections]
    starts = _starts(bounds, tokens)
    starts = None if starts is None else starts.to(device)
    xk, wk = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    outs = G.split_conv_silu(xk, wk, sections, starts)
    xr, wr = x.detach().float().requires_grad_(True), w.detach().float().requires_grad_(True)
    refs = (
        *_reference(xr[..., :channels], wr, starts).split(sections[:3], -1),
        *xr[..., channels:].split(extra, -1),
    )
    used = [0, 2, 3, 5]  # a convolved section (1) and a passed-through one (4) unused: no gradient
    torch.autograd.backward([outs[i] for i in used], [dys[i] for i in used])
    torch.autograd.backward([refs[i] for i in used], [dys[i].float() for i in used])
    key = f"{str(dtype)[6:]}/split/{batch}x{tokens}x{channels}/{'packed' if bounds else 'rows'}"
    errors = {f"{key}/out{i}": _rel(o, r) for i, (o, r) in enumerate(zip(outs, refs, strict=True))}
    errors[f"{key}/dx"] = _rel(xk.grad, xr.grad)
    errors[f"{key}/dw"] = _rel(wk.grad, wr.grad)
    return errors


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_under_interpreter():
    from test_lora_support import interpreted

    errors = interpreted(__file__)
    assert len(errors) == 2 * len(CASES) * 4 + 2 * 2 * 8, errors
    for key, err in errors.items():
        assert err <= INTERP_TOL[key.split("/")[0]], (key, err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or G.triton is None, reason="needs a CUDA GPU and Triton")
def test_triton_kernels_on_cuda_match_the_reference():
    """At the Qwen3.5-9B layer's width (q, k, v: 8,192 channels of in_proj's 12,352) for 1,024 tokens, and
    at the ragged shapes, bf16: within 2 bf16 ulps of the largest value."""
    x, w, _ = _inputs(1, 8, 16, torch.bfloat16)
    assert G.usable(x.cuda(), w.cuda(), "silu")
    errors = _kernel_errors(
        "cuda", ((1, 1024, 8192, None), (1, 1024, 8192, (0, 300, 301, 700)), *CASES), (torch.bfloat16,)
    )
    for key, err in errors.items():
        assert err <= 1.6e-2, (key, err)


if __name__ == "__main__":  # run by test_triton_kernels_under_interpreter with TRITON_INTERPRET=1
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    print(json.dumps(_kernel_errors("cpu", CASES, (torch.float32, torch.bfloat16))))
