"""Fixes to upstream megatron-core behaviour that twinkle-specs needs, each gated by version.

Each patch module exposes ``NEEDED_FOR`` (a human-readable range), ``is_needed() -> bool`` and
``apply() -> None``; :func:`apply_all` applies the needed ones once, except those named in
``$TWINKLE_PATCHES_OFF`` (comma-separated, for A/B runs or to keep upstream behaviour). See
patches/README.md.
"""

from __future__ import annotations

import os

from . import (
    cross_entropy_without_sync,
    cuda_device_on_host,
    grad_norm_on_device,
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
]
OFF_ENV = "TWINKLE_PATCHES_OFF"
_applied: set[str] = set()


def short_name(patch) -> str:
    return patch.__name__.rpartition(".")[2]


def switched_off() -> set[str]:
    """The patch names in ``$TWINKLE_PATCHES_OFF``; an unknown name is an error, not a silent no-op."""
    off = {n.strip() for n in os.environ.get(OFF_ENV, "").split(",") if n.strip()}
    unknown = off - {short_name(p) for p in PATCHES}
    if unknown:
        known = ", ".join(short_name(p) for p in PATCHES)
        raise ValueError(f"${OFF_ENV} names unknown patches {sorted(unknown)}; known: {known}")
    return off


def apply_all() -> list[str]:
    """Applies every needed patch not switched off (idempotent) and returns the names of those in force."""
    off = switched_off()
    for patch in PATCHES:
        if patch.__name__ not in _applied and short_name(patch) not in off and patch.is_needed():
            patch.apply()
            _applied.add(patch.__name__)
    return sorted(_applied)
