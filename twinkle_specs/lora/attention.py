"""megatron-core's SelfAttention with the frozen q/k norms and RoPE fused into the QKV split.

Where :mod:`.qk_rope` applies (training or evaluation without an inference context or packed sequences,
non-interleaved RoPE over the whole head without YaRN scaling, TE's fused RoPE configured, the norms
:class:`~twinkle_specs.lora.norm.QKNorm` with weights that get no gradient, CUDA and Triton), the
forward passes no rotary embedding on to megatron's and :meth:`get_query_key_value_tensors` returns the
query and key already normed and rotated. Anywhere else megatron's own path runs unchanged. Under FP8
current scaling the backward kernel also takes the amax of the QKV gradient it writes, for linear_qkv's
input-gradient GEMM (:mod:`.fp8_amax`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from megatron.core.transformer import attention as mcore_attention
from megatron.core.transformer.attention import SelfAttention

from .fp8_amax import CastGrad, GradAmax, grad_cast
from .layers import LoraLinearMixin
from .norm import QKNorm
from .qk_rope import fusable, qk_norm_rope

_FORWARD = inspect.signature(SelfAttention.forward)
# arguments whose presence means a path the fused kernels do not cover
_UNFUSED_IF_GIVEN = (
    "key_value_states",
    "inference_context",
    "inference_params",
    "packed_seq_params",
    "rotary_pos_cos",
    "rotary_pos_sin",
    "rotary_pos_cos_sin",
)


class LoraSelfAttention(SelfAttention):
    """SelfAttention of an adapted model whose q/k norms are frozen (see the module docstring)."""

    _qk_rope_freqs: torch.Tensor | None = None  # set for the duration of a fused forward

    def forward(self, *args: Any, **kwargs: Any):
        bound = _FORWARD.bind(self, *args, **kwargs)
        freqs = self._fused_rope(bound.arguments)
        if freqs is None:
            return super().forward(*args, **kwargs)
        bound.arguments["rotary_pos_emb"] = None  # applied in get_query_key_value_tensors instead
        self._qk_rope_freqs = freqs
        try:
            return super().forward(*bound.args[1:], **bound.kwargs)
        finally:
            self._qk_rope_freqs = None

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, *args: Any, **kwargs: Any):
        freqs = self._qk_rope_freqs
        if freqs is None:
            return super().get_query_key_value_tensors(hidden_states, key_value_states, *args, **kwargs)
        qkv, cast = self.linear_qkv, grad_cast(self.linear_qkv)
        link = GradAmax(cast) if cast is not None else None  # the backward kernel's amax to that cast
        if link is None:
            mixed_qkv, _ = qkv(hidden_states)
        elif isinstance(qkv, LoraLinearMixin):
            mixed_qkv, _ = qkv(hidden_states, lora_out_grad=link)
        else:
            mixed_qkv = CastGrad.apply(qkv(hidden_states)[0], link)
        return qk_norm_rope(
            mixed_qkv,
            self.num_query_groups_per_partition,
            self.q_layernorm,
            self.k_layernorm,
            freqs,
            link,
        )

    def _fused_rope(self, args: dict) -> torch.Tensor | None:
        """The rotary frequencies [s, 1, 1, head] when this forward can take the fused path, else None."""
        freqs = args.get("rotary_pos_emb")
        if isinstance(freqs, tuple):  # megatron passes (q, k) embeddings; self-attention's are one
            freqs = freqs[0] if len(freqs) == 2 and freqs[0] is freqs[1] else None
        if not torch.is_tensor(freqs) or any(args.get(k) is not None for k in _UNFUSED_IF_GIVEN):
            return None
        c, head = self.config, self.hidden_size_per_attention_head
        if (
            c.rotary_interleaved
            or c.multi_latent_attention
            or not c.apply_rope_fusion
            or c.flash_decode
            or c.test_mode
            or c.attention_output_gate
            or getattr(c, "mrope_section", None) is not None
            or c.num_query_groups < self.world_size
            or mcore_attention._yarn_get_concentration_factor_from_config(c) != 1.0
        ):
            return None
        q_norm, k_norm = self.q_layernorm, self.k_layernorm
        if not (isinstance(q_norm, QKNorm) and isinstance(k_norm, QKNorm)):
            return None
        if freqs.dim() != 4 or freqs.shape[1:] != (1, 1, head) or freqs.dtype != torch.float32:
            return None
        if not fusable(args["hidden_states"], head, q_norm.weight, k_norm.weight):
            return None
        return freqs
