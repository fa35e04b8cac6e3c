"""twinkle-specs: Hugging Face Qwen models in stock Megatron-LM (megatron-core ModuleSpecs, HF weights)."""

from .patches import apply_all as _apply_patches

_apply_patches()

from .config_mapping import megatron_args_from_hf, transformer_config_from_hf  # noqa: E402
from .loading import load_hf_weights  # noqa: E402
from .model import build_model  # noqa: E402
from .spec import qwen_layer_spec  # noqa: E402

__all__ = [
    "build_model",
    "load_hf_weights",
    "megatron_args_from_hf",
    "qwen_layer_spec",
    "transformer_config_from_hf",
]
