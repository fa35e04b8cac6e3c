"""LoRA wrappers of megatron-core's Transformer Engine linears (imported only on the TE path).

Same factors and TP rules as :mod:`twinkle_specs.lora.layers`. The norm-fused linear feeds its adapter
the *normalised* input, recomputed here from its own ``layer_norm_weight`` (an RMSNorm over the
hidden size, cheap next to the GEMM) so the LoRA branch does not depend on TE's
``return_layernorm_output`` gradient conventions. Grouped-GEMM experts hold per-expert factors stacked on
dim 0 and apply them to each expert's token block (``m_splits``).
"""

from __future__ import annotations

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

from .layers import LoraLayerMixin, LoraLinearMixin


class LoraTELayerNormColumnParallelLinear(LoraLinearMixin, TELayerNormColumnParallelLinear):
    """TE norm-fused column-parallel linear (linear_qkv, dense linear_fc1); the adapter sees norm(x)."""

    lora_parallel = "column"

    def lora_input(self, x: torch.Tensor) -> torch.Tensor:
        # The same norm megatron configured TE with (normalization, epsilon, zero-centred gamma).
        config = self.config
        if config.normalization != "RMSNorm":
            raise NotImplementedError(f"LoRA on a {config.normalization}-fused linear: Qwen uses RMSNorm")
        weight = self.layer_norm_weight.float()
        if config.layernorm_zero_centered_gamma:
            weight = weight + 1
        return F.rms_norm(x.float(), (x.shape[-1],), weight, config.layernorm_epsilon).to(x.dtype)


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
        deltas = []
        for expert, xe in enumerate(torch.split(x, splits)):
            per_slot = {
                s: F.linear(F.linear(xe, self.lora_A[s][expert]), self.lora_B[s][expert])
                * self.lora_spec[s].scaling
                for s in self.lora_slots
            }
            deltas.append(self._lora_fuse(per_slot))
        return out + torch.cat(deltas).to(out.dtype), bias


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
