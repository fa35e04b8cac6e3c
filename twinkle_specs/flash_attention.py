"""Core attention on FlashAttention-4 (the ``flash-attn-4`` package's CuTe kernels), opt in.

megatron-core's TE spec runs attention through Transformer Engine's ``DotProductAttention``, which on Hopper
picks cuDNN's fused attention. At the Qwen3-8B shape (32 query / 8 key-value heads of 128, 4096 tokens,
causal, bf16) FlashAttention-4's Hopper kernels took 0.213 ms forward and 0.912 ms forward + backward on an
H200 against TE's 0.255 and 1.044 (``bench/attention_backends.py``); attention is the largest part of a LoRA
step after the GEMMs. TE 2.11 has no FlashAttention-4 backend, hence this subclass of megatron's
``TEDotProductAttention``: the same constructor, parameters and checkpoint state, and for every call it can
serve FlashAttention-4: plain rows (causal, no attention bias) through ``flash_attn_func`` on the
[s, b, heads, d] inputs viewed as [b, s, heads, d], and the packed rows of ``--sft`` (THD, megatron's
``PackedSeqParams``) through ``flash_attn_varlen_func``, causal inside each sequence. A packed row's sequences
are its padded bounds where given (as megatron's RoPE and the portable attention take them): each real token
attends to exactly what TE's padding-aware call gives it, and the padding after a sequence's real tokens (no
loss, no gradient) attends within its sequence where TE writes zeros. Calls it cannot serve (another mask
type, attention bias, ``num_splits``, packed rows with other key bounds or a dynamic context-parallel
group) go to TE's forward. A config that no call could serve here (context parallelism, sliding windows,
attention dropout, another softmax, QK-clip, FP8 attention) is refused when the model is built.

Chosen by ``--flash-attn-4`` (``twinkle-train``) or ``build_model(flash_attn_4=True)``; the package is the
``flash-attn-4`` extra. Its kernels compile on first use (seconds per shape) and are captured by CUDA graphs
like TE's. Its backward sums the query gradient with atomics unless TE's own determinism setting asks for
a deterministic run (``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``, ``torch.use_deterministic_algorithms``). A
packed row's bounds are read on the host once per micro-batch (:class:`~twinkle_specs.packed_sequences.PackedRow`:
varlen kernels size their grid by the longest sequence).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

from .packed_sequences import PackedRow, packed_bounds

FLAG = "--flash-attn-4"
EXTRA = "pip install 'twinkle-specs[flash-attn-4]'"


@functools.cache
def _kernels() -> Any:
    """FlashAttention-4's ``flash_attn.cute``, imported on first use (the import loads the CuTe DSL)."""
    try:
        import flash_attn.cute as cute
    except ImportError as err:
        raise ImportError(
            f"{FLAG}: FlashAttention-4 is not installed ({err}); {EXTRA}, or drop {FLAG} to keep Transformer "
            "Engine's attention"
        ) from err
    return cute


def flash_attn_func():
    """FlashAttention-4's ``flash_attn_func`` (rows of one length, [b, s, heads, d])."""
    return _kernels().flash_attn_func


def flash_attn_varlen_func():
    """FlashAttention-4's ``flash_attn_varlen_func`` (packed sequences, [tokens, heads, d] and their bounds)."""
    return _kernels().flash_attn_varlen_func


def config_refusal(config: Any) -> str | None:
    """Why no forward of an attention built from ``config`` could run on FlashAttention-4 here, or None."""
    reasons = {
        "context parallelism (--context-parallel-size > 1)": config.context_parallel_size > 1,
        "sliding-window attention (window_size)": getattr(config, "window_size", None) is not None,
        "attention dropout (--attention-dropout > 0)": bool(config.attention_dropout),
        "a softmax other than vanilla (--softmax-type)": getattr(config, "softmax_type", "vanilla")
        not in ("vanilla", None),
        "QK-clip or max-logit logging": bool(
            getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit", False)
        ),
        "FP8 dot-product attention": bool(getattr(config, "fp8_dot_product_attention", False)),
    }
    found = [name for name, on in reasons.items() if on]
    if not found:
        return None
    return f"{FLAG} runs plain causal attention; this config has {', '.join(found)}: drop {FLAG}"


def installed() -> bool:
    """Whether FlashAttention-4 can be imported here, without importing it (the import loads the CuTe DSL)."""
    return (
        importlib.util.find_spec("flash_attn") is not None
        and importlib.util.find_spec("flash_attn.cute") is not None
    )


def launch_refusal(args: Any) -> str | None:
    """Why ``--flash-attn-4`` cannot serve a run with Megatron's parsed ``args`` (checked before any rank builds
    a model): the package missing, megatron's portable modules, or a config no call could serve."""
    if not installed():
        return f"{FLAG} needs FlashAttention-4, which is not installed: {EXTRA}, or drop {FLAG}"
    impl = getattr(args, "transformer_impl", "transformer_engine")
    if impl != "transformer_engine":
        return portable_refusal(impl)
    return config_refusal(args)


def portable_refusal(impl: str) -> str:
    """The refusal of the flag with megatron's ``--transformer-impl`` ``impl`` other than Transformer Engine's."""
    return f"{FLAG} replaces Transformer Engine's attention: it needs --transformer-impl transformer_engine, not {impl}"


def attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, deterministic: bool
) -> torch.Tensor:
    """Causal attention of [s, b, heads, d] query / key / value (GQA by their head counts) as [s, b, heads * d],
    megatron's core-attention output."""
    s, b = query.shape[:2]
    out = flash_attn_func()(
        *(t.transpose(0, 1) for t in (query, key, value)),
        softmax_scale=scale,
        causal=True,
        deterministic=deterministic,
    )
    out = out[0] if isinstance(out, tuple) else out  # (out, lse) in some releases
    return out.transpose(0, 1).reshape(s, b, -1)


def attend_packed(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    row: PackedRow,
    scale: float,
    deterministic: bool,
) -> torch.Tensor:
    """Causal attention inside each sequence of a packed row: [tokens, heads, d] query / key / value (THD)
    as [tokens, heads * d], megatron's core-attention output for THD."""
    out = flash_attn_varlen_func()(
        query,
        key,
        value,
        cu_seqlens_q=row.cu_seqlens_int32,
        cu_seqlens_k=row.cu_seqlens_int32,
        max_seqlen_q=row.longest,
        max_seqlen_k=row.longest,
        softmax_scale=scale,
        causal=True,
        deterministic=deterministic,
    )
    out = out[0] if isinstance(out, tuple) else out
    return out.reshape(query.shape[0], -1)


def servable_row(params: Any, tokens: int, device: torch.device) -> PackedRow | None:
    """The sequences of a packed micro-batch that FlashAttention-4 can serve, or None for TE's forward: THD
    self-attention (the keys' bounds the queries'), no dynamic context-parallel group."""
    if params.qkv_format != "thd" or getattr(params, "cp_group", None) is not None:
        return None
    if getattr(params, "local_cp_size", None) not in (None, 1):
        return None
    kv = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
    if kv is not packed_bounds(params):
        return None
    return PackedRow.of(params, tokens, device)


def _te_dot_product_attention() -> type:
    """megatron's ``TEDotProductAttention``, refusing the packed calls handed back to it that its cuDNN would
    train wrong (:mod:`twinkle_specs.packed_attention_check`)."""
    from .packed_attention_check import checked_te_attention_class

    return checked_te_attention_class()


@functools.cache
def flash_attention_4_class() -> type:
    """:class:`FlashAttention4`'s class, built on megatron's ``TEDotProductAttention`` when first asked for
    (importing this module does not import Transformer Engine)."""
    from megatron.core.transformer.enums import AttnMaskType

    base = _te_dot_product_attention()
    causal_packed = (
        AttnMaskType.causal,
        AttnMaskType.padding_causal,
    )  # TE's names for causal over THD bounds

    class FlashAttention4(base):
        """megatron's ``TEDotProductAttention`` whose causal calls, plain rows or packed, run on
        FlashAttention-4 (module docstring)."""

        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            refusal = config_refusal(config)
            if refusal is not None:
                raise ValueError(refusal)
            flash_attn_func()  # a missing package fails the build, not the first step
            super().__init__(config, *args, **kwargs)
            self.flash_attn_4_scale = float(self.fused_attention.softmax_scale)  # TE's, megatron's scaling in

        def forward(
            self,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: torch.Tensor | None,
            attn_mask_type: Any = None,
            attention_bias: torch.Tensor | None = None,
            packed_seq_params: Any = None,
            **kwargs: Any,
        ) -> torch.Tensor:
            plain = packed_seq_params is None
            masks = (AttnMaskType.causal,) if plain else causal_packed
            served = attn_mask_type in masks and attention_bias is None and not kwargs.get("num_splits")
            if served and plain:
                return attend(query, key, value, self.flash_attn_4_scale, self.deterministic)
            row = servable_row(packed_seq_params, query.shape[0], query.device) if served else None
            if row is not None:
                return attend_packed(query, key, value, row, self.flash_attn_4_scale, self.deterministic)
            mask, bias, packed = attn_mask_type, attention_bias, packed_seq_params
            return super().forward(query, key, value, attention_mask, mask, bias, packed, **kwargs)

    return FlashAttention4


__all__ = [
    "FLAG",
    "attend",
    "attend_packed",
    "config_refusal",
    "flash_attention_4_class",
    "installed",
    "launch_refusal",
    "portable_refusal",
]
