"""Checkpoint tensors that text training deliberately leaves alone (the Qwen3.5 vision tower, MTP heads).

Each is matched by a named rule (:data:`~twinkle_specs.hybrid_config.LEFT_ALONE`): the loader counts it
per rule in its report instead of refusing it as unknown, and export copies it back byte-identical, so
the exported checkpoint loads in transformers as the same (multimodal) model.
"""

from __future__ import annotations

from collections.abc import Iterable

from .hf_config import QwenArch
from .hybrid_config import LEFT_ALONE


def left_alone(names: Iterable[str], arch: QwenArch) -> dict[str, str]:
    """name -> the rule (prefix) that leaves it alone, for the tensors of ``names`` such a rule covers.
    Only the hybrid Qwen models have these rules; the vision rule only for multimodal checkpoints."""
    if arch.hybrid is None:
        return {}
    rules = {p: why for p, why in LEFT_ALONE.items() if arch.hybrid.multimodal or p != "model.visual."}
    return {n: p for n in names for p in rules if n.startswith(p)}


def describe(counts: dict[str, int]) -> str:
    """``model.visual.*: 21 tensors (why)``, one rule after another."""
    return "; ".join(f"{p}*: {n} tensors ({LEFT_ALONE[p]})" for p, n in sorted(counts.items())) or "none"
