"""The benchmarked variants, one registry entry each.

Adding a variant or a peer framework is one :class:`Variant` in ``VARIANTS``: a name (the command line's
``--variants`` and results.json's ``variant``), a label, what its step computes (for the FLOP count)
and a build function ``(hf_dir, settings) -> Prepared`` that builds the model, optimizer and data and
returns the training step (:class:`~bench.settings.Prepared`); ``unavailable(hf_dir, settings)`` says
why it cannot run for that shape and those settings on this machine. Timing, memory, profiling, the
FLOP count and the report are the same for every entry. A build function imports its framework inside
itself: this module is imported by the parent process, which must stay free of CUDA and of libraries
that patch others on import.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import build_hf, build_mcore_bridge, build_megatron, build_megatron_bridge, build_unsloth
from .settings import Prepared, Settings


def _always_available(hf_dir: Path, s: Settings) -> str | None:
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
    # why it cannot run for this shape (hf_dir) and these settings here (-> skipped); called in the
    # process that runs the variant, so it may import its framework
    unavailable: Callable[[Path, Settings], str | None] = _always_available
    # a LoRA peer that (c) is measured against: the framework's name (report.py takes the fastest
    # configuration of every peer of a group as ``best_peer``); None for twinkle's and stock Megatron's
    peer: str | None = None
    # the base's GEMMs in FP8 (--fp8-format/--fp8-recipe on top of ``build``'s own config); an FP8 peer is
    # measured against (h), not (c)
    fp8: bool = False
    reads_checkpoint: bool = False  # builds from the HF checkpoint's weights: the run writes one first
    # its own CUDA graphs (Settings.cuda_graphs, whatever --cuda-graphs says): a configuration of ours
    # measured beside the eager one in the same group
    cuda_graphs: str | None = None
    # another configuration of that variant (its name): the report takes the fastest configuration as that
    # variant's figure against the best peer, as it takes each peer framework's fastest
    configuration_of: str | None = None
    # twinkle's attention on FlashAttention-4 (Settings.flash_attn_4): a configuration of ours, as above
    flash_attn_4: bool = False

    @property
    def base(self) -> str:
        """The variant this one is a configuration of (itself where it is no other's)."""
        return self.configuration_of or self.name

    def settings(self, s: Settings) -> Settings:
        """The settings this variant builds under: its own CUDA graphs and FP8's flags on top of ``s``."""
        s = dataclasses.replace(s, cuda_graphs=self.cuda_graphs) if self.cuda_graphs else s
        s = dataclasses.replace(s, flash_attn_4=True) if self.flash_attn_4 else s
        return build_megatron.fp8_settings(s) if self.fp8 else s

    def why_not(self, hf_dir: Path, s: Settings) -> str | None:
        """Why this variant cannot run here (``unavailable``, FP8's and CUDA graphs' own conditions)."""
        return (
            self.unavailable(hf_dir, self.settings(s))
            or (build_megatron.fp8_unavailable(hf_dir, s) if self.fp8 else None)
            or (build_megatron.graphs_unavailable() if self.cuda_graphs else None)
            or (build_megatron.flash_attn_4_unavailable(hf_dir, s) if self.flash_attn_4 else None)
        )

    def prepare(self, hf_dir: Path, s: Settings) -> Prepared:
        """``build`` under this variant's settings (:meth:`settings`), which its row records."""
        prepared = self.build(hf_dir, self.settings(s))
        if self.fp8:
            prepared.result["fp8_flags"] = f"--fp8-format {s.fp8_format} --fp8-recipe {s.fp8_recipe}"
        if self.cuda_graphs:
            prepared.result["cuda_graphs"] = self.cuda_graphs
        return prepared


def _hf_peer(name: str, label: str, default: bool = True) -> Variant:
    """A transformers + PEFT LoRA configuration of :data:`build_hf.TUNINGS` as a variant."""
    tuning = build_hf.TUNINGS[name]
    return Variant(
        name,
        label,
        "lora",
        functools.partial(build_hf.prepare, peft_lora=True, tuning=tuning),
        default=default,
        unavailable=functools.partial(build_hf.unavailable, tuning=tuning),
        peer="transformers + PEFT",
    )


def _megatron_bridge_peer(name: str, label: str, build, **kw) -> Variant:
    """A Megatron-Bridge LoRA configuration (:mod:`build_megatron_bridge`) as a variant."""
    return Variant(
        name,
        label,
        "lora",
        build,
        unavailable=build_megatron_bridge.unavailable,
        peer="Megatron-Bridge",
        **kw,
    )


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
        # (c) under Transformer Engine's CUDA graphs (pretrain_gpt.py --cuda-graph-impl transformer_engine):
        # each layer's forward and backward replayed, no host launch per kernel
        Variant(
            "twinkle_lora_graphs",
            "(c-graphs) (c) under TE CUDA graphs",
            "lora",
            build_megatron.twinkle_lora,
            default=False,
            cuda_graphs="transformer_engine",
            configuration_of="twinkle_lora",
        ),
        # (c-graphs) with the attention on FlashAttention-4 (twinkle_specs.flash_attention, --flash-attn-4)
        Variant(
            "twinkle_lora_graphs_fa4",
            "(c-graphs-fa4) (c-graphs) with FlashAttention-4 attention",
            "lora",
            build_megatron.twinkle_lora,
            default=False,
            cuda_graphs="transformer_engine",
            configuration_of="twinkle_lora",
            flash_attn_4=True,
        ),
        _hf_peer("hf_peft_lora", "(d) transformers + PEFT LoRA all-linear (sdpa), peft defaults"),
        _hf_peer("hf_peft_lora_autocast", "(d1) (d) under autocast bf16 (HF Trainer's bf16=True)"),
        _hf_peer("hf_peft_lora_bf16", "(d2) (d) with bf16 adapters"),
        _hf_peer("hf_peft_lora_liger", "(d3) (d) with bf16 adapters + Liger-Kernel"),
        _hf_peer("hf_peft_lora_compile", "(d4) (d) with bf16 adapters + Liger fused CE + torch.compile"),
        _hf_peer(
            "hf_peft_lora_liger_fa4", "(d5) (d3) with FlashAttention-4 (attn_implementation)", default=False
        ),
        # its own child process only (Unsloth patches transformers, peft and trl on import); wheels:
        # bench/peers.sh
        Variant(
            "unsloth_lora",
            "(j) Unsloth LoRA all-linear, bf16 base, its fused kernels",
            "lora",
            build_unsloth.lora,
            unavailable=build_unsloth.unavailable,
            peer="Unsloth",
            reads_checkpoint=True,
        ),
        # (j) with torch's flash attention kernels swapped for FlashAttention-4 by Unsloth's own switch, as its
        # trainer does for packed rows
        Variant(
            "unsloth_lora_fa4",
            "(j1) (j) with Unsloth's FlashAttention-4 switch (UNSLOTH_FLASH_ATTENTION_IMPL=fa4)",
            "lora",
            functools.partial(build_unsloth.lora, flash_impl="fa4"),
            default=False,
            unavailable=build_unsloth.unavailable_fa4,
            peer="Unsloth",
            reads_checkpoint=True,
        ),
        # ModelScope's Megatron LoRA (ms-swift 4 on mcore-bridge): the model and adapters theirs, DDP,
        # optimizer and step the harness's; own process only (mcore-bridge patches megatron-core and peft)
        Variant(
            "mcore_bridge_lora",
            "(k) ModelScope ms-swift / mcore-bridge LoRA all-linear",
            "lora",
            build_mcore_bridge.lora,
            unavailable=build_mcore_bridge.unavailable,
            peer="ms-swift + mcore-bridge",
        ),
        # NVIDIA's Megatron-LM LoRA (Megatron-Bridge 0.6, megatron-core 0.19 only): its fastest LoRA (TE
        # op-fuser graphs) and its recipes' default; own process only (its import changes global state)
        _megatron_bridge_peer(
            "megatron_bridge_lora",
            "(l) NVIDIA Megatron-Bridge LoRA all-linear (TEFusedLoRALinear)",
            build_megatron_bridge.lora,
        ),
        _megatron_bridge_peer(
            "megatron_bridge_lora_linear",
            "(l1) Megatron-Bridge LoRA all-linear, its recipes' default (LoRALinear)",
            build_megatron_bridge.lora_linear,
        ),
        _megatron_bridge_peer(
            "megatron_bridge_lora_canonical",
            "(l2) Megatron-Bridge CanonicalLoRA (separate q/k/v and gate/up adapters, as peft trains)",
            build_megatron_bridge.lora_canonical,
            default=False,
        ),
        Variant(
            "twinkle_frozen",
            "(e) twinkle_specs, all weights frozen (fwd+bwd, no optimizer; memory reference)",
            "frozen",
            build_megatron.twinkle_frozen,
            interleavable=True,
        ),
        Variant("hf_full", "(f) transformers full fine-tune (sdpa)", "full", build_hf.full, default=False),
        # Not in the default list: a workload of its own (one packed row, micro-batch 1, eager) that no
        # target judges, and one more model build per shape in a preset sized to one device call.
        Variant(
            "twinkle_lora_sft",
            "(g) twinkle_specs LoRA all-linear, packed SFT rows",
            "lora",
            build_megatron.twinkle_lora_sft,
            default=False,
            interleavable=True,
            unavailable=build_megatron.packed_sft_unavailable,
        ),
        # (g) with the attention on FlashAttention-4: its varlen kernels for the packed row
        Variant(
            "twinkle_lora_sft_fa4",
            "(g-fa4) (g) with FlashAttention-4 attention (varlen)",
            "lora",
            build_megatron.twinkle_lora_sft,
            default=False,
            interleavable=True,
            unavailable=build_megatron.packed_sft_unavailable,
            configuration_of="twinkle_lora_sft",
            flash_attn_4=True,
        ),
        # the frozen base's GEMMs in FP8 through Transformer Engine (--fp8-format/--fp8-recipe), the
        # adapters bf16; and stock full fine-tuning in FP8 for reference. Not in the default list: run
        # them with --variants (they need a GPU of compute capability 8.9+).
        Variant(
            "twinkle_lora_fp8",
            "(h) (c) with the frozen base's GEMMs in FP8",
            "lora",
            build_megatron.twinkle_lora,
            default=False,
            interleavable=True,
            fp8=True,
        ),
        # (h) under TE CUDA graphs, as (c-graphs) is (c)
        Variant(
            "twinkle_lora_fp8_graphs",
            "(h-graphs) (h) under TE CUDA graphs",
            "lora",
            build_megatron.twinkle_lora,
            default=False,
            fp8=True,
            cuda_graphs="transformer_engine",
            configuration_of="twinkle_lora_fp8",
        ),
        Variant(
            "mcore_te_full_fp8",
            "(i) (a) in FP8",
            "full",
            build_megatron.stock_te_full,
            default=False,
            interleavable=True,
            unavailable=build_megatron.stock_te_unavailable,
            fp8=True,
        ),
        # the Megatron peers' LoRA on an FP8 base, measured against (h)
        Variant(
            "mcore_bridge_lora_fp8",
            "(k-fp8) (k) with the base's GEMMs in FP8",
            "lora",
            build_mcore_bridge.lora,
            default=False,
            unavailable=build_mcore_bridge.unavailable,
            peer="ms-swift + mcore-bridge",
            fp8=True,
        ),
        _megatron_bridge_peer(
            "megatron_bridge_lora_fp8",
            "(l-fp8) (l) with the base's GEMMs in FP8",
            build_megatron_bridge.lora,
            default=False,
            fp8=True,
        ),
        _megatron_bridge_peer(
            "megatron_bridge_lora_linear_fp8",
            "(l1-fp8) (l1) with the base's GEMMs in FP8",
            build_megatron_bridge.lora_linear,
            default=False,
            fp8=True,
        ),
    )
}
