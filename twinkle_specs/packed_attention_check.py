"""Transformer Engine's packed-row attention on Hopper needs cuDNN 9.18 or newer at head dims above 128.

With an older cuDNN, cuDNN's fused attention backward over packed (THD) rows at head dim 192 or 256 gives wrong
gradients on Hopper (queries' 19–29 % off, keys' and values' mostly NaN); its forward, and the same heads over
plain rows (SBHD), are right. Measured on an H200 with TE 2.11 at 16 query / 4 key-value heads of 256: with
cuDNN 9.14.0 (the image's ``/usr/lib``, which TE's loader finds before the ``nvidia-cudnn`` wheel beside torch)
the query gradient is 0.19 off an fp32 truth (relative) and the key and value gradients NaN or as far off, for
every bounds set tried, a single 4096-token sequence included, deterministic or not; with the wheel's cuDNN
9.19.0 it is 2.5e-3, as at head dim 128. TE's maintainers place the fix of cuDNN's Hopper THD backward in 9.18.

Qwen3-Next and Qwen3.5 (dense and MoE) attend with heads of 256, so their ``--sft`` packed rows would train
on those gradients. The launcher refuses such a run before it trains (:func:`launch_refusal`), and a Transformer
Engine attention built for such heads refuses a packed call the same way (:func:`checked_te_attention_class`,
for runs without the launcher), naming what to change: a newer cuDNN for TE, FlashAttention-4's attention
(``--flash-attn-4``, which serves packed rows itself), or plain rows.
"""

from __future__ import annotations

import functools
import importlib.metadata
from pathlib import Path
from typing import Any

import torch

FIXED_IN = 91800  # cuDNN 9.18.0, as cuDNN numbers its 9.x releases (major * 10000 + minor * 100 + patch)
LARGEST_SAFE_HEAD_DIM = 128
WHEELS = ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12")


def cudnn_name(version: int) -> str:
    """``91400`` as ``9.14.0`` (cuDNN 9's numbering; 8.x numbered major * 1000 + minor * 100 + patch)."""
    major, rest = (
        (version // 10000, version % 10000) if version >= 90000 else (version // 1000, version % 1000)
    )
    return f"{major}.{rest // 100}.{rest % 100}"


def refusal(
    head_dim: int, capability: tuple[int, int], cudnn: int | None, wheel: tuple[str, int] | None = None
) -> str | None:
    """Why TE's packed attention would train wrong here, or None: heads above 128 on Hopper (compute capability
    9.x) with a cuDNN older than 9.18. ``cudnn``: the version TE loaded (None where unknown: no refusal);
    ``wheel``: the ``nvidia-cudnn`` wheel's library folder and version, named in the remedy where newer."""
    if head_dim <= LARGEST_SAFE_HEAD_DIM or capability[0] != 9 or cudnn is None or cudnn >= FIXED_IN:
        return None
    if wheel is not None and wheel[1] >= FIXED_IN:
        folder = wheel[0]
        newer = (
            f"the nvidia-cudnn wheel beside torch has {cudnn_name(wheel[1])}: export CUDNN_HOME={folder} "
            f"LD_LIBRARY_PATH={folder}:$LD_LIBRARY_PATH before the launch"
        )
    else:
        newer = "install cuDNN 9.18 or newer and point CUDNN_HOME and LD_LIBRARY_PATH at it before the launch"
    return (
        f"Transformer Engine's packed-row (THD) attention backward at head dim {head_dim} on Hopper gives wrong "
        f"gradients (queries' ~20 % off, keys' and values' mostly NaN) with cuDNN {cudnn_name(cudnn)}, the one TE "
        f"loaded here (fixed in cuDNN {cudnn_name(FIXED_IN)}). Give TE a newer cuDNN ({newer}), or run the "
        "attention on FlashAttention-4 (--flash-attn-4), or train on plain rows (no --sft)"
    )


def te_cudnn_version() -> int | None:
    """The cuDNN version Transformer Engine loaded (its own report), or None where TE cannot say."""
    try:
        import transformer_engine.pytorch  # noqa: F401  (loads TE's libraries and its cuDNN, as training does)
        import transformer_engine_torch as tex
    except ImportError:
        return None
    get = getattr(tex, "get_cudnn_version", None)
    return int(get()) if get is not None else None


def wheel_cudnn() -> tuple[str, int] | None:
    """The ``nvidia-cudnn`` wheel's library folder (the one holding ``libcudnn.so.9``) and its version as cuDNN
    numbers it, where installed: the first such install on ``sys.path``, found from its own file list."""
    for dist in importlib.metadata.distributions():
        if (dist.metadata["Name"] or "").lower().replace("_", "-") not in WHEELS:
            continue
        libs = [Path(dist.locate_file(f)) for f in dist.files or () if f.name == "libcudnn.so.9"]
        if not (libs and libs[0].is_file()):
            continue
        try:
            major, minor, patch = (int(p) for p in dist.version.split(".")[:3])
        except ValueError:
            continue
        return str(libs[0].parent), major * 10000 + minor * 100 + patch
    return None


def wheel_cudnn_dir() -> str | None:
    """The library folder of :func:`wheel_cudnn`, where installed."""
    wheel = wheel_cudnn()
    return wheel[0] if wheel is not None else None


@functools.cache
def current_refusal(head_dim: int) -> str | None:
    """:func:`refusal` for this process: its GPU, the cuDNN TE loaded and the wheel's (none of which change
    while it runs: asked once, by the launcher and by every attention layer built)."""
    if head_dim <= LARGEST_SAFE_HEAD_DIM or not torch.cuda.is_available():
        return None
    capability = torch.cuda.get_device_capability()
    if capability[0] != 9:
        return None
    return refusal(head_dim, capability, te_cudnn_version(), wheel_cudnn())


def launch_refusal(args: Any) -> str | None:
    """Why a launch with Megatron's parsed ``args`` would train packed rows on wrong attention gradients:
    ``--sft`` (megatron packs its rows) on Transformer Engine's attention, without ``--flash-attn-4``."""
    if not getattr(args, "sft", False) or getattr(args, "flash_attn_4", False):
        return None
    if getattr(args, "transformer_impl", "transformer_engine") != "transformer_engine":
        return None
    head_dim = args.kv_channels or args.hidden_size // args.num_attention_heads
    if problem := current_refusal(head_dim):
        return f"--sft: {problem}"
    return None


def _te_dot_product_attention() -> type:
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    return TEDotProductAttention


@functools.cache
def checked_te_attention_class() -> type:
    """megatron's ``TEDotProductAttention`` that refuses a packed call :func:`current_refusal` names (the
    check made once, when the module is built); everything else is megatron's."""

    class CheckedTEDotProductAttention(_te_dot_product_attention()):
        """megatron's ``TEDotProductAttention``, refusing packed rows its cuDNN would train wrong (module doc)."""

        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, *args, **kwargs)
            self.packed_refusal = current_refusal(config.kv_channels)

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
            if packed_seq_params is not None and self.packed_refusal:
                raise RuntimeError(self.packed_refusal)
            mask, bias, packed = attn_mask_type, attention_bias, packed_seq_params
            return super().forward(query, key, value, attention_mask, mask, bias, packed, **kwargs)

    return CheckedTEDotProductAttention


__all__ = [
    "FIXED_IN",
    "LARGEST_SAFE_HEAD_DIM",
    "checked_te_attention_class",
    "cudnn_name",
    "current_refusal",
    "launch_refusal",
    "refusal",
    "te_cudnn_version",
    "wheel_cudnn",
    "wheel_cudnn_dir",
]
