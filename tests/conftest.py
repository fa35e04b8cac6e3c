from __future__ import annotations

import fcntl
import itertools
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from models import make_checkpoint  # noqa: E402

cpu_reference = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="CPU reference test: build_model's model against transformers on CPU tensors; on a GPU machine "
    "build_model returns a CUDA (Transformer Engine) model, which the gpu-marked modules test",
)


def _built_once(root: Path, make: Callable[[str, Path], Path]) -> Callable[[str], Path]:
    """``kind -> checkpoint dir``, each made by ``make`` under ``root`` on first use."""
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = make(kind, root / kind)
        return made[kind]

    return get


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Builds each tiny HF checkpoint once per session, on first use."""
    return _built_once(tmp_path_factory.mktemp("hf"), make_checkpoint)


@pytest.fixture(scope="session")
def qwen3_conversion(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny Qwen3 and its TP1 release conversion, made once per test run: pytest-xdist's workers share
    it under a lock file in their common temporary root (``flock``, as gpu_checks.Evidence takes one; a
    conversion is a megatron-core process, ~10 s here). For reading: copy it before changing it."""
    from twinkle_specs.megatron_checkpoint import TRACKER, Layout, convert

    root = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        root = root.parent  # the run's root, above each worker's own
    hf, out = root / "shared-qwen3" / "hf", root / "shared-qwen3" / "mcore"
    with open(root / "shared-qwen3.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / TRACKER).is_file():
            if hf.parent.exists():  # a half-made one from a worker that died: start over
                shutil.rmtree(hf.parent)
            convert(make_checkpoint("qwen3", hf), out, Layout())
    return hf, out


@pytest.fixture(scope="session")
def lora_checkpoints(tmp_path_factory):
    """The LoRA tests' tiny checkpoints (test_lora_support's sizes), each built once per session."""
    from test_lora_support import make_checkpoint as make_lora_checkpoint  # it imports this module

    return _built_once(tmp_path_factory.mktemp("hf-lora"), make_lora_checkpoint)


def megatron_training_root() -> str | None:
    """Where ``megatron.training`` (Megatron-LM's parser, checkpointing, config-from-args) can be imported
    from: ``$MEGATRON_LM_ROOT`` (a stock checkout), else the site-packages of an installed megatron-core
    whose wheel ships it (0.19.x on Python 3.12, the second CI leg). None when neither has it."""
    root = os.environ.get("MEGATRON_LM_ROOT")
    if root:
        return root
    import importlib.util

    spec = importlib.util.find_spec("megatron.training")
    if spec is None or not spec.submodule_search_locations:
        return None
    return str(Path(next(iter(spec.submodule_search_locations))).parent.parent)


def megatron_training_version(root: str) -> tuple[int, int, int]:
    """megatron-core's release under ``root`` (``megatron/core/package_info.py``), e.g. (0, 19, 2)."""
    import re

    text = (Path(root) / "megatron" / "core" / "package_info.py").read_text()
    major, minor, patch = (
        int(re.search(rf"^{k} = (\d+)", text, re.M).group(1)) for k in ("MAJOR", "MINOR", "PATCH")
    )
    return major, minor, patch


_PORT_BLOCK = 1500
_ports = itertools.count()


def free_port() -> int:
    """A free port for a test's rendezvous that no concurrent test picks: below the kernel's ephemeral range
    (where ``bind(0)``, the gloo ranks' own sockets and outgoing connections take theirs, so a port found by
    ``bind(0)`` could be taken again before torchrun binds it), in a block of its own per pytest-xdist worker,
    each port once per run (until the block wraps), and checked free when picked. Above Ray's worker ports
    (10002-19999)."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    base = 20000 + _PORT_BLOCK * (worker % 8)
    for _ in range(_PORT_BLOCK):
        port = base + next(_ports) % _PORT_BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {base}-{base + _PORT_BLOCK - 1}")


def torchrun(nproc: int) -> list[str]:
    """The torchrun command for ``nproc`` local ranks on a free port (what follows is the program)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        "--master-addr=127.0.0.1",
    ]


def run_dist(
    nproc: int, script: Path, *args: str, timeout: int = 300, cpu_only: bool = False
) -> subprocess.CompletedProcess:
    """Runs ``script`` on ``nproc`` ranks with torchrun (one GPU each where there are GPUs and not
    ``cpu_only``, else gloo on CPU); raises with its output on failure."""
    cmd = [*torchrun(nproc), str(script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if cpu_only or not torch.cuda.is_available():
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return proc


def pytest_collection_modifyitems(config, items):
    """Tests marked ``one_leg`` (pyproject.toml says which and why) run on one leg of scripts/test.sh, which
    names its leg in TWINKLE_TEST_LEG: leg 0.16, or the leg the marker names (``one_leg("0.19")``). Where
    TWINKLE_TEST_LEG is unset (a plain pytest run) they run."""
    leg = os.environ.get("TWINKLE_TEST_LEG")
    if not leg:
        return
    for item in items:
        marker = item.get_closest_marker("one_leg")
        if marker is None:
            continue
        runs_on = marker.args[0] if marker.args else "0.16"
        if runs_on != leg:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"one_leg: scripts/test.sh runs it on leg {runs_on} only (this is leg {leg}; "
                    "pyproject.toml's one_leg marker says why)"
                )
            )


@pytest.fixture(scope="session", autouse=True)
def megatron_patches():
    """twinkle-specs' fixes to megatron-core, applied as a user applies them (``twinkle_specs.apply_patches``;
    importing the package applies none): many tests drive megatron-core modules on the CPU host directly,
    without ``build_model``, which applies them itself."""
    import twinkle_specs

    twinkle_specs.apply_patches()


@pytest.fixture
def megatron_single():
    """megatron's parallel state at world size 1 (gloo on CPU, NCCL on a GPU) for in-process tests;
    (re-)initialised when another module's fixture has torn it down."""
    from twinkle_specs.parity import _init_single_process

    _init_single_process()


@pytest.fixture(scope="module")
def gpu():
    """One GPU with Transformer Engine at TP=PP=1 for a module's in-process tests (torn down after it, so
    another module's layout does not leak in)."""
    import transformer_engine  # noqa: F401  (the modules that use this test the TE path)
    from megatron.core import parallel_state as ps

    from twinkle_specs.parity import _init_single_process

    if ps.model_parallel_is_initialized():  # another module's layout: start from TP=PP=1
        ps.destroy_model_parallel()
    _init_single_process()
    yield
    ps.destroy_model_parallel()
