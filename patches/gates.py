"""What the patches' ``is_needed`` checks share."""

from __future__ import annotations

from packaging.version import Version


def megatron_core_in(lo: str, hi: str) -> bool:
    """Whether the installed megatron-core is at least ``lo`` and below ``hi`` (the releases a patch
    was written against and checked on)."""
    import megatron.core

    return Version(lo) <= Version(megatron.core.__version__) < Version(hi)
