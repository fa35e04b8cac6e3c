"""FP8 current scaling of LoRA's largest tensors with the amax the kernels that write them already took.

Under Transformer Engine's current-scaling recipe (megatron's ``--fp8-recipe tensorwise``) every FP8 cast
first reads its whole tensor once for the amax, then casts. Several tensors an adapted layer hands TE's
linears are written by our own kernels, which can take the amax of what they write at no extra read:
SwiGLU's output (fc2's input, [T, F]) and gradient (fc1's output gradient, [T, 2F]) in :mod:`.swiglu`,
the norm outputs that QKV and fc1 take (:class:`~.norm.HiddenNorm`), and QKV's output gradient, written
by the q/k norm + RoPE backward (:mod:`.qk_rope`). Here that amax becomes the scale TE would compute
from it (TE's ``compute_scale_from_amax``: the epsilon floor, 1 for a zero or non-finite amax,
``max_fp8 / amax`` divided to nearest, fp32's largest value for an infinite quotient, the power-of-two
option), and a cast kernel with TE's arithmetic (``x * scale`` rounded to nearest, saturating; the inverse
scale ``1 / scale``) makes TE's FP8 tensor, which TE's linears take as they take their own: the same FP8
values as TE's current scaling, one read fewer per tensor. (TE's own cast with a given scale, that of its
delayed-scaling quantizer, would take the amax once more on the way; it serves strided tensors.)

How the amax travels: a forward tensor carries its kernel's partial maxima (:func:`tag`, checked against
the tensor's version when read, :func:`tagged`); a gradient's go through a :class:`GradAmax` from the
backward that writes the gradient to the cast in front of the linear whose output gradient it is
(checked against the gradient's storage), where any mismatch leaves the cast to TE.

On by default (``TWINKLE_FP8_KERNEL_AMAX=0`` turns it off): a cast applies where TE's recipe in force is
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

ENV = "TWINKLE_FP8_KERNEL_AMAX"
AMAX_ATTR = "_twinkle_fp8_amax"  # a forward tensor's (partial maxima, version), see tag()
BLOCK = 4096  # the scale kernel's partial maxima per pass (those of a 4096-token norm output in one)
CAST_BLOCK = 4096
FLOAT32_MAX = torch.finfo(torch.float32).max  # TE's scale where max_fp8 / amax overflows

if triton is not None:

    @triton.jit
    def _scale_kernel(
        partials_ptr, scale_ptr, scale_inv_ptr, amax_ptr, max_fp8, eps,
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
        scale = tl.where(finite, scale, 1.0)
        tl.store(scale_ptr, scale)
        tl.store(scale_inv_ptr, tl.math.div_rn(1.0, scale))  # TE's cast kernels' reciprocal, 1 / scale

    @triton.jit
    def tile_amax(x, m):
        """The largest magnitude of tile ``x`` where ``m`` (fp32): a kernel's part of the amax FP8 current
        scaling takes of what it writes (``x`` as written, rounded to its dtype)."""
        return tl.max(tl.max(tl.where(m, tl.abs(x.to(tl.float32)), 0.0), 1), 0)

    @triton.jit
    def _cast_kernel(x_ptr, scale_ptr, out_ptr, n, BLOCK: tl.constexpr):
        """``x * scale`` rounded to nearest in the output's FP8 format, saturating: TE's per-tensor cast
        (``unary_kernel``) without the amax it takes on the way, which is known here."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, (x * tl.load(scale_ptr)).to(out_ptr.dtype.element_ty), mask=m)


def scale_from_partials(partials: torch.Tensor, max_fp8: float, eps: float, pow2: bool) -> tuple:
    """``(scale, amax, scale_inv)``, each a one-element fp32 tensor on the partials' device, as TE's
    current scaling computes them for a tensor whose tiles' largest magnitudes are ``partials``."""
    # each its own allocation: cuBLAS takes the inverse scale's address, which an offset view misaligns
    scale, amax, scale_inv = (torch.empty(1, device=partials.device, dtype=torch.float32) for _ in range(3))
    _scale_kernel[(1,)](
        partials, scale, scale_inv, amax, float(max_fp8), float(eps),
        N=partials.numel(), POW2=bool(pow2), BLOCK=BLOCK, INF_SCALE=FLOAT32_MAX, num_warps=8,
    )  # fmt: skip
    return scale, amax, scale_inv


class _KnownAmaxCastFunc(torch.autograd.Function):
    """The cast as TE connects its own to autograd: the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cast: Any) -> torch.Tensor:
        return cast(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


@dataclass
class KnownAmaxCast:
    """A cast that follows one TE current-scaling quantizer's settings (FP8 format, epsilon, power-of-two
    scales), with the amax given as partial maxima."""

    like: Any  # transformer_engine's Float8CurrentScalingQuantizer

    def __call__(self, x: torch.Tensor, partials: torch.Tensor) -> torch.Tensor:
        """``x`` as TE's Float8Tensor (row-wise data only), connected to autograd as TE's own casts are
        (the gradient passes through unchanged). A contiguous CUDA tensor is cast by :func:`_cast_kernel`
        (TE's cast without its amax), another by TE's delayed-scaling cast with the scale given."""
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer, Float8Tensor

        fp8 = torch.float8_e4m3fn if self.like.dtype == tex.DType.kFloat8E4M3 else torch.float8_e5m2
        max_fp8 = torch.finfo(fp8).max  # 448 and 57344, TE's max_norm of each format
        scale, amax, scale_inv = scale_from_partials(
            partials, max_fp8, self.like.amax_epsilon, self.like.force_pow_2_scales
        )
        quantizer = Float8Quantizer(scale, amax, self.like.dtype, rowwise=True, columnwise=False)
        if not (x.is_cuda and x.is_contiguous()):
            return quantizer(x)

        def cast(x: torch.Tensor) -> torch.Tensor:
            data = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
            n = x.numel()
            _cast_kernel[(triton.cdiv(n, CAST_BLOCK),)](
                x, scale, data.view(fp8), n, BLOCK=CAST_BLOCK, num_warps=8
            )
            return Float8Tensor(
                shape=x.shape, dtype=x.dtype, data=data, fp8_scale_inv=scale_inv, fp8_dtype=self.like.dtype,
                requires_grad=False, quantizer=quantizer,
            )  # fmt: skip

        if torch.is_grad_enabled() and x.requires_grad:
            return _KnownAmaxCastFunc.apply(x, cast)
        return cast(x)


class GradAmax:
    """The partial maxima of one gradient, from the backward that writes it (:meth:`give`) to the cast in
    front of the TE linear whose output gradient it is (:meth:`__call__`), one per forward."""

    __slots__ = ("cast", "partials", "ptr")

    def __init__(self, cast: KnownAmaxCast) -> None:
        self.cast, self.partials, self.ptr = cast, None, None

    def give(self, grad: torch.Tensor, partials: torch.Tensor) -> None:
        self.partials, self.ptr = partials, grad.data_ptr()

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` as TE's FP8 tensor where the partial maxima given are this very tensor's, else as it is
        (TE then takes its amax)."""
        partials, self.partials = self.partials, None
        if partials is None or grad.data_ptr() != self.ptr:
            return grad
        return self.cast(grad, partials)


class CastGrad(torch.autograd.Function):
    """Identity whose backward hands the gradient through ``cast`` (a :class:`GradAmax`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cast: GradAmax) -> torch.Tensor:
        ctx.cast = cast
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.cast(grad), None


def tag(t: torch.Tensor, partials: torch.Tensor, attr: str = AMAX_ATTR) -> torch.Tensor:
    """``t`` carrying the partial maxima its kernel took, for the linear that takes ``t`` next (``attr``:
    another statistic of ``t`` under another name, e.g. the rows' 1/rms, :data:`~.norm.RSTD_ATTR`)."""
    setattr(t, attr, (partials, t._version))
    return t


def tagged(t: torch.Tensor, attr: str = AMAX_ATTR) -> torch.Tensor | None:
    """What :func:`tag` left on ``t`` under ``attr``, None if none or ``t`` was modified since."""
    entry = getattr(t, attr, None)
    return entry[0] if entry is not None and entry[1] == t._version else None


def input_cast(module: torch.nn.Module) -> KnownAmaxCast | None:
    """The known-amax cast of this TE linear's input for this forward, or None (module docstring)."""
    quantizer = _quantizer(module, "scaling_fwd") if _enabled() else None
    return KnownAmaxCast(quantizer) if quantizer is not None else None


def grad_cast(module: torch.nn.Module) -> KnownAmaxCast | None:
    """The known-amax cast of this TE linear's output gradient for this forward, or None."""
    quantizer = _quantizer(module, "scaling_bwd") if _enabled() else None
    return KnownAmaxCast(quantizer) if quantizer is not None else None


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
    grad = grad_cast(fc1)
    cast_in = input_cast(fc2) if fc2 is not None else None
    if grad is None and cast_in is None:
        return None
    return SwigluFp8(cast_in, grad)


def _enabled() -> bool:
    return os.environ.get(ENV, "1") != "0" and triton is not None


def current_scaling() -> bool:
    """Whether the casts are on and TE's recipe in force is current scaling: the kernels then take the
    amax of what they write."""
    return _enabled() and _te_current_scaling()


def _te_current_scaling() -> bool:
    try:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    except ImportError:
        return False
    return (
        FP8GlobalStateManager.is_fp8_enabled()
        and FP8GlobalStateManager.get_fp8_recipe().float8_current_scaling()
    )


def _quantizer(module: torch.nn.Module, kind: str) -> Any:
    """The TE linear's current-scaling quantizer of its input (``scaling_fwd``) or output gradient
    (``scaling_bwd``) where a known-amax cast can stand in for it, else None."""
    if not _te_current_scaling():
        return None
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

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
