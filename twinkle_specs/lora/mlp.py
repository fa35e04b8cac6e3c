"""megatron-core's MLP with its ``linear_fc1`` adapter applied inside SwiGLU.

An adapted fc1 would add its delta ``h @ Bᵀ`` to its [tokens, 2·ffn] output in place (a read and a
write of that whole tensor) just before SwiGLU reads it again. Where megatron runs its fused SwiGLU
(``bias_activation_fusion``, plain SwiGLU, no bias or per-token scale), :class:`LoraMLP` hands fc1's base
output, ``h`` and ``B`` to :func:`~twinkle_specs.lora.swiglu.swiglu_lora` instead, which adds the delta
tile by tile on the way into SwiGLU (on the Qwen3-8B shape at 4096 tokens the in-place add took 206 us
per layer on an H100, bench/results/2026-11-23-h100-s8). Anything else runs megatron's own forward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from megatron.core.transformer.mlp import MLP

from .layers import LoraLayerMixin
from .model import swiglu_fn
from .swiglu import swiglu_lora, swiglu_lora_forward


class LoraMLP(MLP):
    """A dense MLP whose adapted fc1's delta goes into SwiGLU (see the module docstring)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.lora_fuses_activation = (
            isinstance(self.linear_fc1, LoraLayerMixin)
            and bool(config.bias_activation_fusion)
            and swiglu_fn(config) is not None
        )

    def forward(
        self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None, **kwargs: Any
    ):
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        fused = self.lora_fuses_activation and per_token_scale is None and fc1.lora_active()
        if not fused or fc1.lora_leaf("B").dtype != hidden_states.dtype:
            return super().forward(hidden_states, per_token_scale, **kwargs)
        pre, _, h = fc1.lora_base_and_hidden(hidden_states)  # no bias: plain SwiGLU needs none
        b = fc1.lora_B_fused()
        act = swiglu_lora(pre, h, b)
        if isinstance(fc2, LoraLayerMixin) and fc2.lora_input_recipe:
            # fc2's adapter recomputes its input with the very function that made it
            fc2.lora_input_recipe.hand(
                pre, functools.partial(swiglu_lora_forward, h=h.detach(), b=b.detach())
            )
        return fc2(act)
