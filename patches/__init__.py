"""Fixes to upstream megatron-core behaviour that twinkle-specs needs, each gated by version.

Each patch module exposes ``NEEDED_FOR`` (a human-readable range), ``is_needed() -> bool`` and
``apply() -> None``; :func:`apply_all` (``twinkle_specs.apply_patches``) applies the needed ones once,
except those named in ``$TWINKLE_PATCHES_OFF`` (comma-separated, for A/B runs or to keep upstream
behaviour). Nothing is applied on import. See patches/README.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from . import (
    cross_entropy_without_sync,
    cuda_device_on_host,
    grad_norm_on_device,
    local_graph_inputs_kept,
    moe_counts_on_device,
    moe_permute_fixed_size,
    moe_single_rank_sort,
    packed_seq_1d,
    rope_on_host,
    router_on_host,
    tied_embedding_on_host,
)

PATCHES = [
    rope_on_host,
    router_on_host,
    tied_embedding_on_host,
    cuda_device_on_host,
    grad_norm_on_device,
    cross_entropy_without_sync,
    moe_single_rank_sort,
    moe_counts_on_device,
    moe_permute_fixed_size,
    local_graph_inputs_kept,
    packed_seq_1d,
]
OFF_ENV = "TWINKLE_PATCHES_OFF"
_applied: set[str] = set()


def short_name(patch) -> str:
    return patch.__name__.rpartition(".")[2]


def _known(names: set[str], where: str) -> set[str]:
    """``names``, checked: an unknown patch name is an error that lists the known ones, not a no-op."""
    unknown = names - {short_name(p) for p in PATCHES}
    if unknown:
        known = ", ".join(short_name(p) for p in PATCHES)
        raise ValueError(f"{where} names unknown patches {sorted(unknown)}; known: {known}")
    return names


def switched_off() -> set[str]:
    """The patch names in ``$TWINKLE_PATCHES_OFF``."""
    return _known({n.strip() for n in os.environ.get(OFF_ENV, "").split(",") if n.strip()}, f"${OFF_ENV}")


def apply_all(names: Iterable[str] | None = None) -> list[str]:
    """Applies every needed patch (or only those in ``names``) not switched off, once, and returns the
    names of those in force."""
    off = switched_off()
    wanted = None if names is None else _known(set(names), "apply_patches")
    for patch in PATCHES:
        name = short_name(patch)
        if wanted is not None and name not in wanted:
            continue
        if patch.__name__ not in _applied and name not in off and patch.is_needed():
            patch.apply()
            _applied.add(patch.__name__)
    return sorted(_applied)
