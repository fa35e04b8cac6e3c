"""megatron-core's MLPs with adapted ``linear_fc1``/``linear_fc2``: the dense MLP folds the adapters into
SwiGLU, the routed experts' MLP drops fc2's adapter input after use.

An adapted fc1 would add its delta ``h @ Bᵀ`` to its [tokens, 2·ffn] output in place (a read and a
write of that whole tensor) just before SwiGLU reads it again, and in backward SwiGLU's gradient, fc1's
B gradient, fc2's recomputed input, fc2's A gradient and fc2's input-gradient sum each pass over an
FFN-size tensor. Where megatron runs its fused SwiGLU (``bias_activation_fusion``, plain SwiGLU, no bias
or per-token scale), :class:`LoraMLP` does all of that in :func:`~twinkle_specs.lora.swiglu.swiglu_lora`'s
two kernels. Anything else runs megatron's own forward.

:class:`LoraGroupedMLP`: the routed experts' fc2 adapter would save its input, the weighted SwiGLU
output ([tokens × top-k, moe_ffn] per layer), which the frozen grouped base does not keep. megatron
already knows how to drop that tensor after fc2 and recompute it before fc2's backward from fc1's output
and the routing probabilities, which the activation keeps for its own backward: its ``moe_act``
selective recompute (``tensor_parallel.CheckpointWithoutOutput``). The adapted experts turn it on.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import TEGroupedMLP

from .config import SITE_SLOTS
from .experts import DeviceCounts
from .fp8_amax import SwigluFp8, swiglu_fp8
from .functions import GradLink
from .layers import LoraLayerMixin
from .model import swiglu_fn
from .recompute import recompute_allowed
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
        b = _fc1_b(fc1)
        adapted = isinstance(fc2, LoraLayerMixin) and fc2.lora_active()
        linked = adapted and fc2.lora_links_grad(pre)
        # FP8 current scaling: the kernels take the amaxes of fc2's base input and fc1's output gradient
        fp8 = swiglu_fp8(fc1, fc2 if linked or not adapted else None)
        if linked:
            # fc2's A gradient and its input-gradient share are computed in SwiGLU's backward kernel
            link, a2 = GradLink(deferred=True), fc2.lora_param("A")
            act = swiglu_lora(pre, h, b, a2, link, fp8)
            out, bias, h2 = fc2.lora_base_and_hidden(
                act, lora_link=link, lora_a=a2, lora_base_input=_fp8_input(act, fp8)
            )
            return fc2._lora_add(out, h2), bias
        act = swiglu_lora(pre, h, b, fp8=fp8)
        if adapted and fc2.lora_input_recipe:
            # fc2's adapter recomputes its input with the very function that made it
            fn = functools.partial(swiglu_lora_forward, h=h.detach(), b=b.detach())
            fc2.lora_input_recipe.hand(pre, fn)
        quantized = None if adapted else _fp8_input(act, fp8)
        return fc2(act if quantized is None else quantized)


def _fp8_input(act: torch.Tensor, fp8: SwigluFp8 | None) -> torch.Tensor | None:
    """SwiGLU's output as fc2's base takes it under FP8 with the amax the kernel took, else None."""
    if fp8 is None or fp8.input_amax is None:
        return None
    amax, fp8.input_amax = fp8.input_amax, None
    return fp8.input(act, amax)


def _fc1_b(fc1: LoraLayerMixin) -> torch.Tensor:
    """fc1's B as :func:`swiglu_lora` takes it: with gate and up both adapted at one rank, fc1's own
    ``lora_B`` (``h`` then holds gate's columns and up's apart); else the fused B with its zero blocks."""
    slots = tuple(fc1.lora_slots)
    if slots == SITE_SLOTS["linear_fc1"] and len({fc1.lora_spec[s].r for s in slots}) == 1:
        return fc1.lora_param("B")
    return fc1.lora_B_fused()


class CountsOnDevice:
    """Routed experts (megatron's ``TEGroupedMLP``) that take the token counts where the tokens are: the
    dispatcher leaves them on the GPU for experts that say so (``patches/moe_counts_on_device.py``,
    :func:`~.model.keep_routed_counts_on_device`), and they reach the grouped linears as
    :class:`~.experts.DeviceCounts`, whose grouped GEMMs take their offsets on the device."""

    def host_counts_reason(self) -> str | None:
        """What makes these experts need the token counts on the host (the flag to change), or None where
        they may stay on the GPU: both linears are twinkle's grouped bases, megatron's forward calls them
        (not TE's op fuser), and it needs the counts for nothing else (no FP8/FP4 padding, no bias split
        per expert, no probabilities applied to the input)."""
        config = self.config
        linears = (self.linear_fc1, self.linear_fc2)
        for needed, reason in (
            (
                not all(getattr(m, "accepts_device_counts", False) for m in linears),
                "linears other than twinkle's grouped bases",
            ),
            (
                config.fp8 or config.fp4,
                "FP8/FP4 experts (--fp8-format/--fp4-format): their blocks are padded",
            ),
            (
                config.add_bias_linear,
                "biases on the linears, split per expert (--disable-bias-linear drops them)",
            ),
            (getattr(config, "moe_apply_probs_on_input", False), "--moe-apply-probs-on-input"),
            (getattr(config, "use_transformer_engine_op_fuser", False), "--use-transformer-engine-op-fuser"),
        ):
            if needed:
                return reason
        return None

    def takes_device_counts(self) -> bool:
        """Whether the counts may stay on the GPU (:meth:`host_counts_reason` finds nothing)."""
        return self.host_counts_reason() is None

    def forward(self, hidden_states: torch.Tensor, tokens_per_expert: Any, *args: Any, **kwargs: Any):
        """megatron's forward, with ``tokens_per_expert`` as :class:`~.experts.DeviceCounts` where it is on
        the tokens' device (the dispatcher left it on the GPU; on a CPU host, where everything is) and the
        counts may stay there."""
        on_device = torch.is_tensor(tokens_per_expert) and tokens_per_expert.device == hidden_states.device
        if on_device and self.takes_device_counts():
            tokens_per_expert = DeviceCounts(tokens_per_expert)
        return super().forward(hidden_states, tokens_per_expert, *args, **kwargs)


class FrozenGroupedMLP(CountsOnDevice, TEGroupedMLP):
    """Routed experts LoRA leaves unadapted: megatron's TEGroupedMLP over the frozen grouped linears
    (``te_layers.FROZEN``), taking the token counts on the device."""


class LoraGroupedMLP(CountsOnDevice, TEGroupedMLP):
    """TE grouped-GEMM experts with adapted fc1/fc2 whose fc2 adapter input is recomputed, not kept (see
    the module docstring): megatron's ``moe_act`` recompute runs whenever fc2's adapter does, unless
    fp8/fp4 (megatron then needs fc2 to keep its unquantized input, set up at construction) or saved-
    tensor hooks of a checkpoint or offloading own the saves."""

    def __init__(self, num_local_experts: int, config: Any, *args: Any, **kwargs: Any) -> None:
        # checked before megatron's own constructor, which (0.19) asserts on its own terms first
        if getattr(config, "use_transformer_engine_op_fuser", False):
            raise ValueError(
                "LoRA on routed experts needs megatron's TEGroupedMLP forward, which calls linear_fc1 and "
                "linear_fc2; use_transformer_engine_op_fuser (--use-transformer-engine-op-fuser) runs the "
                "experts as fused TE ops that skip the adapters. Turn it off, or leave the experts out of "
                "target_modules."
            )
        super().__init__(num_local_experts, config, *args, **kwargs)
        self.lora_megatron_recompute = self.activation_recompute  # what the config asked for

    def forward(self, *args: Any, **kwargs: Any):
        fc2 = self.linear_fc2
        drop_fc2_input = (
            isinstance(fc2, LoraLayerMixin)
            and fc2.lora_active()
            and not (self.config.fp8 or self.config.fp4)
            and torch.is_grad_enabled()
            and recompute_allowed()
        )
        self.activation_recompute = self.lora_megatron_recompute or drop_fc2_input
        return super().forward(*args, **kwargs)
