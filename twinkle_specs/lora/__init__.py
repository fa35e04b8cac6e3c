"""LoRA for twinkle-specs' Qwen layers, interchangeable with Hugging Face PEFT (see docs/lora.md)."""

from .config import LoraConfig
from .model import adapter_parameters, merge_lora, prepare_lora_model, unmerge_lora
from .peft_io import export_peft_adapter, load_peft_adapter

__all__ = [
    "LoraConfig",
    "adapter_parameters",
    "export_peft_adapter",
    "load_peft_adapter",
    "merge_lora",
    "prepare_lora_model",
    "unmerge_lora",
]
