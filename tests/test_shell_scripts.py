"""Every shell script the project ships or runs (the sbatch script, the set-up, test and GPU-machine scripts,
the benchmark's staging) is shellcheck-clean."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(
    p.relative_to(ROOT).as_posix()
    for pattern in ("launch/**/*.sbatch", "launch/**/*.sh", "scripts/**/*.sh", "bench/*.sh")
    for p in ROOT.glob(pattern)
)

pytestmark = pytest.mark.one_leg  # shellcheck alone: nothing of Python or megatron-core


def test_the_known_scripts_are_found():
    assert {"launch/slurm/train.sbatch", "scripts/test.sh", "scripts/gpu/lanes.sh"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_shellcheck_clean(script: str) -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (scripts/test.sh installs it: apt-get install shellcheck)")
    res = subprocess.run(["shellcheck", script], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stdout
