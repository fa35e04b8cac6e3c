"""The safetensors reader refuses what would otherwise load silently: non-float weights, NaN/inf values,
tensors a shard holds but the index does not list, index entries naming the wrong shard or a file
outside the checkpoint directory."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import cpu_reference
from models import SAFE, make_checkpoint, rewrite_checkpoint
from safetensors.torch import load_file

import twinkle_specs as ts
from twinkle_specs.checkpoint import INDEX_NAME, NONFINITE_ENV, CheckpointError, CheckpointReader
from twinkle_specs.cli import main as cli

pytestmark = cpu_reference
UP = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    hf = make_checkpoint("qwen3", tmp_path_factory.mktemp("sharded") / "qwen3", max_shard_size="100KB")
    assert len(list(hf.glob("*.safetensors"))) > 2
    return hf


def _edit_index(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    index = json.loads((dst / INDEX_NAME).read_text())
    edit(index["weight_map"])
    (dst / INDEX_NAME).write_text(json.dumps(index))
    return dst


def _weight_map(hf: Path) -> dict[str, str]:
    return json.loads((hf / INDEX_NAME).read_text())["weight_map"]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool])
def test_non_float_weight_names_tensor_and_dtype(checkpoints, tmp_path, megatron_single, dtype):
    bad = rewrite_checkpoint(
        checkpoints("qwen3"), tmp_path / "bad", lambda t: t.update({UP: t[UP].to(dtype)})
    )
    st = {torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8", torch.bool: "BOOL"}[dtype]
    with pytest.raises(
        CheckpointError, match=rf"model.safetensors: tensor '{UP}' has dtype {st}; weights must"
    ):
        ts.build_model(bad)


def _poison(t: dict) -> None:
    w = t[UP].clone()
    w.view(-1)[[0, 7, 100]] = float("nan")
    w.view(-1)[[5, -1]] = float("inf")
    t[UP] = w


def test_nonfinite_weights_are_an_error_naming_tensor_and_count(checkpoints, tmp_path, megatron_single):
    bad = rewrite_checkpoint(checkpoints("qwen3"), tmp_path / "bad", _poison)
    numel = load_file(bad / SAFE)[UP].numel()
    with pytest.raises(
        CheckpointError,
        match=rf"model.safetensors: tensor '{UP}' holds 3 NaN and 2 inf value\(s\) of {numel}.*allow_nonfinite",
    ):
        ts.build_model(bad)


def test_nonfinite_weights_load_when_allowed(checkpoints, tmp_path, megatron_single, monkeypatch):
    bad = rewrite_checkpoint(checkpoints("qwen3"), tmp_path / "bad", _poison)
    model = ts.build_model(bad, load_weights=False)
    ts.load_hf_weights(model, bad, allow_nonfinite=True)
    fc1 = model.decoder.layers[0].mlp.linear_fc1.weight  # [gate; up]: up is the second half
    up = fc1[fc1.shape[0] // 2 :]
    assert int(up.isnan().sum()) == 3 and int(up.isinf().sum()) == 2
    monkeypatch.setenv(NONFINITE_ENV, "1")  # the launcher's switch
    ts.load_hf_weights(ts.build_model(bad, load_weights=False), bad)
    monkeypatch.setenv(NONFINITE_ENV, "0")
    with pytest.raises(CheckpointError, match="3 NaN and 2 inf"):
        ts.load_hf_weights(ts.build_model(bad, load_weights=False), bad)


@pytest.mark.one_leg  # the HF reader's check and the CLI flag; the conversion itself: test_convert.py
def test_convert_refuses_nonfinite_weights_unless_told(checkpoints, tmp_path, capsys):
    bad = rewrite_checkpoint(checkpoints("qwen3"), tmp_path / "bad", _poison)
    assert cli(["convert", "--hf-model", str(bad), "--save", str(tmp_path / "refused")]) == 2
    assert f"'{UP}' holds 3 NaN and 2 inf" in capsys.readouterr().err
    env = os.environ.get(NONFINITE_ENV)
    try:
        args = [
            "convert",
            "--hf-model",
            str(bad),
            "--save",
            str(tmp_path / "ok"),
            "--allow-nonfinite-weights",
        ]
        assert cli(args) == 0
    finally:
        os.environ.pop(NONFINITE_ENV, None) if env is None else os.environ.update({NONFINITE_ENV: env})
    assert (tmp_path / "ok" / "release" / ".metadata").is_file()


def test_tensor_missing_from_the_index_names_tensor_and_shard(sharded, tmp_path):
    name, shard = sorted(_weight_map(sharded).items())[3]
    bad = _edit_index(sharded, tmp_path / "bad", lambda m: m.pop(name))
    with pytest.raises(
        CheckpointError, match=rf"{shard} holds tensor\(s\) \['{name}'\] that {INDEX_NAME} does not"
    ):
        CheckpointReader(bad)


def test_index_naming_the_wrong_shard_names_tensor_and_both_files(sharded, tmp_path):
    wm = _weight_map(sharded)
    name, right = sorted(wm.items())[3]
    wrong = next(s for s in sorted(set(wm.values())) if s != right)
    bad = _edit_index(sharded, tmp_path / "bad", lambda m: m.update({name: wrong}))
    with pytest.raises(
        CheckpointError,
        match=rf"maps tensor '{name}' to {wrong}, which does not hold it \(it is in {right}\)",
    ):
        CheckpointReader(bad)


@pytest.mark.parametrize("where", ["outside", "absolute", "symlink"])
def test_index_pointing_outside_the_checkpoint_is_refused(sharded, tmp_path, where):
    name, shard = sorted(_weight_map(sharded).items())[0]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(sharded / shard, elsewhere / shard)
    if where == "symlink":
        bad = _edit_index(sharded, tmp_path / "bad", lambda m: None)
        (bad / shard).unlink()
        (bad / shard).symlink_to(elsewhere / shard)
        match = rf"a link to {elsewhere / shard}, outside"
    else:
        target = f"../elsewhere/{shard}" if where == "outside" else str(elsewhere / shard)
        bad = _edit_index(
            sharded, tmp_path / "bad", lambda m: m.update({k: target for k, v in m.items() if v == shard})
        )
        match = rf"maps tensor '.*' to '{target}', outside"
    with pytest.raises(CheckpointError, match=match):
        CheckpointReader(bad)


def test_hub_cache_symlinks_load(sharded, tmp_path, megatron_single):
    """The Hugging Face hub cache links ``snapshots/REV/*`` to ``../../blobs/SHA``: allowed."""
    repo = tmp_path / "models--tiny"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(sharded.iterdir())):
        shutil.copy(f, blobs / f"blob{i}")
        (snap / f.name).symlink_to(Path("../../blobs") / f"blob{i}")
    report = ts.load_hf_weights(ts.build_model(snap, load_weights=False), snap)
    assert report.parameters > 0


@pytest.mark.parametrize(
    "text", ["{not json", "[1, 2]", '{"metadata": {}}', '{"weight_map": ["a"]}', '{"weight_map": {"a": 3}}']
)
def test_malformed_index_names_the_index(sharded, tmp_path, text):
    bad = tmp_path / "bad"
    shutil.copytree(sharded, bad)
    (bad / INDEX_NAME).write_text(text)
    with pytest.raises(CheckpointError, match=rf"{bad / INDEX_NAME}"):
        CheckpointReader(bad)


def test_single_file_beside_an_index_is_ambiguous(sharded, checkpoints, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(sharded, bad)
    shutil.copy(checkpoints("qwen3") / SAFE, bad / SAFE)
    with pytest.raises(CheckpointError, match=rf"holds both {SAFE} and {INDEX_NAME}.*remove the stale one"):
        CheckpointReader(bad)
