"""The per-head q/k RMSNorm of an adapted Qwen3 attention, on torch's fused RMSNorm.

Under LoRA the norms are frozen, yet Transformer Engine's RMSNorm backward always computes the weight
gradient: a partial sum per block of rows and a finalize kernel that reduces them. For the q/k norms
(rows of one head, 128 wide, a row per token and head) that finalize is the slowest norm kernel of
the step: 79 us per call, 1.26 ms of a 75 ms LoRA step on the Qwen3-8B shape (8 layers, 4096 tokens,
H200; bench/results/2026-11-23-h200-s13/profile.txt). ``torch.nn.functional.rms_norm`` runs torch's
fused kernel on CUDA and its backward computes only the gradients autograd asks for, so with the weight
frozen it writes the input gradient and nothing else; with the weight trainable it computes both.
The arithmetic is TE's: fp32 statistics and products, the output rounded once to the input dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class TorchRMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension with TENorm's constructor and parameter (``weight``, so
    checkpoint keys and the HF weight map are unchanged)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        if config.normalization != "RMSNorm" or getattr(config, "layernorm_zero_centered_gamma", False):
            raise ValueError(
                f"TorchRMSNorm is an RMSNorm with a plain gamma; the config has --normalization "
                f"{config.normalization}, layernorm_zero_centered_gamma="
                f"{getattr(config, 'layernorm_zero_centered_gamma', False)}"
            )
        self.config, self.eps, self.hidden_size = config, eps, hidden_size
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=device))
        # as TE's norms mark theirs: megatron all-reduces such weights' gradients over tensor parallelism
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.hidden_size,), self.weight.to(x.dtype), self.eps)

    def get_extra_state(self) -> torch.Tensor:
        """TE's norms checkpoint an extra state (empty without FP8): the same keys as a TE model's."""
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        """Nothing to restore (see :meth:`get_extra_state`)."""
