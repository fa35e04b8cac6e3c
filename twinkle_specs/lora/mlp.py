"""megatron-core's MLP with the adapters of its ``linear_fc1`` and ``linear_fc2`` folded into SwiGLU.

An adapted fc1 would add its delta ``h @ Bᵀ`` to its [tokens, 2·ffn] output in place (a read and a
write of that whole tensor) just before SwiGLU reads it again, and in backward SwiGLU's gradient, fc1's
B gradient, fc2's recomputed input, fc2's A gradient and fc2's input-gradient sum each pass over an
FFN-size tensor. Where megatron runs its fused SwiGLU (``bias_activation_fusion``, plain SwiGLU, no bias
or per-token scale), :class:`LoraMLP` does all of that in :func:`~twinkle_specs.lora.swiglu.swiglu_lora`'s
two kernels (bench/results/2026-11-23-h100-s8 measures it). Anything else runs megatron's own forward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from megatron.core.transformer.mlp import MLP

from .functions import GradLink
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
        adapted = isinstance(fc2, LoraLayerMixin) and fc2.lora_active()
        if adapted and fc2.lora_links_grad(pre):
            # fc2's A gradient and its input-gradient share are computed in SwiGLU's backward kernel
            link, a2 = GradLink(deferred=True), fc2.lora_param("A")
            act = swiglu_lora(pre, h, b, a2, link)
            out, bias, h2 = fc2.lora_base_and_hidden(act, lora_link=link, lora_a=a2)
            return fc2._lora_add(out, h2), bias
        act = swiglu_lora(pre, h, b)
        if adapted and fc2.lora_input_recipe:
            # fc2's adapter recomputes its input with the very function that made it
            fn = functools.partial(swiglu_lora_forward, h=h.detach(), b=b.detach())
            fc2.lora_input_recipe.hand(pre, fn)
        return fc2(act)
