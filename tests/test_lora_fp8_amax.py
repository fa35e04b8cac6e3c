"""twinkle_specs.lora.fp8_amax: FP8 current scaling from the amax our kernels take.

On CPU: the scale kernel under the Triton interpreter against a transcription of Transformer Engine's
``compute_scale_from_amax`` (transformer_engine/common/recipe/recipe_common.cuh, TE 2.11), exactly;
when the casts are offered (on by default, off with ``TWINKLE_FP8_KERNEL_AMAX=0``); how a gradient's and a
forward tensor's partial maxima travel to their cast. The casts against TE's own current scaling, bit for bit, and a
LoRA model trained with them: tests/test_lora_gpu.py.
"""

from __future__ import annotations

import importlib.util
import json
import math
import struct

import numpy as np
import pytest
import torch
from test_lora_support import interpreted

from twinkle_specs.lora import fp8_amax

# torch, Triton and Transformer Engine stand-ins only (no megatron-core code): one leg of scripts/test.sh
# (pyproject.toml's one_leg marker).
pytestmark = pytest.mark.one_leg

E4M3_MAX, E5M2_MAX = 448.0, 57344.0

# partial maxima: ordinary, zeros, a subnormal amax (its quotient overflows fp32), an infinite and a NaN
# partial, more partials than one block of the kernel
CASES = {
    "ordinary": [0.3, 1.7, 0.2],
    "zeros": [0.0, 0.0],
    "subnormal": [1e-40, 0.0],
    "infinite": [3.0, math.inf],
    "nan-partial": [math.nan, 2.0],
    "many": [float(i % 977) / 7 for i in range(3000)],
}


def te_scale(amax: float, max_fp8: float, pow2: bool, eps: float) -> float:
    """TE's compute_scale_from_amax in fp32, line by line (fp32 max for an infinite quotient)."""
    a = np.float32(amax)
    if a < eps:
        a = np.float32(eps)
    if math.isinf(a) or a == 0 or math.isnan(a):
        return 1.0
    with np.errstate(over="ignore"):
        scale = np.float32(max_fp8) / a
    if math.isinf(scale):
        scale = np.float32(np.finfo(np.float32).max)
    if pow2:
        (bits,) = struct.unpack("<I", struct.pack("<f", scale))
        (scale,) = struct.unpack("<f", struct.pack("<I", bits & 0xFF800000))
    return float(scale)


def _diff(a: float, b: float) -> float:
    """0 for equal values (infinities included), else |a - b| (inf where one is not finite)."""
    return 0.0 if a == b else abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf


def _scale_errors() -> dict[str, float]:
    """|kernel - TE's formula| for every case, format, epsilon and power-of-two option; the amax too."""
    errors = {}
    for name, values in CASES.items():
        partials = torch.tensor(values, dtype=torch.float32)
        amax = float(np.float32(np.nanmax(values)))  # as the fp32 partials hold it
        for max_fp8 in (E4M3_MAX, E5M2_MAX):
            for eps in (0.0, 1e-3):
                for pow2 in (False, True):
                    out = fp8_amax.scale_from_partials(partials, max_fp8, eps, pow2)
                    scale, got_amax, scale_inv = out
                    key = f"{name}/{max_fp8:g}/{eps:g}/{pow2}"
                    # each its own allocation (cuBLAS rejects an inverse scale at an offset into another)
                    errors[f"own/{key}"] = float(any(t.storage_offset() or t.numel() != 1 for t in out))
                    want = te_scale(amax, max_fp8, pow2, eps)
                    errors[f"scale/{key}"] = _diff(scale.item(), want)
                    errors[f"amax/{key}"] = _diff(got_amax.item(), amax)
                    # TE's cast kernels' reciprocal: 1 / scale in fp32, rounded to nearest
                    with np.errstate(divide="ignore"):
                        errors[f"scale_inv/{key}"] = _diff(
                            scale_inv.item(), float(np.float32(1) / np.float32(want))
                        )
    return errors


def _cast_errors() -> dict[str, float]:
    """The cast kernel's blocks, masking and scale, with an fp32 output (the interpreter's own FP8 rounding
    is not the GPU's: the FP8 bytes against TE's cast, bit for bit, are the GPU test's): every value
    ``x * scale`` exactly, over ragged blocks, and the bytes past the end unwritten."""
    n = 2 * fp8_amax.CAST_BLOCK + 37
    x = (torch.randn(n, generator=torch.Generator().manual_seed(3)) * 5).to(torch.bfloat16)
    scale = torch.tensor([448.0 / x.float().abs().max().item()])
    out = torch.full((n + 5,), -7.0)
    fp8_amax._cast_kernel[(3,)](x, scale, out, n, BLOCK=fp8_amax.CAST_BLOCK)
    return {
        "cast": (out[:n] - x.float() * scale).abs().max().item(),
        "cast-tail": float(not torch.all(out[n:] == -7.0)),
    }


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_scale_kernel_is_te_compute_scale_from_amax():
    errors = interpreted(__file__)
    assert (errors.pop("cast"), errors.pop("cast-tail")) == (0.0, 0.0)
    assert len(errors) == len(CASES) * 2 * 2 * 2 * 4, errors
    assert errors["scale/ordinary/448/0/False"] == 0.0 and te_scale(1.7, E4M3_MAX, False, 0.0) != 1.0
    assert all(err == 0.0 for err in errors.values()), {k: e for k, e in errors.items() if e}


def test_nothing_is_offered_when_turned_off_or_without_te_fp8(monkeypatch):
    """``TWINKLE_FP8_KERNEL_AMAX=0`` offers nothing; on by default, a module that is no TE linear under FP8
    current scaling (here a torch Linear outside any FP8 autocast) gets nothing either: TE quantizes as before."""
    layer = torch.nn.Linear(4, 4)
    monkeypatch.setenv(fp8_amax.ENV, "0")
    assert fp8_amax.swiglu_fp8(layer, layer) is None
    monkeypatch.delenv(fp8_amax.ENV)
    assert fp8_amax.swiglu_fp8(layer, layer) is None


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_casts_are_offered_by_default_where_te_has_a_quantizer(monkeypatch):
    """Where TE's linears have a current-scaling quantizer that a known-amax cast can stand in for (here
    stood in by a marker), the casts are offered unless ``TWINKLE_FP8_KERNEL_AMAX=0``: fc1's gradient always,
    fc2's input only where fc2 is given."""
    fc1, fc2 = torch.nn.Linear(4, 8), torch.nn.Linear(4, 4)
    quantizers = {(fc1, "scaling_bwd"): "fc1-grad", (fc2, "scaling_fwd"): "fc2-input"}
    monkeypatch.setattr(fp8_amax, "_quantizer", lambda module, kind: quantizers.get((module, kind)))
    monkeypatch.delenv(fp8_amax.ENV, raising=False)
    casts = fp8_amax.swiglu_fp8(fc1, fc2)
    assert casts is not None and (casts.grad.like, casts.input.like) == ("fc1-grad", "fc2-input")
    only_grad = fp8_amax.swiglu_fp8(fc1, None)
    assert only_grad is not None and only_grad.input is None and only_grad.grad.like == "fc1-grad"
    monkeypatch.setenv(fp8_amax.ENV, "1")
    assert fp8_amax.swiglu_fp8(fc1, fc2) is not None
    monkeypatch.setenv(fp8_amax.ENV, "0")
    assert fp8_amax.swiglu_fp8(fc1, fc2) is None


class _Cast:
    """Stands in for KnownAmaxCast: records the partial maxima and marks the tensor it returns."""

    def __init__(self) -> None:
        self.partials: list = []

    def __call__(self, x: torch.Tensor, partials: torch.Tensor) -> torch.Tensor:
        self.partials.append(partials)
        return x * 3


def test_a_gradients_partial_maxima_reach_its_cast_once_and_only_for_that_tensor():
    """GradAmax: the cast gets the partial maxima given for the very gradient it is handed, once; a
    gradient in other storage (the partial maxima would not be its own) and a second call go to TE as
    they are."""
    cast = _Cast()
    link, grad, partials = fp8_amax.GradAmax(cast), torch.randn(4, 6), torch.rand(3)
    assert link(grad) is grad and not cast.partials  # nothing given yet
    link.give(grad, partials)
    assert torch.equal(link(grad), grad * 3) and cast.partials == [partials]
    assert link(grad) is grad and len(cast.partials) == 1  # taken once
    link.give(grad, partials)
    other = grad.clone()
    assert link(other) is other and len(cast.partials) == 1


def test_cast_grad_hands_the_gradient_through_its_link():
    cast = _Cast()
    link = fp8_amax.GradAmax(cast)
    x = torch.randn(4, 6, requires_grad=True)
    y = fp8_amax.CastGrad.apply(x, link)
    grad = torch.randn(4, 6)
    link.give(grad, torch.rand(2))
    y.backward(grad)
    assert torch.equal(x.grad, grad * 3) and len(cast.partials) == 1


def test_a_tag_is_dropped_when_its_tensor_changes():
    """The partial maxima a kernel left on its output stand only while the output is unmodified."""
    t, partials = torch.randn(5), torch.rand(2)
    assert fp8_amax.tagged(t) is None
    assert fp8_amax.tag(t, partials) is t and fp8_amax.tagged(t) is partials
    t.add_(1.0)
    assert fp8_amax.tagged(t) is None


if __name__ == "__main__":
    print(json.dumps(_scale_errors() | _cast_errors()))
