"""twinkle-specs: Hugging Face Qwen models in stock Megatron-LM (megatron-core ModuleSpecs, HF weights).

Importing the package changes nothing in megatron-core or Transformer Engine; :func:`apply_patches`
applies the version-gated fixes in ``patches/`` (the launcher and :func:`build_model` call it).
"""

from __future__ import annotations

from collections.abc import Iterable


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


def _version() -> str:
    """The installed distribution's version; in a source checkout that is not installed, pyproject's."""
    from importlib.metadata import PackageNotFoundError, version
    from pathlib import Path

    try:
        return version("twinkle-specs")
    except PackageNotFoundError:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        try:
            import tomllib

            return tomllib.loads(pyproject.read_text())["project"]["version"]
        except (ImportError, OSError, KeyError):  # Python 3.10 has no tomllib; no pyproject.toml here
            return "0+unknown"


__version__ = _version()
patches = _import_patches()


def apply_patches(names: Iterable[str] | None = None) -> list[str]:
    """Applies the fixes to megatron-core (and TE) that twinkle-specs needs: all that this host and these
    versions need, or only ``names`` (e.g. ``["grad_norm_on_device"]``); those in
    ``$TWINKLE_PATCHES_OFF`` stay off. Idempotent; returns the patches in force. See patches/README.md."""
    return patches.apply_all(names)


# The public API by the module that defines it, imported on first use (PEP 562): importing the package
# imports no megatron-core, so the command line can set its warning filters first.
_EXPORTS = {
    "LoraConfig": "lora",
    "build_model": "model",
    "export_peft_adapter": "lora",
    "load_hf_weights": "loading",
    "load_peft_adapter": "lora",
    "megatron_args_from_hf": "config_mapping",
    "merge_lora": "lora",
    "qwen_layer_spec": "spec",
    "save_hf_weights": "export",
    "transformer_config_from_hf": "config_mapping",
    "unmerge_lora": "lora",
}
__all__ = ["__version__", "apply_patches", *_EXPORTS]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # megatron's --spec import reads the module's dict
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
