"""What a user installs: the wheel holds every module, the default configs, the launch scripts and the
license, and an installed copy (not editable, run outside the checkout) prints flags and passes the
parity job with nothing but its report on the screen."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from site import getsitepackages as sitepackages

import pytest
import tomllib

import twinkle_specs
from twinkle_specs.cli import launch_scripts
from twinkle_specs.cli import main as cli

ROOT = Path(__file__).resolve().parents[1]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
# What the wheel is built from (an sdist's worth): pyproject maps patches/ and launch/ into the package.
SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "twinkle_specs", "patches", "launch")
LAUNCH_SCRIPTS = {"slurm/train.sbatch", "ray/launch.py"}


def _files(folder: Path, pattern: str = "*") -> list[Path]:
    return [p for p in folder.rglob(pattern) if p.is_file() and "__pycache__" not in p.parts]


def test_version_is_the_distribution_version():
    assert twinkle_specs.__version__ == VERSION


def test_the_test_command_runs_both_ends_of_the_transformers_range():
    """scripts/test.sh installs the oldest transformers pyproject.toml allows on one leg and the newest minor
    release below its upper bound on the other, so widening the range without testing its new end fails here."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    deps = [
        Requirement(d)
        for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    ]
    spec = next(d.specifier for d in deps if d.name == "transformers")
    bounds = {s.operator: Version(s.version) for s in spec}
    script = (ROOT / "scripts" / "test.sh").read_text()
    ends = {k: Version(v) for k, v in re.findall(r"^TRANSFORMERS_(NEWEST|OLDEST)=(\S+)$", script, re.M)}
    assert set(bounds) == {">=", "<"} and set(ends) == {"NEWEST", "OLDEST"}, (spec, ends)
    assert ends["OLDEST"] == bounds[">="], (ends, spec)
    newest, upper = ends["NEWEST"], bounds["<"]
    assert newest in spec and (newest.major, newest.minor + 1) == (upper.major, upper.minor), (ends, spec)
    for end in ends:
        assert f'"transformers==$TRANSFORMERS_{end}"' in script, end


def test_launch_scripts_command_prints_and_copies_without_overwriting(tmp_path, capsys):
    assert set(launch_scripts()) == LAUNCH_SCRIPTS
    assert cli(["launch-scripts"]) == 0
    listed = dict(line.split("\t") for line in capsys.readouterr().out.splitlines())
    assert set(listed) == LAUNCH_SCRIPTS and all(Path(p).is_file() for p in listed.values())

    out = tmp_path / "scripts"
    assert cli(["launch-scripts", "--copy", str(out)]) == 0
    for name, path in launch_scripts().items():
        assert (out / name).read_bytes() == path.read_bytes()
    (out / "slurm" / "train.sbatch").write_text("edited")
    capsys.readouterr()
    assert cli(["launch-scripts", "--copy", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out / 'slurm' / 'train.sbatch'}" in err and "already there; pass --force to overwrite" in err
    assert (out / "slurm" / "train.sbatch").read_text() == "edited"
    assert cli(["launch-scripts", "--copy", str(out), "--force"]) == 0
    assert (out / "slurm" / "train.sbatch").read_bytes() == (ROOT / "launch/slurm/train.sbatch").read_bytes()


def _run(cmd: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONWARNINGS")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU host path, as in CI
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.one_leg  # what the wheel holds and where it runs from; the patches per version: test_source_checkout
@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    # No build isolation and no index: the build uses this environment's setuptools (the dev extra).
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w",
         str(tmp_path / "dist"), str(src)],
        cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("twinkle_specs-*.whl")
    assert wheel.name.startswith(f"twinkle_specs-{VERSION}-py3-none-any")

    expected = {
        f"twinkle_specs/{p.relative_to(ROOT / 'twinkle_specs')}" for p in _files(ROOT / "twinkle_specs")
    }
    expected |= {
        f"twinkle_specs/patches/{p.relative_to(ROOT / 'patches')}" for p in _files(ROOT / "patches", "*.py")
    }
    expected |= {f"twinkle_specs/launch_scripts/{name}" for name in LAUNCH_SCRIPTS}
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        info = f"twinkle_specs-{VERSION}.dist-info"
        assert whl.read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
    assert {n for n in names if not n.startswith(info)} == expected
    assert {"twinkle_specs/lora/spec.py", "twinkle_specs/defaults/qwen3-tiny/config.json"} <= names

    # A fresh venv that sees this environment's packages (torch, megatron-core, ...) through a .pth of its
    # site directories: --system-site-packages would see the base interpreter's instead, which inside a
    # venv (the CI's Python 3.12 leg) holds none of them. Directories named in a .pth are not scanned for
    # .pth files, so an editable install of this checkout there stays inactive.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    python, bin_dir = venv / "bin" / "python", venv / "bin"
    site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path
        ).stdout.strip()
    )
    (site / "parent_environment.pth").write_text("\n".join(sitepackages()) + "\n")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        cwd=tmp_path,
    )

    work = tmp_path / "elsewhere"
    work.mkdir()
    seen = _run([str(python), "-c", "import twinkle_specs as t; print(t.__file__, t.__version__)"], work)
    assert seen.stdout.split() == [str(site / "twinkle_specs" / "__init__.py"), VERSION]

    flags = _run(
        [
            str(bin_dir / "twinkle-specs"),
            "args",
            "--hf-model",
            str(site / "twinkle_specs/defaults/qwen3-tiny"),
        ],
        work,
    )
    assert "--spec twinkle_specs qwen_layer_spec" in flags.stdout and "--num-layers 4" in flags.stdout

    scripts = _run([str(bin_dir / "twinkle-specs"), "launch-scripts"], work)
    listed = dict(line.split("\t") for line in scripts.stdout.splitlines())
    assert listed == {name: str(site / "twinkle_specs" / "launch_scripts" / name) for name in LAUNCH_SCRIPTS}

    parity = _run([str(bin_dir / "twinkle-specs"), "parity"], work)
    assert re.search(r"^parity OK ", parity.stdout, re.M), parity.stdout
    assert "Warning" not in parity.stderr, f"the parity job printed warnings:\n{parity.stderr}"
