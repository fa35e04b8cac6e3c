"""LoRA wrappers of megatron-core's Transformer Engine linears (imported only on the TE path).

Same factors, TP rules and fused slot computation as :mod:`twinkle_specs.lora.layers`. There is no
wrapper of TE's norm-fused linear: an adapted QKV or fc1 is built as megatron's TENorm followed by a
plain TE linear (:mod:`twinkle_specs.lora.spec`), so that the adapter shares the norm's output and its
backward with the base. Grouped-GEMM experts hold per-expert factors stacked on dim 0 and apply them
to each expert's token block (``m_splits``) with torch's grouped GEMM where it runs (CUDA sm90, bf16),
else one expert at a time; there their frozen base runs as one grouped GEMM too, not TE's GEMM per
expert (:mod:`.experts`), and an expert fc1's adapter keeps the router's input instead of the routed
tokens where it is linked to the router (:class:`~twinkle_specs.lora.recompute.RoutedTokens`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from megatron.core.extensions.transformer_engine import (
    TEColumnParallelGroupedLinear,
    TEColumnParallelLinear,
    TERowParallelGroupedLinear,
    TERowParallelLinear,
)

from .experts import (
    DeviceCounts,
    FrozenGroupedLora,
    FrozenGroupedMM,
    StackedWeights,
    expert_delta_grouped,
    expert_delta_loop,
    group_ends,
    grouped_mm_fits,
    on_host,
)
from .fp8_copies import Fp8CopyHistory, copies_to_settle, weights_stamp
from .layers import LoraLayerMixin, LoraLinearMixin
from .recompute import recompute_allowed


def te_norm_recompute(norm: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """How an adapter after a TE norm recomputes its input in backward: TE's RMSNorm kernel called as a
    function with the module's weight, epsilon, gamma rule and forward SM margin, as the module's training
    forward calls it. Not the module itself: TE's norms are fusible operations, and one called outside
    FP8 autocast (as the backward is) drops its quantization state (``BasicOperation.reset_recipe_state``),
    which the next forward under FP8 builds again and which TE's CUDA graphs refuse to capture ("Saved FP8
    metadata does not match operation's FP8 metadata"). Another TE norm (LayerNorm) or a TE without that
    kernel: the module's forward, as before. :class:`~.recompute.InputRecipe` checks bit for bit on first
    use either way."""
    try:
        from transformer_engine.pytorch.constants import TE_DType
        from transformer_engine.pytorch.ops import RMSNorm
        from transformer_engine_torch import rmsnorm_fwd
    except ImportError:
        RMSNorm = None
    if RMSNorm is None or not isinstance(norm, RMSNorm):
        return norm.forward

    def rmsnorm(x: torch.Tensor) -> torch.Tensor:
        weight = norm.weight
        margin = getattr(norm, "_sm_margins", {}).get("forward", 0)
        rows = x.contiguous().view(-1, weight.numel())
        y, _, _ = rmsnorm_fwd(
            rows,
            weight.view(-1),
            norm.eps,
            None,
            None,
            TE_DType[weight.dtype],
            margin,
            norm.zero_centered_gamma,
        )
        return y.view(x.shape)

    return rmsnorm


class FrozenFp8WeightCache:
    """Under FP8, TE quantizes a linear's weight on a micro-batch whose ``is_first_microbatch`` is True and
    reuses that FP8 copy (and its transpose) while it is False; megatron sets it True at the start of
    every iteration (``set_is_first_microbatch``), because trained weights change at each optimizer step.
    A LoRA base is frozen, so its FP8 copy stays right until the weight itself changes: once a training
    forward has made the copy that every later one would make again, this keeps the flag False for as long
    as every base weight is frozen and unchanged (the same storage and version counter: a load, a merge or
    an unmerge writes the weight in place and so requantizes it). Each iteration then skips reading every
    base weight in bf16 and writing it twice in FP8. Without FP8, or with a base weight that trains, the
    flag is megatron's. Under TE's CUDA graphs the model chunk decides instead (:mod:`.fp8_copies`)."""

    @property
    def is_first_microbatch(self) -> bool:
        return self.__dict__.get("_lora_first_microbatch", True)

    @is_first_microbatch.setter
    def is_first_microbatch(self, value: bool) -> None:
        state = self.__dict__
        history = state.setdefault("_lora_copies", Fp8CopyHistory())
        if not value and state.get("_lora_first_microbatch", True):
            # a forward has just quantized the weight; a training one, so the copy holds the transpose
            # that the backward's input-gradient GEMM reads too
            history.quantized(self._lora_base_stamp() if torch.is_grad_enabled() else None)
        elif value and history.final(self._lora_base_stamp, self._lora_copies_to_settle()):
            return  # the frozen base is as it was quantized: TE keeps its FP8 copy
        state["_lora_first_microbatch"] = value

    def _lora_copies_to_settle(self) -> int:
        return copies_to_settle(getattr(self, "config", None))

    def _lora_base_stamp(self) -> tuple | None:
        """What identifies the base weights' values (:func:`~.fp8_copies.weights_stamp`); None where the FP8
        copy may not be kept (no FP8, a recipe whose quantizer this does not know, or a base weight that
        trains)."""
        if not self._lora_copies_to_settle():
            return None
        return weights_stamp([w for _, w in self.lora_base_weights()])


class LoraTEColumnParallelLinear(FrozenFp8WeightCache, LoraLinearMixin, TEColumnParallelLinear):
    """TE column-parallel linear (linear_qkv and linear_fc1 after a TENorm, experts' linear_fc1)."""

    lora_parallel = "column"


class LoraTERowParallelLinear(FrozenFp8WeightCache, LoraLinearMixin, TERowParallelLinear):
    """TE row-parallel linear (linear_proj, linear_fc2)."""

    lora_parallel = "row"


class FrozenGroupedBase:
    """TE grouped-GEMM experts whose frozen base runs as one torch grouped GEMM (:class:`FrozenGroupedMM`
    over the experts' weights stacked, :class:`StackedWeights`) where torch has it for these tensors,
    instead of TE's GEMM per expert: with many small experts (Qwen3.5-MoE's 256 per layer) those launches,
    not the arithmetic, set the step time. Weights that train, a bias, FP8/FP4 or a token block torch's
    grouped GEMM does not take: TE's GroupedLinear, as built. Takes the token counts on the GPU
    (:class:`~.experts.DeviceCounts`) as well as on the host."""

    accepts_device_counts = True

    def forward(self, x: torch.Tensor, m_splits: Any):
        return self._grouped_base(x, *self._base_plan(x, m_splits))[:2]

    def _base_plan(self, x: torch.Tensor, m_splits: Any) -> tuple[Any, torch.Tensor | None]:
        """``(splits, stack)``: the token blocks' sizes (a list, or the :class:`~.experts.DeviceCounts`
        given) and the weight stack the grouped GEMM reads, None where TE's GroupedLinear runs the base."""
        if isinstance(m_splits, DeviceCounts):
            splits = m_splits
        else:
            splits = m_splits.tolist() if torch.is_tensor(m_splits) else list(m_splits)
        return splits, self._frozen_base_stack(x, splits)

    def _grouped_base(
        self, x: torch.Tensor, splits: Any, stack: torch.Tensor | None
    ) -> tuple[torch.Tensor, Any, Any, Any]:
        """``(out, bias, splits, ends)``: the base's output, the splits (on the host where TE's
        GroupedLinear ran) and, where the grouped GEMM ran, the token blocks' ends on the device."""
        if stack is None:
            splits = on_host(splits)
            out, bias = super().forward(x, splits)
            return out, bias, splits, None
        ends = group_ends(splits, x.device)
        return FrozenGroupedMM.apply(x, stack, ends), None, splits, ends

    def _frozen_base_stack(self, x: torch.Tensor, splits: Any) -> torch.Tensor | None:
        """The experts' weights as one [experts, out, in] tensor for :class:`FrozenGroupedMM`, or None
        where TE's GroupedLinear runs the base (see the class)."""
        config = self.config
        if getattr(self, "use_bias", False) or getattr(config, "fp8", None) or getattr(config, "fp4", None):
            return None
        if not grouped_mm_fits(x, splits, self.weight0):
            return None
        weights = [getattr(self, f"weight{e}") for e in range(self.num_gemms)]
        if any(w.requires_grad for w in weights):
            return None
        if not hasattr(self, "_grouped_stack"):
            self._grouped_stack = StackedWeights()
        return self._grouped_stack.get(weights)


class FrozenTEColumnParallelGroupedLinear(FrozenGroupedBase, TEColumnParallelGroupedLinear):
    """Experts' linear_fc1 that LoRA leaves unadapted (frozen): the base as one grouped GEMM."""


class FrozenTERowParallelGroupedLinear(FrozenGroupedBase, TERowParallelGroupedLinear):
    """Experts' linear_fc2 that LoRA leaves unadapted (frozen): the base as one grouped GEMM."""


class _LoraTEGroupedLinear(FrozenFp8WeightCache, LoraLayerMixin, FrozenGroupedBase):
    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        lora_site: str,
        lora_slots: dict,
        lora_dropout: float,
        **kwargs: Any,
    ):
        super().__init__(num_gemms, input_size, output_size, **kwargs)
        self._init_lora(
            input_size=input_size,
            output_size=output_size,
            site=lora_site,
            slots=lora_slots,
            dropout=lora_dropout,
            config=kwargs["config"],
            is_expert=kwargs.get("is_expert", True),
            num_gemms=num_gemms,
        )

    def forward(self, x: torch.Tensor, m_splits: Any):
        splits, stack = self._base_plan(x, m_splits)
        if not self.lora_active():
            if self.lora_input_recipe:
                self.lora_input_recipe.drop()  # merged: the router's record goes unused
            return self._grouped_base(x, splits, stack)[:2]
        recipe = self.lora_input_recipe.take(x) if self.lora_input_recipe else None
        (slot,) = self.lora_slots  # routed-expert sites have one slot (gate_up_proj, down_proj)
        a, b, scaling = self.lora_param("A"), self.lora_param("B"), self.lora_spec[slot].scaling
        # One grouped GEMM per factor where torch has it for these tensors (CUDA sm90, bf16), else the loop.
        if not grouped_mm_fits(x, splits, a, b):
            out, bias, splits, _ = self._grouped_base(x, splits, stack)
            return out + expert_delta_loop(x, a, b, on_host(splits), scaling).to(out.dtype), bias
        recipe = (recipe if recompute_allowed() else None) or (None, None)
        if stack is not None:  # base and adapters in one function: the adapters' products summed in place
            return FrozenGroupedLora.apply(
                x, stack, a, b, group_ends(splits, x.device), scaling, *recipe
            ), None
        out, bias, splits, ends = self._grouped_base(x, splits, stack)
        return out + expert_delta_grouped(x, a, b, splits, scaling, ends, recipe).to(out.dtype), bias


class LoraTEColumnParallelGroupedLinear(_LoraTEGroupedLinear, TEColumnParallelGroupedLinear):
    """TE grouped-GEMM experts' linear_fc1 with per-expert adapters."""

    lora_parallel = "column"


class LoraTERowParallelGroupedLinear(_LoraTEGroupedLinear, TERowParallelGroupedLinear):
    """TE grouped-GEMM experts' linear_fc2 with per-expert adapters."""

    lora_parallel = "row"


FROZEN = {  # experts' linears under LoRA that it does not adapt
    TEColumnParallelGroupedLinear: FrozenTEColumnParallelGroupedLinear,
    TERowParallelGroupedLinear: FrozenTERowParallelGroupedLinear,
}

WRAPPERS = {
    TEColumnParallelLinear: LoraTEColumnParallelLinear,
    TERowParallelLinear: LoraTERowParallelLinear,
    TEColumnParallelGroupedLinear: LoraTEColumnParallelGroupedLinear,
    TERowParallelGroupedLinear: LoraTERowParallelGroupedLinear,
}
