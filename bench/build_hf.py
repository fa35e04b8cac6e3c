"""The transformers variants: (d) transformers + PEFT LoRA, as peft's defaults run it and in the tuned
configurations users pick for speed (:data:`TUNINGS`), and (f) a full fine-tune; sdpa attention (one
tuning FlashAttention-4) and torch AdamW (fused on a GPU) throughout."""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import peer_kits
from .device import device, on_gpu
from .settings import Prepared, Settings, count_params
from .timing import CLOCK


@dataclass(frozen=True)
class Tuning:
    """How a transformers + PEFT run is sped up (each tried, the fastest is the peer; docs/benchmarks.md).

    ``autocast``: the forward under ``torch.autocast(bfloat16)``, what HF Trainer's ``bf16=True`` does;
    ``bf16_adapters``: peft's ``autocast_adapter_dtype=False``, the adapters in the model's bf16 instead of
    peft's fp32 upcast; ``liger``: Liger-Kernel on the model as HF Trainer's ``use_liger_kernel=True``
    applies it (RMSNorm, SwiGLU, RoPE and the fused linear cross-entropy that never materialises the
    logits); ``liger_only_ce``: of Liger only the fused linear cross-entropy, the rest left to
    ``compile``: each decoder layer ``torch.compile``d (regional compilation: one graph shared by
    every layer, so the compile time does not grow with depth)."""

    autocast: bool = False
    bf16_adapters: bool = False
    liger: bool = False
    liger_only_ce: bool = False
    compile: bool = False
    attention: str = "sdpa"  # transformers' attn_implementation

    def describe(self) -> str:
        parts = [
            "autocast bf16" if self.autocast else "",
            "bf16 adapters" if self.bf16_adapters else "",
            "Liger (RMSNorm, SwiGLU, RoPE, fused linear CE)" if self.liger else "",
            "Liger fused linear CE" if self.liger_only_ce else "",
            "torch.compile per decoder layer" if self.compile else "",
            f"attn_implementation={self.attention}" if self.attention != "sdpa" else "",
        ]
        return ", ".join(p for p in parts if p) or "peft defaults (fp32 adapters, no autocast)"


TUNINGS = {
    "hf_peft_lora": Tuning(),
    "hf_peft_lora_autocast": Tuning(autocast=True),
    "hf_peft_lora_bf16": Tuning(bf16_adapters=True),
    "hf_peft_lora_liger": Tuning(bf16_adapters=True, liger=True),
    "hf_peft_lora_compile": Tuning(bf16_adapters=True, liger_only_ce=True, compile=True),
    "hf_peft_lora_liger_fa4": Tuning(bf16_adapters=True, liger=True, attention="flash_attention_4"),
}


def prepare(hf_dir: Path, s: Settings, peft_lora: bool = False, tuning: Tuning = Tuning()) -> Prepared:
    """A transformers model from the config in ``hf_dir`` (random weights, seeded), with PEFT LoRA on all
    linear layers when ``peft_lora``, sped up as ``tuning`` says, its optimizer and data."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(s.seed)
    dev = device()
    config = AutoConfig.from_pretrained(hf_dir)
    config.use_cache = False
    with dev:
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=tuning.attention, dtype=s.torch_dtype()
        )
    result: dict[str, Any] = {"impl": f"transformers {model.config._attn_implementation}"}
    if rule := gdn_rule(config, dev.type == "cuda"):
        result["gdn_rule"] = rule
    experts = getattr(model.config, "_experts_implementation", None)
    if experts and getattr(config, "num_experts", None):
        result["impl"] += f", experts {experts}"
    if tuning.liger or tuning.liger_only_ce:
        result["liger"] = _apply_liger(model, only_ce=tuning.liger_only_ce)
    if peft_lora:
        model = _peft(model, s, tuning, result)
        result["tuning"] = tuning.describe()
    if tuning.compile:
        layers = _decoder_layers(model)
        for layer in layers:
            layer.compile()
        result["compiled"] = f"{len(layers)} decoder layers (torch.compile, default mode)"
    model.train()
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16) if tuning.autocast else contextlib.nullcontext()
    return causal_lm_step(result, model, config.vocab_size, s, autocast)


def causal_lm_step(
    result: dict[str, Any], model, vocab_size: int, s: Settings, autocast: Any = None
) -> Prepared:
    """The training step of a transformers causal LM (the (d) configurations, Unsloth): the model's own loss
    on seeded random tokens (labels = inputs), a backward per micro-batch, then gradient clipping at 1.0
    and torch AdamW (fused on a GPU) on the trainable parameters; the forward under ``autocast`` if given."""
    autocast = autocast or contextlib.nullcontext()
    result["total_params"], result["trainable_params"] = count_params(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.95), weight_decay=0.01, fused=on_gpu())
    result["optimizer"] = "torch.optim.AdamW" + (" (fused)" if on_gpu() else "")
    gen = torch.Generator().manual_seed(s.seed)
    tokens = torch.randint(0, vocab_size, (s.micro_batch_size, s.seq_len), generator=gen).to(device())

    def forward():
        with CLOCK.phase("forward"), autocast:
            return model(input_ids=tokens, labels=tokens).loss

    def backward(loss):
        with CLOCK.phase("backward"):
            (loss / s.grad_accum).backward()

    def update():
        with CLOCK.phase("optimizer"):
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

    return Prepared.accumulating(result, forward, backward, update, s.grad_accum)


# an MoE shared expert's one-output gate (Qwen3.5-MoE): peft's all-linear would adapt it, twinkle-specs' LoRA
# does not, so the transformers-based peers leave it out too
UNADAPTED_GATE = "shared_expert_gate"


def gdn_rule(config, on_cuda: bool) -> str | None:
    """For a transformers model with Gated DeltaNet layers, the chunked rule its training runs (None without
    such layers). transformers' Gated DeltaNet takes fla's kernel whenever fla is installed, else its torch
    rule; where fla refuses its gated chunk_bwd_dqkwg, the torch one that twinkle's layers use stands in (given
    to fla here, for every caller in this process)."""
    if "linear_attention" not in (getattr(config, "layer_types", None) or ()):
        return None
    if importlib.util.find_spec("fla") is None:
        return "torch reference (transformers')"
    from twinkle_specs.gdn import train_on_fla, training_rule

    if on_cuda:
        train_on_fla()
    return training_rule(on_cuda)


def _peft(model, s: Settings, tuning: Tuning, result: dict[str, Any]):
    """``model`` with peft's LoRA on all linear layers (the output layer excluded, as peft does)."""
    import peft

    # all-linear also takes an MoE shared expert's one-output gate (Qwen3.5-MoE), which twinkle-specs'
    # LoRA does not adapt: left out, so that (c) and (d) train the same adapters
    excluded = (
        [UNADAPTED_GATE] if any(n.endswith(f".{UNADAPTED_GATE}") for n, _ in model.named_modules()) else None
    )
    model = peft.get_peft_model(
        model,
        peft.LoraConfig(
            r=s.lora_r,
            lora_alpha=s.lora_alpha,
            target_modules="all-linear",
            exclude_modules=excluded,
            lora_dropout=0.0,
        ),
        autocast_adapter_dtype=not tuning.bf16_adapters,
    )
    if excluded:
        result["peft_exclude_modules"] = excluded
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.requires_grad})
    result["adapter_dtypes"] = dtypes  # peft upcasts adapters to fp32 unless autocast_adapter_dtype=False
    return model


def _apply_liger(model, only_ce: bool) -> str:
    """Liger-Kernel on ``model`` as HF Trainer's ``use_liger_kernel=True`` does
    (``_apply_liger_kernel_to_instance``), before peft wraps it; ``only_ce``: its fused linear
    cross-entropy alone. Returns what was applied."""
    from importlib.metadata import version

    peer_kits.activate("liger")
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    kernels = {"fused_linear_cross_entropy": True}
    if only_ce:
        kernels |= {"rope": False, "rms_norm": False, "swiglu": False}
    _apply_liger_kernel_to_instance(model=model, **kernels)
    return f"liger-kernel {version('liger-kernel')}: " + ", ".join(
        k for k in ("rope", "rms_norm", "swiglu", "fused_linear_cross_entropy") if kernels.get(k, True)
    )


def _decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layers of a (peft-wrapped) causal LM: ``<...>.model.layers``."""
    for name, module in model.named_modules():
        if name.endswith("model.layers") and isinstance(module, torch.nn.ModuleList):
            return list(module)
    raise ValueError(f"no decoder layers (…model.layers) in {type(model).__name__}")


def unavailable(hf_dir: Path, s: Settings, tuning: Tuning) -> str | None:
    """Why a tuned configuration cannot run here: Liger's Triton kernels need a CUDA GPU and the
    liger-kernel package; torch.compile is timed on a GPU only (inductor's CPU code is another program)."""
    if (tuning.liger or tuning.liger_only_ce) and not on_gpu():
        return "Liger-Kernel's Triton kernels need a CUDA GPU"
    if (tuning.liger or tuning.liger_only_ce) and (
        peer_kits.activate("liger") is None and importlib.util.find_spec("liger_kernel") is None
    ):
        return f"liger-kernel is not installed (pip install liger-kernel; on the device: {peer_kits.STAGE})"
    if tuning.attention == "flash_attention_4" and (missing := peer_kits.flash_attn_4_missing()):
        return missing
    if tuning.compile and not on_gpu():
        return "torch.compile is timed on a GPU only (inductor's CPU code is not the program measured)"
    return None


def full(hf_dir: Path, s: Settings) -> Prepared:
    return prepare(hf_dir, s)
