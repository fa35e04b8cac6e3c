"""``twinkle-specs`` on bad input and a hostile environment: one clear line and exit code 2, never a
traceback or a hang (chatty or failing ``convert`` ranks, unwritable or full output directories)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time

import pytest

from twinkle_specs.cli import main as cli
from twinkle_specs.megatron_checkpoint import RELEASE, TRACKER, Layout, MegatronCheckpointError, convert

# Imported by every Python process started with this directory on PYTHONPATH: it makes a `convert` rank
# other than 0 misbehave at start-up, as $TWINKLE_TEST_RANK_MISCHIEF says.
SITECUSTOMIZE = """
import os, sys
if "TWINKLE_CONVERT_JOB" in os.environ and os.environ.get("RANK", "0") != "0":
    what = os.environ.get("TWINKLE_TEST_RANK_MISCHIEF")
    if what == "chatty":
        for _ in range(512):  # 512 KiB: eight times a pipe's buffer
            sys.stdout.write("x" * 1023 + "\\n")
        sys.stdout.flush()
    elif what == "exit":
        os._exit(3)
"""


@pytest.fixture
def rank_mischief(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))

    def set_mischief(what: str) -> None:
        monkeypatch.setenv("TWINKLE_TEST_RANK_MISCHIEF", what)

    return set_mischief


@pytest.mark.one_leg  # the convert job's rank supervision (pipes, a dying rank): twinkle-specs' own
def test_convert_rank_writing_more_than_a_pipe_holds_finishes(checkpoints, tmp_path, rank_mischief):
    """Rank 1 prints 512 KiB before it joins the group; reading rank 0's pipe first used to deadlock."""
    rank_mischief("chatty")
    t0 = time.monotonic()
    out = convert(checkpoints("qwen3"), tmp_path / "ckpt", Layout(tp=2), timeout=240)
    assert out == tmp_path / "ckpt" / RELEASE and (out / "metadata.json").is_file()
    assert (tmp_path / "ckpt" / TRACKER).read_text() == RELEASE
    assert time.monotonic() - t0 < 240


@pytest.mark.one_leg  # as above
def test_convert_rank_that_dies_stops_the_others(checkpoints, tmp_path, rank_mischief):
    """Rank 1 exits at start-up: rank 0 would wait for it in the rendezvous (gloo: 30 min); it is stopped
    and the failure named within seconds."""
    rank_mischief("exit")
    t0 = time.monotonic()
    with pytest.raises(MegatronCheckpointError, match=r"convert: rank 1 exited with 3"):
        convert(checkpoints("qwen3"), tmp_path / "ckpt", Layout(tp=2), timeout=240)
    assert time.monotonic() - t0 < 60


def test_output_below_a_file_is_one_line(checkpoints, tmp_path, capsys):
    """--save whose parent is a regular file (unwritable for root too): the path and errno, exit 2."""
    (tmp_path / "file").write_text("not a directory")
    save, hf = tmp_path / "file" / "ckpt", checkpoints("qwen3")
    capsys.readouterr()  # drop what building the checkpoint printed
    assert cli(["convert", "--hf-model", str(hf), "--save", str(save)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("twinkle-specs: error: ") and "\n" not in err, err
    assert str(tmp_path / "file") in err and "Not a directory (ENOTDIR)" in err, err


def _cli(*args: str, fsize: int | None = None) -> subprocess.CompletedProcess:
    def limit() -> None:
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))  # Python ignores SIGXFSZ: EFBIG

    return subprocess.run(
        [sys.executable, "-m", "twinkle_specs.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )


def _last_error_line(res: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in res.stderr, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("twinkle-specs: error: ")]
    assert len(lines) == 1, res.stderr
    return lines[0]


@pytest.mark.one_leg  # the export's own writes failing; reading the checkpoint: test_convert.py on both legs
def test_export_into_a_path_below_a_file(qwen3_conversion, tmp_path):
    hf, ckpt = qwen3_conversion
    (tmp_path / "file").write_text("not a directory")
    res = _cli("export", "--load", str(ckpt), "--hf-model", str(hf), "--out", str(tmp_path / "file" / "hf"))
    assert res.returncode == 2, res.stderr
    line = _last_error_line(res)
    assert str(tmp_path / "file") in line and "Not a directory (ENOTDIR)" in line, line


@pytest.mark.one_leg  # as above
def test_export_onto_a_full_disk(qwen3_conversion, tmp_path):
    """A file-size limit makes every write past 64 KiB fail as on a full disk (for root as well)."""
    hf, ckpt = qwen3_conversion
    out = tmp_path / "hf"
    res = _cli("export", "--load", str(ckpt), "--hf-model", str(hf), "--out", str(out), fsize=64 * 1024)
    assert res.returncode == 2, res.stderr
    line = _last_error_line(res)
    assert str(out) in line and "File too large" in line, line
