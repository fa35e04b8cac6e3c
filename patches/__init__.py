"""Fixes to upstream megatron-core behaviour that twinkle-specs needs, each gated by version.

Each patch module exposes ``NEEDED_FOR`` (a human-readable range), ``is_needed() -> bool`` and
``apply() -> None``; :func:`apply_all` applies the needed ones once. See patches/README.md.
"""

from __future__ import annotations

from . import cuda_device_on_host, rope_on_host, router_on_host, tied_embedding_on_host

PATCHES = [rope_on_host, router_on_host, tied_embedding_on_host, cuda_device_on_host]
_applied: set[str] = set()


def apply_all() -> list[str]:
    """Applies every needed patch (idempotent) and returns the names of those in force."""
    for patch in PATCHES:
        if patch.__name__ not in _applied and patch.is_needed():
            patch.apply()
            _applied.add(patch.__name__)
    return sorted(_applied)
