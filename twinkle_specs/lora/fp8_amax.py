"""FP8 current scaling of the LoRA MLP's two largest tensors with the amax their kernels already took.

Under Transformer Engine's current-scaling recipe (megatron's ``--fp8-recipe tensorwise``) every FP8 cast
first reads its whole tensor once for the amax, then casts. The two largest tensors a LoRA MLP hands TE are
made by :mod:`.swiglu`'s kernels: SwiGLU's output (fc2's input, [T, F]) and SwiGLU's gradient (fc1's
output gradient, [T, 2F]). Those kernels can take the amax of what they write at no extra read. Here that
amax becomes the scale TE would compute from it (TE's ``compute_scale_from_amax``: the epsilon floor, 1 for
a zero or non-finite amax, ``max_fp8 / amax`` divided to nearest, fp32's largest value for an infinite
quotient, the power-of-two option), and TE's per-tensor cast (the cast of its delayed-scaling quantizer,
which takes a given scale) makes the FP8 tensor, which TE's linears take as they take their own: the same
scale and the same cast kernel, so the same FP8 values as TE's current scaling, one read fewer per tensor.

On by default (``TWINKLE_FP8_SWIGLU_AMAX=0`` turns it off): a cast applies where TE's recipe in force is
current scaling, the linear has set up its quantizers for it (its first FP8 forward), its weight is frozen
(no weight gradient: the FP8 tensor needs only its row-wise data) and its quantizer reduces no amax across
ranks. Elsewhere TE quantizes as before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no kernel without Triton: nothing here is offered then
    triton = None

ENV = "TWINKLE_FP8_SWIGLU_AMAX"
BLOCK = 1024
FLOAT32_MAX = torch.finfo(torch.float32).max  # TE's scale where max_fp8 / amax overflows

if triton is not None:

    @triton.jit
    def _scale_kernel(
        partials_ptr, scale_ptr, amax_ptr, max_fp8, eps,
        N: tl.constexpr, POW2: tl.constexpr, BLOCK: tl.constexpr, INF_SCALE: tl.constexpr,
    ):  # fmt: skip
        """One program: the amax over ``N`` partial maxima, and TE's scale for it (``compute_scale_from_amax``,
        transformer_engine/common/recipe/recipe_common.cuh)."""
        mx = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, N, BLOCK):
            i = start + tl.arange(0, BLOCK)
            mx = tl.maximum(mx, tl.load(partials_ptr + i, mask=i < N, other=0.0))
        amax = tl.max(mx, 0)
        tl.store(amax_ptr, amax)
        amax = tl.where(amax < eps, eps, amax)
        finite = (amax == amax) & (amax != 0.0) & (amax < float("inf"))
        scale = tl.math.div_rn(max_fp8, tl.where(finite, amax, 1.0))
        scale = tl.where(scale == float("inf"), INF_SCALE, scale)
        if POW2:  # keep sign and exponent
            bits = scale.to(tl.uint32, bitcast=True) & 0xFF800000
            scale = bits.to(tl.uint32).to(tl.float32, bitcast=True)
        tl.store(scale_ptr, tl.where(finite, scale, 1.0))


def scale_from_partials(partials: torch.Tensor, max_fp8: float, eps: float, pow2: bool) -> tuple:
    """``(scale, amax)``, each a one-element fp32 tensor on the partials' device, as TE's current scaling
    computes them for a tensor whose tiles' largest magnitudes are ``partials``."""
    scale = torch.empty(1, device=partials.device, dtype=torch.float32)
    amax = torch.empty_like(scale)
    _scale_kernel[(1,)](
        partials, scale, amax, float(max_fp8), float(eps),
        N=partials.numel(), POW2=bool(pow2), BLOCK=BLOCK, INF_SCALE=FLOAT32_MAX,
    )  # fmt: skip
    return scale, amax


@dataclass
class KnownAmaxCast:
    """A cast that follows one TE current-scaling quantizer's settings (FP8 format, epsilon, power-of-two
    scales), with the amax given as partial maxima."""

    like: Any  # transformer_engine's Float8CurrentScalingQuantizer

    def __call__(self, x: torch.Tensor, partials: torch.Tensor) -> torch.Tensor:
        """``x`` as TE's Float8Tensor (row-wise data only), connected to autograd as TE's own casts are
        (the gradient passes through unchanged)."""
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

        fp8 = torch.float8_e4m3fn if self.like.dtype == tex.DType.kFloat8E4M3 else torch.float8_e5m2
        max_fp8 = torch.finfo(fp8).max  # 448 and 57344, TE's max_norm of each format
        scale, amax = scale_from_partials(
            partials, max_fp8, self.like.amax_epsilon, self.like.force_pow_2_scales
        )
        quantizer = Float8Quantizer(scale, amax, self.like.dtype, rowwise=True, columnwise=False)
        return quantizer(x)


@dataclass
class SwigluFp8:
    """The casts :class:`~.swiglu.SwigluLora` takes amaxes for: of its output, as fc2's input (``input``)
    and of its gradient, as fc1's output gradient (``grad``); either may be None. The forward leaves its
    output's partial maxima in ``input_amax`` for the caller's cast."""

    input: KnownAmaxCast | None
    grad: KnownAmaxCast | None
    input_amax: torch.Tensor | None = None


def swiglu_fp8(fc1: torch.nn.Module, fc2: torch.nn.Module | None) -> SwigluFp8 | None:
    """The casts that apply to this forward of a LoRA MLP (see the module docstring), or None: fc1's
    output gradient, and fc2's input where ``fc2`` (the linear that takes SwiGLU's output as its base
    input) is given."""
    if os.environ.get(ENV, "1") == "0" or triton is None:
        return None
    grad = _quantizer(fc1, "scaling_bwd")
    cast_in = _quantizer(fc2, "scaling_fwd") if fc2 is not None else None
    if grad is None and cast_in is None:
        return None
    return SwigluFp8(KnownAmaxCast(cast_in) if cast_in else None, KnownAmaxCast(grad) if grad else None)


def _quantizer(module: torch.nn.Module, kind: str) -> Any:
    """The TE linear's current-scaling quantizer of its input (``scaling_fwd``) or output gradient
    (``scaling_bwd``) where a known-amax cast can stand in for it, else None."""
    try:
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
        from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer
    except ImportError:
        return None
    if (
        not FP8GlobalStateManager.is_fp8_enabled()
        or not FP8GlobalStateManager.get_fp8_recipe().float8_current_scaling()
    ):
        return None
    meta_recipe = getattr(module, "fp8_meta", {}).get("recipe")
    if meta_recipe is None or not meta_recipe.float8_current_scaling():
        return None  # not set up for this recipe yet: its first FP8 forward does
    weight = getattr(module, "weight", None)
    if weight is None or weight.requires_grad:
        return None  # a weight gradient would need the tensor's column-wise data too
    slot = tex.FP8FwdTensors.GEMM1_INPUT if kind == "scaling_fwd" else tex.FP8BwdTensors.GRAD_OUTPUT1
    quantizers = getattr(module, "quantizers", {}).get(kind) or []
    try:
        quantizer = quantizers[slot]
    except (IndexError, KeyError, TypeError):
        return None
    if type(quantizer) is not Float8CurrentScalingQuantizer or quantizer.with_amax_reduction:
        return None
    return quantizer
