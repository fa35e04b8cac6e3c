"""Every writer puts its output on disk without destroying data (``twinkle_specs.output_dir``).

``twinkle-specs export`` / ``convert``, ``save_hf_weights``, ``export_peft_adapter`` and the launcher's
``--hf-export``: a target that is, contains or lies inside a source is refused before anything is
written; a non-empty target is refused unless told to overwrite; the output is staged beside the
target and renamed into place, so a SIGKILL mid-write leaves nothing or the old content and an
overwrite leaves no stale file; files get the modes the umask gives.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_launch import COMMON, launch

import twinkle_specs as ts
from twinkle_specs.cli import main as cli
from twinkle_specs.launch import LaunchError, check_hf_export
from twinkle_specs.megatron_checkpoint import TRACKER, Layout, MegatronCheckpointError, convert
from twinkle_specs.output_dir import OutputDirError

WORKER = Path(__file__).with_name("output_writer_worker.py")
LORA = dict(r=4, lora_alpha=8, target_modules=("all-linear",))


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``root``: relative path -> (sha256, mode)."""
    return {
        str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mode & 0o777)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def error_line(capsys) -> str:
    """The CLI's error: exactly one line."""
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture
def hf_copy(checkpoints, tmp_path) -> Path:
    return Path(shutil.copytree(checkpoints("qwen3"), tmp_path / "hf"))


# ------------------------------------------------------------------------------------ data loss rows


@pytest.mark.parametrize(
    "out, relation",
    [
        ("hf", "is --hf-model"),
        ("hf/export", "is inside --hf-model"),
        (".", "contains --hf-model"),
        ("load", "is --load"),
        ("load/export", "is inside --load"),
    ],
)
def test_export_force_refuses_an_out_overlapping_a_source(
    out, relation, qwen3_conversion, hf_copy, tmp_path, capsys
):
    load = Path(shutil.copytree(qwen3_conversion[1], tmp_path / "load"))
    before = snapshot(tmp_path)
    argv = [
        "export",
        "--load",
        str(load),
        "--hf-model",
        str(hf_copy),
        "--out",
        str(tmp_path / out),
        "--force",
    ]
    assert cli(argv) == 2
    err = error_line(capsys)
    assert err.startswith(f"twinkle-specs: error: --out {tmp_path / out}: {relation} "), err
    assert snapshot(tmp_path) == before


@pytest.mark.one_leg  # the staging directory and the HF reader's refusal, twinkle-specs' own
def test_convert_force_keeps_the_previous_conversion_when_the_new_source_is_bad(
    qwen3_conversion, hf_copy, tmp_path
):
    save = Path(shutil.copytree(qwen3_conversion[1], tmp_path / "save"))
    before = snapshot(save)
    weights = hf_copy / "model.safetensors"
    tensors = load_file(weights)
    missing = "model.layers.1.mlp.down_proj.weight"
    del tensors[missing]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(MegatronCheckpointError, match=missing.replace(".", r"\.")):
        convert(hf_copy, save, Layout(), force=True)
    assert snapshot(save) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "save"]  # no staging directory left


def test_convert_force_refuses_a_training_run_directory(checkpoints, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "iter_0000005").mkdir(parents=True)
    (run / "iter_0000005" / "metadata.json").write_text("{}")
    (run / TRACKER).write_text("5")
    before = snapshot(run)
    argv = ["convert", "--hf-model", str(checkpoints("qwen3")), "--save", str(run), "--force"]
    assert cli(argv) == 2
    err = error_line(capsys)
    assert err.startswith(f"twinkle-specs: error: --save {run}: is a training run's checkpoint directory"), (
        err
    )
    assert "iteration '5'" in err and "new --save" in err
    assert snapshot(run) == before


@pytest.mark.parametrize("out", ["hf", "hf/export", "."])
def test_save_hf_weights_refuses_its_own_source(out, hf_copy, tmp_path, megatron_single):
    model = ts.build_model(hf_copy)
    before = snapshot(tmp_path)
    with pytest.raises(OutputDirError, match="source checkpoint"):
        ts.save_hf_weights(model, tmp_path / out, overwrite=True)
    assert snapshot(tmp_path) == before


# -------------------------------------------------------------------------------------- output rows


def _write(kind: str, hf: Path, out: Path, **kwargs) -> None:
    if kind == "hf":
        ts.save_hf_weights(ts.build_model(hf), out, **kwargs)
    else:
        ts.export_peft_adapter(ts.build_model(hf, lora=ts.LoraConfig(**LORA)), out, **kwargs)


@pytest.mark.parametrize("kind", ["hf", "peft"])
def test_writers_refuse_a_non_empty_directory(kind, checkpoints, tmp_path, megatron_single):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(
        OutputDirError, match=r"out_dir .*out: directory is not empty \(notes.txt\).*overwrite=True"
    ):
        _write(kind, checkpoints("qwen3"), out)
    with pytest.raises(OutputDirError, match="holds notes.txt, which no earlier output of this kind writes"):
        _write(kind, checkpoints("qwen3"), out, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # nothing staged beside it


def test_overwrite_leaves_no_stale_shards(checkpoints, tmp_path, megatron_single):
    hf = checkpoints("qwen3")
    model = ts.build_model(hf)
    ts.save_hf_weights(model, tmp_path / "out", max_shard_bytes=100_000)
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) > 2
    ts.save_hf_weights(model, tmp_path / "out", overwrite=True)
    ts.save_hf_weights(model, tmp_path / "fresh")
    assert snapshot(tmp_path / "out") == snapshot(tmp_path / "fresh")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "out"]


def test_export_force_replaces_an_earlier_full_export_with_an_adapter(checkpoints, tmp_path, megatron_single):
    from test_convert import LORA_ARGS, _lora_checkpoint

    hf = checkpoints("qwen3")
    ckpt, _ = _lora_checkpoint(hf, tmp_path, LORA_ARGS)
    out = tmp_path / "out"
    assert cli(["export", "--load", str(ckpt), "--hf-model", str(hf), "--out", str(out), "--merged"]) == 0
    assert (out / "generation_config.json").is_file()
    assert cli(["export", "--load", str(ckpt), "--hf-model", str(hf), "--out", str(out)]) == 2
    assert cli(["export", "--load", str(ckpt), "--hf-model", str(hf), "--out", str(out), "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def test_outputs_get_the_umask_modes(checkpoints, tmp_path, megatron_single, umask_027):
    """Shards were 0600 (safetensors renames a 0600 temporary file into place) beside 0644 configs."""
    hf = checkpoints("qwen3")
    _write("hf", hf, tmp_path / "hf-out", max_shard_bytes=100_000)
    _write("peft", hf, tmp_path / "peft-out")
    convert(hf, tmp_path / "mcore", Layout())
    for out in ("hf-out", "peft-out", "mcore"):
        files = snapshot(tmp_path / out)
        assert any(name.endswith((".safetensors", ".distcp")) for name in files), files
        assert {name: mode for name, (_, mode) in files.items() if mode != 0o640} == {}, out
        dirs = [tmp_path / out, *(p for p in (tmp_path / out).rglob("*") if p.is_dir())]
        assert {
            str(d): oct(d.stat().st_mode & 0o777) for d in dirs if d.stat().st_mode & 0o777 != 0o750
        } == {}


@pytest.mark.one_leg  # the exports' staging directory and rename, twinkle-specs' own writer
@pytest.mark.parametrize("kind, overwrite", [("hf", False), ("hf", True), ("peft", True)])
def test_sigkill_mid_write_leaves_nothing_or_the_old_content(
    kind, overwrite, checkpoints, tmp_path, megatron_single
):
    hf, out, marker = checkpoints("qwen3"), tmp_path / "out", tmp_path / "first-file-written"
    if overwrite:
        _write(kind, hf, out)
    before = snapshot(out) if overwrite else None
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(WORKER), kind, str(hf), str(out), str(int(overwrite)), str(marker)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), f"the writer never wrote a file: {proc.poll()}"
        written = Path(marker.read_text())
        # The first file went to a staging directory beside the target, not into the target.
        assert written.parent.parent == tmp_path and written.parent.name.startswith(".out.incomplete-")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    if overwrite:
        assert snapshot(out) == before
    else:
        assert not out.exists()


# ------------------------------------------------------------------------------------------ launcher


def test_hf_export_targets_are_checked_before_training(checkpoints, tmp_path):
    hf = str(checkpoints("qwen3"))
    base = ["--hf-model", hf, "--save", str(tmp_path / "ck"), "--save-interval", "5"]
    used = tmp_path / "used"
    used.mkdir()
    (used / "model.safetensors").write_text("an earlier export")
    with pytest.raises(
        LaunchError, match=r"--hf-export .*used: directory is not empty.*--hf-export-overwrite"
    ):
        check_hf_export([*base, "--hf-export", str(used)])
    check_hf_export([*base, "--hf-export", str(used), "--hf-export-overwrite"])
    with pytest.raises(LaunchError, match=r"--hf-export .*ck: is --save"):
        check_hf_export([*base, "--hf-export", str(tmp_path / "ck"), "--hf-export-overwrite"])
    with pytest.raises(LaunchError, match=r"--hf-export .*: is inside --hf-model"):
        check_hf_export([*base, "--hf-export", f"{hf}/out"])
    with pytest.raises(LaunchError, match="--hf-export-on-save exports every --save checkpoint: pass --save"):
        check_hf_export(["--hf-model", hf, "--hf-export", str(tmp_path / "e"), "--hf-export-on-save"])
    # The on-save root is a directory of iter_N exports that a resumed run adds to.
    (tmp_path / "e" / "iter_0000005").mkdir(parents=True)
    check_hf_export([*base, "--hf-export", str(tmp_path / "e"), "--hf-export-on-save"])


def test_launch_refuses_a_non_empty_hf_export_before_training(checkpoints, tmp_path):
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    proc = launch(
        "--hf-model", str(checkpoints("qwen3")), *COMMON, "--train-iters", "1",
        "--save", str(tmp_path / "ck"), "--save-interval", "1", "--hf-export", str(used),
    )  # fmt: skip
    assert proc.returncode != 0
    assert f"--hf-export {used}: directory is not empty (notes.txt)" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "ck").exists()  # refused before training started
    assert (used / "notes.txt").read_text() == "mine"


def test_launch_exports_every_save_into_its_own_directory(checkpoints, tmp_path):
    """--hf-export-on-save: ROOT/iter_N per save, complete HF checkpoints; a second run (a resume)
    replaces the iterations it saves again."""
    args = [
        "--hf-model", str(checkpoints("qwen3")), *COMMON, "--train-iters", "2", "--lr", "0.05",
        "--save", str(tmp_path / "ck"), "--save-interval", "1",
        "--hf-export", str(tmp_path / "exp"), "--hf-export-on-save",
    ]  # fmt: skip
    for _ in range(2):
        proc = launch(*args)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        assert f"the final export is {tmp_path / 'exp' / 'iter_0000002'}" in proc.stdout
        assert sorted(p.name for p in (tmp_path / "exp").iterdir()) == ["iter_0000001", "iter_0000002"]
    fresh = tmp_path / "exp" / "iter_0000002"
    assert (fresh / "config.json").is_file() and (fresh / "model.safetensors.index.json").is_file()
    assert torch.load(tmp_path / "ck" / "run.pt")["trainable"] > 0
