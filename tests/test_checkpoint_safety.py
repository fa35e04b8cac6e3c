"""Exporting a crafted ``torch_dist`` checkpoint runs none of the code its pickles carry.

Each payload's ``__reduce__`` calls ``os.system("touch MARKER")`` when unpickled; the marker must not
exist after the export, and the export either refuses with an error naming the file or (for objects it
never needs to read) succeeds without reading them.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from twinkle_specs.cli import main as cli
from twinkle_specs.megatron_checkpoint import RELEASE, MegatronCheckpointError, export
from twinkle_specs.safe_load import UnsafeCheckpointError, read_metadata


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _copy(conversion: tuple[Path, Path], tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(conversion[1], ckpt)
    return ckpt


def _edit_metadata(ckpt: Path, edit) -> None:
    path = ckpt / RELEASE / ".metadata"
    with path.open("rb") as f:
        metadata = pickle.load(f)  # the test's own conversion
    edit(metadata)
    with path.open("wb") as f:
        pickle.dump(metadata, f)


def _exported_equals_source(hf: Path, out: Path) -> bool:
    ref, ours = load_file(hf / "model.safetensors"), {}
    for f in out.glob("*.safetensors"):
        ours |= load_file(f)
    return sorted(ref) == sorted(ours) and all(torch.equal(ref[k], ours[k]) for k in ref)


def test_metadata_payload_is_refused_and_never_runs(qwen3_conversion, tmp_path, megatron_single, capsys):
    hf, _ = qwen3_conversion
    ckpt, marker = _copy(qwen3_conversion, tmp_path), tmp_path / "pwned"
    _edit_metadata(ckpt, lambda m: setattr(m, "mcore_data", {"x": _Payload(marker)}))
    with pytest.raises(MegatronCheckpointError, match=r"\.metadata: refusing to unpickle (posix|os)\.system"):
        export(ckpt, hf, tmp_path / "out")
    assert cli(["export", "--load", str(ckpt), "--hf-model", str(hf), "--out", str(tmp_path / "o2")]) == 2
    assert "refusing to unpickle" in capsys.readouterr().err
    assert not marker.exists(), "the checkpoint's .metadata ran code"
    assert not (tmp_path / "out").exists() and not (tmp_path / "o2").exists()


def test_genuine_checkpoint_still_exports_bit_exact(qwen3_conversion, tmp_path, megatron_single):
    hf, ckpt = qwen3_conversion
    assert export(ckpt, hf, tmp_path / "out") == "full"
    assert _exported_equals_source(hf, tmp_path / "out")


def test_common_payload_is_refused_even_when_torch_is_told_to_unpickle_freely(
    qwen3_conversion, tmp_path, megatron_single, monkeypatch
):
    hf, _ = qwen3_conversion
    ckpt, marker = _copy(qwen3_conversion, tmp_path), tmp_path / "pwned"
    # megatron-core 0.19 keeps the common state inside the torch_dist files, and still reads a common.pt
    # that a checkpoint carries (its older format): plant one there.
    path = ckpt / RELEASE / "common.pt"
    common = torch.load(path, weights_only=True) if path.is_file() else {}
    torch.save(common | {"x": _Payload(marker)}, path)
    # Megatron's own torch.load of common.pt follows this variable; ours passes weights_only=True.
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(MegatronCheckpointError, match=r"common\.pt: refusing to load it"):
        export(ckpt, hf, tmp_path / "out")
    assert not marker.exists(), "the checkpoint's common.pt ran code"


def test_sharded_object_payload_is_never_read(qwen3_conversion, tmp_path, megatron_single):
    """torch reads a requested ShardedObject (a layer's _extra_state) with weights_only=False: point one
    at a payload appended to a data file; the export needs none of them, so it succeeds unharmed."""
    hf, _ = qwen3_conversion
    ckpt, marker = _copy(qwen3_conversion, tmp_path), tmp_path / "pwned"

    def edit(metadata):
        index, info = next((i, s) for i, s in metadata.storage_data.items() if "_extra_state" in i.fqn)
        data = ckpt / RELEASE / info.relative_path
        offset = data.stat().st_size
        with data.open("ab") as f:
            torch.save([_Payload(marker)], f)
        info.offset, info.length = offset, data.stat().st_size - offset

    _edit_metadata(ckpt, edit)
    assert export(ckpt, hf, tmp_path / "out") == "full"
    assert not marker.exists(), "a ShardedObject of the checkpoint ran code"
    assert _exported_equals_source(hf, tmp_path / "out")


@pytest.mark.parametrize("where", ["../elsewhere.distcp", "/etc/passwd", "sub/x.distcp", ".."])
def test_metadata_pointing_outside_the_checkpoint_is_refused(qwen3_conversion, tmp_path, where):
    ckpt = _copy(qwen3_conversion, tmp_path)

    def edit(metadata):
        next(iter(metadata.storage_data.values())).relative_path = where

    _edit_metadata(ckpt, edit)
    with pytest.raises(UnsafeCheckpointError, match=f"points at {where!r}, outside"):
        read_metadata(ckpt / RELEASE)


def test_garbled_metadata_is_a_clear_error(qwen3_conversion, tmp_path, megatron_single):
    hf, _ = qwen3_conversion
    ckpt = _copy(qwen3_conversion, tmp_path)
    meta = ckpt / RELEASE / ".metadata"
    meta.write_bytes(meta.read_bytes()[:500])
    with pytest.raises(MegatronCheckpointError, match=r"\.metadata: not a torch_dist metadata file"):
        export(ckpt, hf, tmp_path / "out")
    meta.write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(MegatronCheckpointError, match=r"\.metadata: holds a dict, not a torch_dist Metadata"):
        export(ckpt, hf, tmp_path / "out")


def test_adapter_checkpoint_loads_and_refuses_a_payload(qwen3_conversion, tmp_path, megatron_single):
    import twinkle_specs as ts
    from twinkle_specs.lora.checkpoint import load_adapter_checkpoint, save_adapter_checkpoint

    hf, _ = qwen3_conversion
    lora = ts.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    saved = ts.build_model(hf, lora=lora)
    with torch.no_grad():
        for p in saved.parameters():
            if p.requires_grad:
                p.normal_()
    save_adapter_checkpoint(saved, tmp_path / "adapters")
    loaded = ts.build_model(hf, lora=lora)
    load_adapter_checkpoint(loaded, tmp_path / "adapters")
    ours, theirs = dict(loaded.named_parameters()), dict(saved.named_parameters())
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)

    marker = tmp_path / "pwned"
    path = tmp_path / "adapters" / ".metadata"
    with path.open("rb") as f:
        metadata = pickle.load(f)
    metadata.mcore_data = {"x": _Payload(marker)}
    with path.open("wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(UnsafeCheckpointError, match=r"refusing to unpickle (posix|os)\.system"):
        load_adapter_checkpoint(loaded, tmp_path / "adapters")
    assert not marker.exists()


def test_metadata_replaced_after_the_check_is_never_read(
    qwen3_conversion, tmp_path, megatron_single, monkeypatch
):
    """Megatron unpickles .metadata itself after the check: it must get the checked bytes, not a file
    swapped for a payload in between."""
    from twinkle_specs import safe_load

    hf, _ = qwen3_conversion
    ckpt, marker = _copy(qwen3_conversion, tmp_path), tmp_path / "pwned"
    check, calls = safe_load._parse_metadata, []
    # The first check is export's look at the checkpoint, the last the load's; megatron-core 0.19 (no
    # common.pt) reads the common state from a checked copy in between.
    checks = 2 if (ckpt / RELEASE / "common.pt").is_file() else 3

    def check_then_swap(data, path):
        metadata = check(data, path)
        calls.append(path)
        if len(calls) < checks:
            return metadata
        with path.open("rb") as f:
            swapped = pickle.load(f)
        swapped.mcore_data = {"x": _Payload(marker)}
        with path.open("wb") as f:
            pickle.dump(swapped, f)
        return metadata

    monkeypatch.setattr(safe_load, "_parse_metadata", check_then_swap)
    assert export(ckpt, hf, tmp_path / "out") == "full"
    assert len(calls) == checks and not marker.exists(), "a .metadata swapped after the check ran code"
    assert _exported_equals_source(hf, tmp_path / "out")


def test_metadata_of_older_megatron_saves_is_read(qwen3_conversion, tmp_path):
    """megatron-core 0.15 saved its own Metadata subclass; megatron keeps an empty stand-in for it."""
    from megatron.core.dist_checkpointing.strategies.torch import MCoreMetadata

    ckpt = _copy(qwen3_conversion, tmp_path)
    path = ckpt / RELEASE / ".metadata"
    with path.open("rb") as f:
        metadata = pickle.load(f)
    old = MCoreMetadata()
    old.__dict__.update(vars(metadata), mcore_data={"k": {"nd_reformulated_orig_global_shape": (2, 3)}})
    with path.open("wb") as f:
        pickle.dump(old, f)
    read = read_metadata(ckpt / RELEASE)
    assert (
        isinstance(read, MCoreMetadata)
        and read.state_dict_metadata.keys() == metadata.state_dict_metadata.keys()
    )
