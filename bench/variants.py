"""The benchmarked variants, one registry entry each.

Adding a variant or a peer framework is one :class:`Variant` in ``VARIANTS``: a name (the command line's
``--variants`` and results.json's ``variant``), a label, what its step computes (for the FLOP count)
and a build function ``(hf_dir, settings) -> Prepared`` that builds the model, optimizer and data and
returns the training step (:class:`~bench.settings.Prepared`). Timing, memory, profiling, the FLOP
count and the report are the same for every entry. A build function imports its framework inside
itself: this module is imported by the parent process, which must stay free of CUDA and of libraries
that patch others on import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import build_hf, build_megatron
from .settings import Prepared, Settings


def _always_available() -> str | None:
    return None


@dataclass(frozen=True)
class Variant:
    """One training setup that the benchmark times."""

    name: str
    label: str  # "(x) what it is", the report's row label
    mode: str  # what one step computes, for the FLOP count (bench/flops.py): full | lora | frozen
    build: Callable[[Path, Settings], Prepared]
    default: bool = True  # in the default --variants list
    # --interleave: built beside other such variants in one process and stepped in turn (eager; the
    # Megatron variants, whose process-wide state allows several models at once)
    interleavable: bool = False
    times_load: bool = False  # times the HF checkpoint's load: the run writes one first
    unavailable: Callable[[], str | None] = _always_available  # why it cannot run here (-> skipped)


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant(
            "mcore_te_full",
            "(a) megatron-core TE spec, full fine-tune",
            "full",
            build_megatron.stock_te_full,
            interleavable=True,
            unavailable=build_megatron.stock_te_unavailable,
        ),
        Variant(
            "twinkle_full",
            "(b) twinkle_specs spec, full fine-tune",
            "full",
            build_megatron.twinkle_full,
            interleavable=True,
            times_load=True,
        ),
        Variant(
            "twinkle_lora",
            "(c) twinkle_specs LoRA all-linear",
            "lora",
            build_megatron.twinkle_lora,
            interleavable=True,
        ),
        Variant("hf_peft_lora", "(d) transformers + PEFT LoRA all-linear (sdpa)", "lora", build_hf.peft_lora),
        Variant(
            "twinkle_frozen",
            "(e) twinkle_specs, all weights frozen (fwd+bwd, no optimizer; memory reference)",
            "frozen",
            build_megatron.twinkle_frozen,
            interleavable=True,
        ),
        Variant("hf_full", "(f) transformers full fine-tune (sdpa)", "full", build_hf.full, default=False),
    )
}
