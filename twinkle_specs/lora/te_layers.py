"""LoRA wrappers of megatron-core's Transformer Engine linears (imported only on the TE path).

Same factors, TP rules and fused slot computation as :mod:`twinkle_specs.lora.layers`. The norm-fused
linear feeds its adapter the *normalised* input, recomputed here from its own ``layer_norm_weight`` (an
RMSNorm over the hidden size, one fused kernel, cheap next to the GEMM) so the LoRA branch does not
depend on TE's ``return_layernorm_output`` gradient conventions (nor on its sequence-parallel and FP8
handling of that output). Grouped-GEMM experts hold per-expert factors stacked on dim 0 and apply them
to each expert's token block (``m_splits``) with torch's grouped GEMM where it runs (CUDA sm90, bf16),
else one expert at a time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.extensions.transformer_engine import (
    TEColumnParallelGroupedLinear,
    TEColumnParallelLinear,
    TELayerNormColumnParallelLinear,
    TERowParallelGroupedLinear,
    TERowParallelLinear,
)

from .layers import (
    LoraLayerMixin,
    LoraLinearMixin,
    expert_delta_grouped,
    expert_delta_loop,
    grouped_mm_fits,
)


class LoraTELayerNormColumnParallelLinear(LoraLinearMixin, TELayerNormColumnParallelLinear):
    """TE norm-fused column-parallel linear (linear_qkv, dense linear_fc1); the adapter sees norm(x)."""

    lora_parallel = "column"

    def lora_input_norm(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The same norm megatron configured TE with (normalization, epsilon, zero-centred gamma)."""
        config = self.config
        if config.normalization != "RMSNorm":
            raise NotImplementedError(f"LoRA on a {config.normalization}-fused linear: Qwen uses RMSNorm")
        return functools.partial(
            rms_norm_input,
            weight=self.layer_norm_weight,
            eps=config.layernorm_epsilon,
            zero_centered=config.layernorm_zero_centered_gamma,
        )


def rms_norm_input(x: torch.Tensor, *, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """RMSNorm of the adapter input as TE computes it before its GEMM.

    ``F.rms_norm`` in the input's dtype computes in fp32 internally (torch's composite upcasts, the CUDA
    kernel accumulates in fp32) and rounds once at the end, like an explicit ``x.float()`` ...
    ``.to(x.dtype)``, without the two full-size casts; on CUDA it is one fused kernel each way. A
    zero-centred gamma (``1 + w``, which bf16 cannot hold exactly) or a weight of another dtype keeps
    the explicit fp32 computation.
    """
    if not zero_centered and weight.dtype == x.dtype:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    w = weight.float() + 1 if zero_centered else weight.float()
    return F.rms_norm(x.float(), (x.shape[-1],), w, eps).to(x.dtype)


class LoraTEColumnParallelLinear(LoraLinearMixin, TEColumnParallelLinear):
    """TE column-parallel linear (shared/sequential experts' linear_fc1, MoE-layer linear_qkv)."""

    lora_parallel = "column"


class LoraTERowParallelLinear(LoraLinearMixin, TERowParallelLinear):
    """TE row-parallel linear (linear_proj, linear_fc2)."""

    lora_parallel = "row"


class _LoraTEGroupedLinear(LoraLayerMixin):
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
        out, bias = super().forward(x, m_splits)
        if self.lora_merged or not self.lora_slots:
            return out, bias
        splits = m_splits.tolist() if torch.is_tensor(m_splits) else list(m_splits)
        (slot,) = self.lora_slots  # routed-expert sites have one slot (gate_up_proj, down_proj)
        a, b, scaling = self.lora_param("A"), self.lora_param("B"), self.lora_spec[slot].scaling
        # One grouped GEMM per factor where torch has it for these tensors (CUDA sm90, bf16), else the loop.
        delta = expert_delta_grouped if grouped_mm_fits(x, a, b, splits) else expert_delta_loop
        return out + delta(x, a, b, splits, scaling).to(out.dtype), bias


class LoraTEColumnParallelGroupedLinear(_LoraTEGroupedLinear, TEColumnParallelGroupedLinear):
    """TE grouped-GEMM experts' linear_fc1 with per-expert adapters."""

    lora_parallel = "column"


class LoraTERowParallelGroupedLinear(_LoraTEGroupedLinear, TERowParallelGroupedLinear):
    """TE grouped-GEMM experts' linear_fc2 with per-expert adapters."""

    lora_parallel = "row"


WRAPPERS = {
    TELayerNormColumnParallelLinear: LoraTELayerNormColumnParallelLinear,
    TEColumnParallelLinear: LoraTEColumnParallelLinear,
    TERowParallelLinear: LoraTERowParallelLinear,
    TEColumnParallelGroupedLinear: LoraTEColumnParallelGroupedLinear,
    TERowParallelGroupedLinear: LoraTERowParallelGroupedLinear,
}
