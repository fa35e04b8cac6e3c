"""What every variant shares: the run's knobs (:class:`Settings`) and what a build function hands the
measurer (:class:`Prepared`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class Settings:
    """Knobs of one run (the same for every variant of it)."""

    seq_len: int = 4096
    micro_batch_size: int = 1
    # micro-batches per optimizer step: gradient accumulation, as pretrain_gpt.py runs a global batch
    # of grad_accum x micro_batch_size sequences on one GPU
    grad_accum: int = 1
    fp8_format: str = "hybrid"  # the FP8 variants' --fp8-format (hybrid: E4M3 forward, E5M2 gradients)
    # the FP8 variants' --fp8-recipe: tensorwise (the one docs/lora.md recommends for LoRA) | delayed | blockwise
    fp8_recipe: str = "tensorwise"
    warmup: int = 3
    steps: int = 10
    dtype: str = "bf16"  # bf16 | fp32
    lora_r: int = 16
    lora_alpha: float = 32.0
    # twinkle's adapters: all-linear (peft's, as (d) trains them) | unsloth (the set Unsloth's LoRA trains,
    # so that the Unsloth row compares the same adapters; see lora_config)
    lora_targets: str = "all-linear"
    lr: float = 1e-5
    ce_fusion: bool = True  # megatron cross_entropy_loss_fusion (GPU)
    ce_fusion_impl: str = "te"  # te | native
    cuda_graphs: str = "none"  # none | local | transformer_engine | full_iteration
    gpu_fusions: bool = True  # rope / swiglu fusions on the Megatron side (GPU)
    # twinkle's attention on FlashAttention-4 (build_model(flash_attn_4=True)) instead of TE's cuDNN attention
    flash_attn_4: bool = False
    mcore_overrides: dict[str, Any] = field(default_factory=dict)
    optimizer_overrides: dict[str, Any] = field(default_factory=dict)  # megatron OptimizerConfig fields
    load: bool = True  # time HF -> Megatron loading in twinkle_full (needs the safetensors checkpoint)
    profile: bool = False
    profile_steps: int = 2
    profile_trace: bool = False
    profile_stacks: bool = (
        False  # device time by operator and call site (kernels under CUDA graphs have none)
    )
    telemetry: bool = True  # GPU clocks/power per timed step (bench/telemetry.py)
    seed: int = 1234

    def torch_dtype(self) -> torch.dtype:
        return {"bf16": torch.bfloat16, "fp32": torch.float32}[self.dtype]


UNSLOTH_MOE_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
UNSLOTH_MOE_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def lora_config(s: Settings, hf_dir: Path | None = None):
    """The adapters twinkle's LoRA variants train: rank ``s.lora_r`` on all linear layers (peft's
    all-linear). With ``s.lora_targets == "unsloth"`` on Qwen3-MoE (its ``config.json`` in ``hf_dir``) the
    set Unsloth's LoRA trains there instead: attention's projections and the routed experts' fused
    ``gate_up_proj`` and ``down_proj`` at rank r, no router (peft's all-linear adapts the router and puts rank
    2r on ``gate_up_proj``); elsewhere Unsloth's set is all-linear."""
    from twinkle_specs.lora import LoraConfig

    if s.lora_targets == "unsloth" and hf_dir is not None and hf_model_type(hf_dir) == "qwen3_moe":
        return LoraConfig(
            r=s.lora_r,
            lora_alpha=s.lora_alpha,
            target_modules=UNSLOTH_MOE_ATTENTION,
            target_parameters=UNSLOTH_MOE_EXPERTS,
        )
    return LoraConfig(r=s.lora_r, lora_alpha=s.lora_alpha, target_modules="all-linear")


def hf_model_type(hf_dir: Path) -> str:
    """The ``model_type`` of the checkpoint's ``config.json``."""
    return json.loads((Path(hf_dir) / "config.json").read_text())["model_type"]


def count_params(model) -> tuple[int, int]:
    """All parameters and the trainable ones."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


@dataclass
class Prepared:
    """A built variant, ready to time: its training step and what it says of itself.

    ``step()`` runs one complete training iteration and returns the loss. ``forward()`` and
    ``backward_and_update(loss)`` are its two halves, for the activation measurement
    (:func:`bench.memory.activation_memory`); ``activation_note`` set means that measurement cannot be
    taken (it is recorded instead)."""

    result: dict[str, Any]
    step: Callable[[], Any]
    forward: Callable[[], Any] | None = None
    backward_and_update: Callable[[Any], Any] | None = None
    activation_note: str | None = None

    @classmethod
    def accumulating(
        cls,
        result: dict[str, Any],
        forward: Callable[[], Any],
        backward: Callable[[Any], None],
        update: Callable[[], None],
        micro_batches: int,
    ) -> Prepared:
        """A variant whose step runs ``micro_batches`` forwards and backwards (gradients accumulate),
        then ``update`` (the optimizer step) once; the loss returned is the last micro-batch's."""

        def backward_and_update(loss):
            backward(loss)
            update()
            return loss.detach()

        def step():
            for _ in range(micro_batches - 1):
                backward(forward())
            return backward_and_update(forward())

        passes = "forward + backward" if micro_batches == 1 else f"{micro_batches} x (forward + backward)"
        result.setdefault("step", f"{passes} + optimizer step")
        return cls(result, step, forward, backward_and_update)
