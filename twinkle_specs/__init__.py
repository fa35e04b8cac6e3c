"""twinkle-specs: Hugging Face Qwen models in stock Megatron-LM (megatron-core ModuleSpecs, HF weights)."""


def _import_patches():
    """``twinkle_specs.patches`` is the top-level ``patches/`` folder (pyproject maps it). An install has it in
    place; a source checkout first on ``sys.path`` (``bench/run.py``, ``PYTHONPATH=$REPO``) does not, so it
    is loaded from ``$REPO/patches`` under the same name."""
    import importlib
    import importlib.util
    import sys
    from pathlib import Path

    try:
        return importlib.import_module(f"{__name__}.patches")
    except ModuleNotFoundError as err:
        folder = Path(__file__).resolve().parent.parent / "patches"
        if err.name != f"{__name__}.patches" or not (folder / "__init__.py").is_file():
            raise
        spec = importlib.util.spec_from_file_location(
            f"{__name__}.patches", folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        patches = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = patches
        spec.loader.exec_module(patches)
        return patches


patches = _import_patches()
patches.apply_all()

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
