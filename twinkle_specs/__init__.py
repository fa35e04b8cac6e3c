"""twinkle-specs: Hugging Face Qwen models in stock Megatron-LM (megatron-core ModuleSpecs, HF weights)."""

from .patches import apply_all as _apply_patches

_apply_patches()

from .config_mapping import megatron_args_from_hf, transformer_config_from_hf  # noqa: E402
from .export import save_hf_weights  # noqa: E402
from .loading import load_hf_weights  # noqa: E402
from .lora import (  # noqa: E402
    LoraConfig,
    export_peft_adapter,
    load_peft_adapter,
    merge_lora,
    unmerge_lora,
)
from .model import build_model  # noqa: E402
from .spec import qwen_layer_spec  # noqa: E402

__all__ = [
    "LoraConfig",
    "build_model",
    "export_peft_adapter",
    "load_hf_weights",
    "load_peft_adapter",
    "megatron_args_from_hf",
    "merge_lora",
    "qwen_layer_spec",
    "save_hf_weights",
    "transformer_config_from_hf",
    "unmerge_lora",
]
