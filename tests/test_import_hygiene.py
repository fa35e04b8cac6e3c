"""Importing twinkle_specs changes nothing in megatron-core or Transformer Engine (the patches are applied
by ``twinkle_specs.apply_patches``, which the launcher and ``build_model`` call), and the package's
modules import each other without a cycle."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Run in a fresh interpreter: the test process has the patches applied (conftest).
PROBE = r"""
import importlib, inspect, json, pkgutil, sys, warnings

warnings.simplefilter("ignore")
# What the patches touch (patches/*.py's apply()), imported before twinkle_specs so it can be compared.
TARGETS = {
    "rope_on_host": ["megatron.core.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding.get_emb"],
    "router_on_host": ["megatron.core.transformer.moe.router:Router.gating"],
    "tied_embedding_on_host": [
        "megatron.core.models.common.language_module.language_module:"
        "LanguageModule.setup_embeddings_and_output_layer"
    ],
    "cuda_device_on_host": [
        "megatron.core.tensor_parallel.mappings:torch",
        "megatron.core.utils:torch",
        "megatron.core.dist_checkpointing.strategies.filesystem_async:torch",
        "megatron.core.dist_checkpointing.strategies.state_dict_saver:torch",
        "megatron.core.dist_checkpointing.strategies.async_utils:torch",
        "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding:torch",
    ],
    "grad_norm_on_device": [
        "megatron.core.optimizer.optimizer:get_grad_norm_fp32",
        "megatron.core.optimizer.optimizer:clip_grad_by_total_norm_fp32",
    ],
    "cross_entropy_without_sync": [
        "megatron.core.models.common.language_module.language_module:te_parallel_cross_entropy"
    ],
    "packed_seq_1d": ["megatron.core.utils:get_thd_batch_on_this_cp_rank"],
}
for target in [t for ts in TARGETS.values() for t in ts] + ["megatron.core.models.gpt:GPTModel"]:
    importlib.import_module(target.partition(":")[0])
try:
    import transformer_engine.pytorch  # noqa: F401
    have_te = True
except ImportError:
    have_te = False


def snapshot():
    # Every attribute of every loaded megatron / TE module, and of the classes they define, by identity.
    seen = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(("megatron", "transformer_engine")):
            continue
        for key, value in list(vars(module).items()):
            seen[f"{name}:{key}"] = id(value)
            if inspect.isclass(value) and value.__module__ == name:
                for attr, member in list(vars(value).items()):
                    seen[f"{name}:{key}.{attr}"] = id(member)
    return seen


def changed(before):
    after = snapshot()
    return sorted(k for k, v in before.items() if after.get(k, v) != v or k not in after)


before = snapshot()
import twinkle_specs
from twinkle_specs import qwen_layer_spec, LoraConfig  # noqa: F401  (the lazily imported API)

modules = [m.name for m in pkgutil.walk_packages(twinkle_specs.__path__, "twinkle_specs.")]
modules = [m for m in modules if have_te or m != "twinkle_specs.lora.te_layers"]  # TE's layers, subclassed
for name in modules:
    importlib.import_module(name)
on_import = changed(before)
applied = [n.rpartition(".")[2] for n in twinkle_specs.apply_patches()]
on_apply = changed(before)
print(json.dumps({"modules": modules, "on_import": on_import, "applied": applied, "on_apply": on_apply,
                  "targets": TARGETS}))
"""


def test_import_changes_nothing_and_apply_patches_changes_the_targets(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"twinkle_specs.lora.spec", "twinkle_specs.launch", "twinkle_specs.cli"} <= set(seen["modules"])
    assert seen["on_import"] == [], f"importing twinkle_specs changed {seen['on_import']}"
    assert seen["applied"], "no patch applies on this host: the test would show nothing"
    for name in seen["applied"]:
        missed = set(seen["targets"][name]) - set(seen["on_apply"])
        assert not missed, f"apply_patches() applied {name} but left {sorted(missed)} unchanged"
    expected = {t for name in seen["applied"] for t in seen["targets"][name]}
    assert set(seen["on_apply"]) == expected, (
        f"apply_patches() also changed {set(seen['on_apply']) - expected}"
    )


def test_apply_patches_by_name_applies_only_those_and_rejects_unknown_names(monkeypatch):
    import twinkle_specs
    from twinkle_specs import patches

    calls = []
    monkeypatch.setattr(patches, "_applied", set())
    for patch in patches.PATCHES:
        monkeypatch.setattr(patch, "is_needed", lambda: True)
        monkeypatch.setattr(patch, "apply", lambda p=patch: calls.append(patches.short_name(p)))
    monkeypatch.setenv(patches.OFF_ENV, "router_on_host")
    assert twinkle_specs.apply_patches(["rope_on_host", "router_on_host"]) == [
        "twinkle_specs.patches.rope_on_host"
    ]
    assert calls == ["rope_on_host"]  # router_on_host named, but switched off
    with pytest.raises(
        ValueError, match=r"apply_patches names unknown patches \['rope'\]; known: rope_on_host"
    ):
        twinkle_specs.apply_patches(["rope"])


def _imports(module: str, path: Path) -> set[str]:
    """The twinkle_specs modules that ``module`` imports, at module level or inside functions."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return found


def test_package_import_graph_is_acyclic():
    modules = {}
    for path in (ROOT / "twinkle_specs").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {m: sorted((_imports(m, p) & modules.keys()) - {m}) for m, p in modules.items()}
    assert graph["twinkle_specs.lora.norm"] == [
        "twinkle_specs.config_mapping",
        "twinkle_specs.lora.fp8_amax",
        "twinkle_specs.lora.functions",
        "twinkle_specs.te_extra_state",
    ]  # seen

    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for dep in graph[module]:
            assert state.get(dep) != 1, "import cycle: " + " -> ".join(path[path.index(dep) :] + [dep])
            if dep not in state:
                visit(dep)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
