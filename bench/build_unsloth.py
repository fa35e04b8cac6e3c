"""The Unsloth peer: LoRA through Unsloth's own fast path on a bf16 base, with the same data, torch AdamW
and step structure as the transformers peers (:mod:`bench.build_hf`).

Unsloth is imported inside the functions only: on import it patches transformers, peft, trl and torch
process-wide, so it may run in the variant's own child process and nowhere else. The device machine has
no network and no Unsloth: its wheels (unsloth, unsloth_zoo, trl, datasets, dill, multiprocess and a
bitsandbytes cut to its CUDA 13.0 library) come from the kit ``bench/peers.sh`` stages and installs in a
folder of its own (:mod:`bench.peer_kits`), first on ``sys.path`` in this variant's process only.

The configuration is the fastest one that fits one 80 GB H100 at Qwen3-8B's full depth (36 layers),
sequence 4096, micro-batch 1:

* ``use_gradient_checkpointing=False`` (:data:`GRADIENT_CHECKPOINTING`). Unsloth's default, ``"unsloth"``,
  offloads each layer's input to host memory and recomputes the layer in the backward: one more forward
  per step, for memory this shape does not need. Without it a layer keeps about 0.5 GiB for its backward
  (the inputs its fused kernels and SDPA save, the MLP's gate and up outputs), ~18 GiB at 36 layers, beside
  15.3 GiB of bf16 weights and 0.7 GiB of fp32 adapters with gradients and Adam state. The environment
  variable :data:`GC_ENV` (``false``, ``true`` or ``unsloth``) overrides it for an A/B or a deeper model.
* bf16 base (``load_in_4bit=False``, ``load_in_16bit=True``); LoRA on q, k, v, o, gate, up and down with
  dropout 0 and no bias, the conditions for Unsloth's fused LoRA autograd functions (QKV, O, SwiGLU MLP).
  Unsloth keeps the adapters in fp32 and its kernels cast them to bf16 at each matmul.
* no autocast: HF Trainer's ``bf16=True`` would add one, but every matmul here already runs in bf16
  (Unsloth's kernels cast the fp32 adapters themselves), so it would mostly add casts.
* attention through Unsloth's dispatch (flash-attn, then xformers, then SDPA); the device image has
  neither package, so SDPA (PyTorch's flash kernel) runs. Loss: Unsloth's chunked fused cross-entropy.
* the whole model on this GPU (an explicit ``device_map``) and the input embedding kept there
  (``offload_embedding=False``): Unsloth's automatic choices may move it to host memory.

Qwen3 and Qwen2 run Unsloth's Llama-family fast path (FastQwen3Model / FastQwen2Model); Qwen3-MoE goes
through its generic FastModel path (compiled transformers modules, grouped-GEMM experts, expert LoRA as
peft ``target_parameters``), which Unsloth picks itself for that model type.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from . import peer_kits
from .build_hf import UNADAPTED_GATE, causal_lm_step, gdn_rule
from .settings import Prepared, Settings, hf_model_type

KIT = peer_kits.STAGE
# what Unsloth imports beyond the device image: trl and datasets on import, bitsandbytes when it patches
# a loaded model (unsloth_zoo's patch_model_and_tokenizer), even for a 16-bit LoRA
PACKAGES = ("unsloth", "unsloth_zoo", "trl", "datasets", "dill", "multiprocess", "bitsandbytes")
# model type -> the Unsloth path it takes; others are skipped (see unavailable)
PATHS = {
    "qwen3": "FastQwen3Model",
    "qwen2": "FastQwen2Model",
    "qwen3_moe": "FastModel (compiled modules, grouped-GEMM experts)",
    "qwen3_5_text": "FastModel (compiled modules, fla's Gated DeltaNet rule as one op)",
    "qwen3_5_moe_text": "FastModel (compiled modules, fla's Gated DeltaNet rule as one op, grouped-GEMM experts)",
}
# model types whose layers are not q/k/v/o + SwiGLU alone (the Gated DeltaNet projections, a shared expert):
# their targets are every linear layer's name, as peft's all-linear takes them for (d), see _all_linear
ALL_LINEAR = {"qwen3_5_text", "qwen3_5_moe_text"}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GRADIENT_CHECKPOINTING: bool | str = False
GC_ENV = "BENCH_UNSLOTH_GRADIENT_CHECKPOINTING"
FLASH_IMPL_ENV = "UNSLOTH_FLASH_ATTENTION_IMPL"  # Unsloth's switch of torch's flash attention implementation
# Set before Unsloth is imported: no network on the device machine, so no Hub look-ups, no download
# statistics (unsloth/models/_utils.py get_statistics) and no remote model-name mapper (loader_utils.py),
# and its generated modules in a temporary folder rather than ./unsloth_compiled_cache in the repository.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "UNSLOTH_DISABLE_STATISTICS": "1",
    "UNSLOTH_COMPILE_LOCATION": str(Path(tempfile.gettempdir()) / "unsloth_compiled_cache"),
}


def unavailable_fa4(hf_dir: Path, s: Settings) -> str | None:
    """:func:`unavailable`, and FlashAttention-4 for Unsloth's flash switch (``lora(flash_impl="fa4")``): the
    ``unsloth_fa4`` kit's release, which torch's FA4 registry can call, over the CuTe DSL of twinkle's kit."""
    if reason := unavailable(hf_dir, s):
        return reason
    # first: looking for flash_attn.cute imports flash_attn, from wherever the path then finds it
    if peer_kits.activate("unsloth_fa4") is None:
        return (
            "the unsloth_fa4 kit is not installed (flash-attn-4 4.0.0b18: torch's FA4 registry, which Unsloth's "
            f"switch goes through, cannot call later releases): {KIT}"
        )
    return peer_kits.flash_attn_4_missing()


def unavailable(hf_dir: Path, s: Settings) -> str | None:
    """Why the Unsloth peer cannot run here: no CUDA GPU, the kit not installed, fp32, or a model type
    this peer does not drive. Does not import Unsloth (that patches other libraries)."""
    peer_kits.activate("unsloth")
    if not torch.cuda.is_available():
        return "Unsloth needs a CUDA GPU (its LoRA, RMSNorm, RoPE and cross-entropy kernels are Triton GPU kernels)"
    missing = [p for p in PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        return f"Unsloth is not installed ({', '.join(missing)} missing): {KIT}"
    if s.dtype != "bf16":
        return "the Unsloth peer trains LoRA on a bf16 base; an fp32 base turns its fused LoRA kernels off"
    model_type = hf_model_type(hf_dir)
    if model_type not in PATHS:
        return (
            f"model type {model_type!r} is not driven by this peer (covered: {', '.join(PATHS)}); Unsloth would "
            "take its generic FastModel path for it, which was not checked here"
        )
    return None


def _all_linear(model) -> list[str]:
    """``model``'s linear layers as peft's all-linear picks them for the transformers peers: every
    ``nn.Linear`` but the output layer and an MoE shared expert's one-output gate (which (c) and (d) leave
    out alike, :func:`bench.build_hf._peft`). A shared expert's projections are named with their parent
    (``shared_expert.gate_proj``): Unsloth reads a bare ``gate_proj``/``up_proj``/``down_proj`` in an MoE
    model as a request for LoRA on the routed experts too, which neither (c) nor (d) trains."""
    names = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            parts = name.split(".")
            names.add(".".join(parts[-2:]) if parts[-2:-1] == ["shared_expert"] else parts[-1])
    return sorted(names - {"lm_head", UNADAPTED_GATE})


def _gradient_checkpointing() -> bool | str:
    """:data:`GRADIENT_CHECKPOINTING`, or the mode :data:`GC_ENV` names."""
    value = os.environ.get(GC_ENV, "").strip().lower()
    if not value:
        return GRADIENT_CHECKPOINTING
    modes: dict[str, bool | str] = {"false": False, "0": False, "true": True, "1": True, "unsloth": "unsloth"}
    if value not in modes:
        raise ValueError(f"{GC_ENV}={value!r}: use false, true or unsloth")
    return modes[value]


def _stub_tokenizer(folder: Path) -> Path:
    """A three-token tokenizer: Unsloth's loader loads one, the harness's checkpoint has none, and the
    data are token ids. Its pad token is valid and not eos, so Unsloth adds no token (no resize)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<pad>": 1, "<eos>": 2}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<eos>",
    )
    tokenizer.save_pretrained(folder)
    return folder


def _name(fn: Any) -> str:
    return getattr(getattr(fn, "__func__", fn), "__name__", "")


def _fused_lora(model) -> str:
    """How many decoder layers run Unsloth's fused LoRA functions (the Llama-family path sets them)."""
    layers = next(
        (
            m
            for n, m in model.named_modules()
            if n.endswith("model.layers") and isinstance(m, torch.nn.ModuleList)
        ),
        [],
    )
    # a hybrid model's linear-attention layers have no self_attn
    attn = [getattr(layer, "self_attn", None) for layer in layers]
    qkv = sum(_name(getattr(a, "apply_qkv", None)) == "apply_lora_qkv" for a in attn)
    out = sum(_name(getattr(a, "apply_o", None)) == "apply_lora_o" for a in attn)
    mlp = sum(
        _name(getattr(getattr(layer, "mlp", None), "forward", None)).startswith("apply_lora_mlp")
        for layer in layers
    )
    return f"of {len(layers)} layers: QKV {qkv}, O {out}, MLP {mlp}"


def _attention() -> str:
    """The attention backend Unsloth's dispatch takes for an unmasked causal batch."""
    from unsloth.models import _utils

    if getattr(_utils, "HAS_FLASH_ATTENTION", False):
        return "flash-attn"
    return "xformers" if getattr(_utils, "xformers", None) is not None else "sdpa"


def _versions() -> dict[str, str]:
    out = {}
    for package in ("unsloth", "unsloth_zoo", "trl", "transformers", "peft"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = "?"
    return out


def lora(hf_dir: Path, s: Settings, flash_impl: str | None = None) -> Prepared:
    """Unsloth LoRA (r, alpha from the settings) on the checkpoint in ``hf_dir`` (the run writes it: the
    variant ``reads_checkpoint``), torch AdamW, random token data as :func:`bench.build_hf.prepare` makes it.
    ``flash_impl`` (``"fa4"``): torch's flash attention kernels swapped for that implementation process-wide
    through Unsloth's own switch (``UNSLOTH_FLASH_ATTENTION_IMPL``, ``maybe_activate_flash_attention_impl``),
    which its trainer turns on inside ``trainer.train()`` for packed rows; an error where it does not take."""
    peer_kits.activate("unsloth")
    if flash_impl:
        peer_kits.activate("unsloth_fa4")  # ahead of twinkle's release, before anything imports flash_attn
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    import unsloth  # noqa: F401  (first: it patches transformers, peft and trl)
    from unsloth import FastLanguageModel

    gc_mode = _gradient_checkpointing()
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(s.seed)
    with tempfile.TemporaryDirectory(prefix="unsloth-tokenizer-") as folder:
        model, _ = FastLanguageModel.from_pretrained(
            model_name=str(hf_dir),
            max_seq_length=s.seq_len,
            dtype=torch.bfloat16,
            load_in_4bit=False,
            load_in_16bit=True,
            full_finetuning=False,
            device_map={"": dev.index},
            use_gradient_checkpointing=gc_mode,
            use_exact_model_name=True,
            fix_tokenizer=False,
            offload_embedding=False,
            tokenizer_name=str(_stub_tokenizer(Path(folder))),
            local_files_only=True,
            random_state=s.seed,
        )
    generic = os.environ.get("UNSLOTH_USE_NEW_MODEL") == "1"  # the loader ran FastModel, not the Llama family
    model_type = hf_model_type(hf_dir)
    targets = _all_linear(model) if model_type in ALL_LINEAR else list(TARGETS)
    model = FastLanguageModel.get_peft_model(
        model,
        r=s.lora_r,
        lora_alpha=s.lora_alpha,
        lora_dropout=0.0,
        bias="none",
        target_modules=targets,
        use_gradient_checkpointing=gc_mode,
        random_state=s.seed,
        use_rslora=False,
        max_seq_length=s.seq_len,
    )
    model = FastLanguageModel.for_training(model, use_gradient_checkpointing=gc_mode)
    versions = _versions()
    base = str(model.get_input_embeddings().weight.dtype).removeprefix("torch.")  # what Unsloth loaded
    result: dict[str, Any] = {
        "impl": (
            f"unsloth {versions['unsloth']} (unsloth_zoo {versions['unsloth_zoo']}): "
            f"{'FastModel' if generic else PATHS[model_type]}, {base} base, use_gradient_checkpointing={gc_mode!r}, "
            f"attention {_attention()}, no autocast"
        ),
        "unsloth_versions": versions,
        "gradient_checkpointing": gc_mode,
        "gradient_checkpointing_on": any(
            getattr(m, "gradient_checkpointing", False) is True for m in model.modules()
        ),
        "fused_lora": _fused_lora(model),
        "lora_targets": targets,
        "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF"),  # unsloth_zoo sets expandable segments on import
    }
    if flash_impl:
        import flash_attn.cute  # flash_attn is a namespace package here (no __file__): name its cute package
        from unsloth.utils.flash_impl import FLASH_IMPL_STATE, maybe_activate_flash_attention_impl

        result["flash_attn_4"] = f"{version('flash-attn-4')} ({Path(flash_attn.cute.__file__).parent})"
        os.environ[FLASH_IMPL_ENV] = flash_impl
        active = maybe_activate_flash_attention_impl(model)
        if not active:
            raise RuntimeError(
                f"Unsloth's {flash_impl} switch did not activate with flash-attn-4 {result['flash_attn_4']} "
                f"({FLASH_IMPL_STATE['reason']}): the row would time torch's own attention, which unsloth_lora "
                "measures"
            )
        result["flash_attention_impl"] = active
    if rule := gdn_rule(model.config, on_cuda=True):  # Unsloth runs fla's rule as one op
        result["gdn_rule"] = rule
    target_parameters = getattr(model.peft_config["default"], "target_parameters", None)
    if target_parameters:
        result["lora_target_parameters"] = list(target_parameters)
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.requires_grad})
    result["adapter_dtypes"] = dtypes
    vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    return causal_lm_step(result, model, vocab, s)
