"""scripts/gpu/lanes.sh, the GPU machine's test runner, on this machine: lanes start together, a lane's
pytest arguments keep the shell's quoting, a lane its limit stops says rc 124, and everything comes back in
one archive under $OUT (a device call returns at most 8 files)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LANES = ROOT / "scripts" / "gpu" / "lanes.sh"

pytestmark = pytest.mark.one_leg


def test_lanes_run_side_by_side_and_come_back_in_one_archive(tmp_path):
    (tmp_path / "test_probe.py").write_text(
        "import os, pathlib, time\n"
        "def test_sees_its_lane():\n"
        "    env = os.environ\n"
        "    pathlib.Path(env['TWINKLE_EVIDENCE_DIR'], 'lane.txt').write_text("
        "env['CUDA_VISIBLE_DEVICES'] + ' ' + env['PYTEST_XDIST_WORKER'] + ' ' + env.get('PROBE', '-'))\n"
        "def test_a_or_b():\n    pass\n"
        "def test_slow():\n    time.sleep(60)\n"
    )
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    proc = subprocess.run(
        [
            "bash",
            str(LANES),
            "15",
            f'0|PROBE="set here" X=1 {tmp_path}/test_probe.py -m "" -k "sees or a_or_b"',
            f"1|{tmp_path}/test_probe.py -m '' -k 'sees or slow'",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any("test_sees_its_lane PASSED" in line for line in lines), proc.stdout
    assert any("test_a_or_b PASSED" in line for line in lines), proc.stdout
    assert "lane 1 (GPUs 0) rc 0" in lines and "lane 2 (GPUs 1) rc 124" in lines, proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["lanes.tgz"]
    with tarfile.open(out / "lanes.tgz") as archive:
        names = set(archive.getnames())
        seen = [archive.extractfile(f"lanes/ev/lane{n}/lane.txt").read().decode() for n in (1, 2)]
    assert {"lanes/logs/lane1.log", "lanes/logs/lane2.log"} <= names
    # each lane's GPUs, its own worker name and the environment its leading NAME=VALUE words set (quoted as
    # the shell quotes); each lane's evidence came back in its own folder (the same test wrote both)
    assert seen == ["0 gw1 set here", "1 gw2 -"]


def test_lanes_without_a_lane_say_how_to_call_them():
    proc = subprocess.run(["bash", str(LANES), "60"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "LIMIT_S" in proc.stderr
