"""twinkle_specs.lora.grouped_low_rank: ``out[i] += h[i] @ m[e]`` in place per expert block, against fp64.

The torch path (CPU tensors) is checked against an fp64 sum of each expert block alone; the Triton kernel
then runs under the Triton interpreter on CPU tensors (and on the GPU, gpu-marked) against the torch path.
Routings have experts without tokens at the start, in the middle and at the end, blocks longer than a
row tile and shorter than one, columns not a multiple of the column tile, ranks below, at and above 16,
and ``m`` as the transpose of a [E, N, R] tensor (the forward's ``B_eᵀ``) as well as contiguous.

Tolerances, max |Δ| relative to the largest value compared: torch path vs fp64, fp32 1e-6 (measured
<= 2.2e-7), bf16 one rounding of the fp32 sum, 2**-8 (measured <= 3.5e-3). Interpreted kernel vs torch
path: fp32 1e-6; bf16 1.6e-2, 2 ulps (the Triton 3.6 interpreter truncates fp32 -> bf16 casts where
torch rounds to nearest; measured <= 6.9e-3). On the GPU: bf16 2**-8, one ulp (the products summed in
another order can move a value across a rounding boundary). An indexing or masking error (a row given
another expert's factor, a row or column skipped or done twice) shows as O(1).
"""

from __future__ import annotations

import json

import pytest
import torch
from test_lora_support import CountingKernel, interpreted

from twinkle_specs.lora import grouped_low_rank as G

# torch and Triton only (the grouped low-rank accumulation and its kernel; no megatron-core code): one
# leg of scripts/test.sh (pyproject.toml's one_leg marker).
pytestmark = pytest.mark.one_leg

TOL = {"float32": 1e-6, "bfloat16": 2**-8}
INTERP_TOL = {"float32": 1e-6, "bfloat16": 1.6e-2}
# (splits, N, R): empty experts first, between and last; a block of 70 rows over two 64-row tiles
CASES = (([0, 3, 0, 70, 0, 1, 0], 200, 5), ([130], 130, 16), ([64, 0, 64, 9], 128, 32))


def _inputs(splits: list[int], n: int, r: int, dtype: torch.dtype, transposed: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows, experts = sum(splits), len(splits)
    out = torch.randn(rows, n, generator=g)
    h = torch.randn(rows, r, generator=g)
    m = torch.randn(experts, n, r, generator=g).transpose(1, 2) if transposed else torch.randn(experts, r, n)
    ends = torch.tensor(splits).cumsum(0).to(torch.int32)
    return out.to(dtype), h.to(dtype), m.to(dtype), ends


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _fp64(out, h, m, splits):
    blocks = torch.split(h.double(), splits)
    return out.double() + torch.cat([blk @ m[e].double() for e, blk in enumerate(blocks)])


@pytest.mark.parametrize("transposed", [False, True], ids=["m", "b-transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_torch_path_is_each_blocks_sum(dtype, transposed):
    for splits, n, r in CASES:
        out, h, m, ends = _inputs(splits, n, r, dtype, transposed)
        got = out.clone()
        G.grouped_low_rank_add_(got, h, m, ends)
        err = _rel(got, _fp64(out, h, m, splits))
        assert err <= TOL[str(dtype).split(".")[1]], (splits, err)
        if sum(n > 0 for n in splits) < 2:
            continue
        # every block met its own expert's factor: with the experts' factors shifted by one, it is off
        wrong = out.clone()
        G.grouped_low_rank_add_(wrong, h, m.roll(1, 0), ends)
        assert _rel(wrong, _fp64(out, h, m, splits)) > 0.05


def test_rejects_mismatched_inputs():
    out, h, m, ends = _inputs([3, 4], 16, 4, torch.float32, False)
    with pytest.raises(ValueError, match=r"shapes out \(7, 16\), h \(7, 3\)"):
        G.grouped_low_rank_add_(out, h[:, :3], m, ends)
    with pytest.raises(ValueError, match=r"ends \(3,\) for 2 experts"):
        G.grouped_low_rank_add_(out, h, m, torch.tensor([3, 7, 7], dtype=torch.int32))
    with pytest.raises(ValueError, match="rows must be contiguous"):
        G.grouped_low_rank_add_(out.t().contiguous().t(), h, m, ends)


def _kernel_errors(device: str, tol_case) -> dict:
    """The Triton kernel against the torch path on ``device`` tensors, per dtype, case and layout of m."""
    kernel = CountingKernel(G._add_kernel)
    G._add_kernel, errors = kernel, {}
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for i, (splits, n, r) in enumerate(tol_case):
                for transposed in (False, True):
                    out, h, m, ends = (t.to(device) for t in _inputs(splits, n, r, dtype, transposed, seed=i))
                    want, got = out.clone(), out.clone()
                    G._reference_add_(want, h, m, ends)
                    G._triton_add_(got, h, m, ends)
                    errors[f"{str(dtype).split('.')[1]}/{i}/{transposed}"] = _rel(got, want)
    finally:
        G._add_kernel = kernel.kernel
    return errors | {"launches": kernel.launches}


@pytest.mark.skipif(G.triton is None, reason="triton is not installed")
def test_triton_kernel_under_interpreter():
    errors = interpreted(__file__)
    assert errors.pop("launches") == 2 * len(CASES) * 2, errors
    for key, err in errors.items():
        assert err <= INTERP_TOL[key.split("/")[0]], (key, err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or G.triton is None, reason="needs a CUDA GPU and Triton")
def test_triton_kernel_on_cuda_matches_the_reference():
    """At Qwen3-30B-A3B's routed shape (128 experts, 8,192 rows here, uneven routing with empty experts,
    fc1's 1,536 and fc2's 2,048 columns, r = 16) and the ragged small cases."""
    g = torch.Generator().manual_seed(0)
    splits = [int(v) for v in torch.randint(0, 128, (128,), generator=g)]
    splits[0] = splits[40] = splits[-1] = 0
    cases = ((splits, 1536, 16), (splits, 2048, 16), *CASES)
    errors = _kernel_errors("cuda", cases)
    errors.pop("launches")
    for key, err in errors.items():
        assert err <= {"float32": 1e-6, "bfloat16": 2**-8}[key.split("/")[0]], (key, err)


if __name__ == "__main__":
    print(json.dumps(_kernel_errors("cpu", CASES)))
