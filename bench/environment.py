"""The host a benchmark ran on: library versions, GPUs, CPU affinity (pinning to the GPU's NUMA node),
selected environment variables and the measured code's provenance (bench/provenance.py)."""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from .provenance import commit_file_text, provenance

ROOT = Path(__file__).resolve().parents[1]
STAGED_COMMIT = Path(".gpu/bench-whl/COMMIT")  # in the tree, written by bench/stage.sh
ENV_VARS = (
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "NCCL_NVLS_ENABLE",
    "PYTORCH_CUDA_ALLOC_CONF",
    "OMP_NUM_THREADS",
    "TWINKLE_PATCHES_OFF",
    "TWINKLE_FP8_KERNEL_AMAX",
)


def versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {"python": platform.python_version()}
    names = ("torch", "megatron-core", "transformers", "peft", "safetensors", "twinkle-specs")
    # TE ships as a meta package plus core and torch-extension wheels; record whichever are installed
    names += (
        "transformer-engine",
        "transformer-engine-cu13",
        "transformer-engine-cu12",
        "transformer-engine-torch",
    )
    for dist in names:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    # the megatron-core that imports: a Megatron-LM checkout ahead on PYTHONPATH shadows the installed wheel
    out["megatron-core (imported)"] = _imported_megatron_core()
    return out


def _imported_megatron_core() -> str | None:
    """The version and folder of the megatron-core that ``import megatron.core`` finds, read from its
    package_info.py alone (importing megatron.core itself would import torch and more in this process)."""
    megatron = importlib.util.find_spec("megatron")
    for folder in (megatron.submodule_search_locations or []) if megatron else []:
        info = Path(folder) / "core" / "package_info.py"
        if info.is_file():
            spec = importlib.util.spec_from_file_location("_megatron_core_package_info", info)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            version = getattr(module, "__shortversion__", module.__version__)  # no "+<git hash of cwd>"
            return f"{version} from {Path(folder).parent}"
    return None


def code_provenance(out: Path, root: Path = ROOT) -> dict[str, str | None]:
    """The tree's commit and source hash (:func:`bench.provenance.provenance`), falling back on the
    staged COMMIT file, then on ``<out>/COMMIT``; the result is kept in ``<out>/COMMIT`` for later
    calls into the same ``--out``."""
    found = provenance(root, [root / STAGED_COMMIT, out / "COMMIT"])
    if found["git_commit"]:
        out.mkdir(parents=True, exist_ok=True)
        (out / "COMMIT").write_text(commit_file_text(found["git_commit"], found["source_sha256"]))
    return found


def environment(in_process: bool, out: Path) -> dict:
    import torch

    env: dict = {"hostname": platform.node(), "versions": versions(), "cuda": torch.version.cuda}
    env["env_vars"] = {k: os.environ.get(k) for k in ENV_VARS if os.environ.get(k) is not None}
    gpus: list[str] = []
    if shutil.which("nvidia-smi"):
        proc = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        )
        gpus = [g.strip() for g in proc.stdout.splitlines() if g.strip()]
    if not gpus and torch.cuda.is_available():
        if in_process:
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        else:  # ask a child, so that this process holds no CUDA context while the variants run
            code = "import torch; [print(torch.cuda.get_device_name(i)) for i in range(torch.cuda.device_count())]"
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            gpus = [g.strip() for g in proc.stdout.splitlines() if g.strip()] or ["unknown GPU"]
    env["device"] = gpus[0] if gpus else "cpu"
    env["gpu_count"] = len(gpus)
    if hasattr(os, "sched_getaffinity"):
        env["cpu_affinity"] = cpu_list(os.sched_getaffinity(0))
    return env | code_provenance(out)


def loaded_cudnn() -> dict | None:
    """The cuDNN libraries this process has mapped and, where Transformer Engine is imported, the version it
    reports. TE looks for cuDNN under ``CUDA_HOME`` and on the system's library path before the wheel that
    torch ships, so the attention a run measured may come from another cuDNN than torch's (the device
    machine's image has 9.14 in /usr/lib beside torch's 9.19). None where no cuDNN is loaded."""
    maps = Path("/proc/self/maps")
    lines = maps.read_text().splitlines() if maps.is_file() else []
    libraries = sorted({line.split()[-1] for line in lines if "/libcudnn" in line})
    te = sys.modules.get("transformer_engine_torch")
    version = te.get_cudnn_version() if hasattr(te, "get_cudnn_version") else None
    return {"te_version": version, "libraries": libraries} if libraries or version else None


def cpu_list(cpus: set[int]) -> str:
    """``{0, 1, 2, 5}`` as ``0-2,5``."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def parse_cpu_list(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            a, _, b = part.partition("-")
            cpus.update(range(int(a), int(b or a) + 1))
    return cpus


def pin_to_gpu_numa_node() -> str:
    """Restricts this process (and the variants' child processes, which inherit it) to the CPUs of the
    first GPU's NUMA node that it may run on, as NVIDIA's launch scripts do with numactl. A host-bound
    step (the MoE shape launches thousands of kernels) otherwise moves between sockets from run to run,
    and its launches cross the inter-socket link to reach the GPU. Returns what was done."""
    if not hasattr(os, "sched_setaffinity") or not shutil.which("nvidia-smi"):
        return "not pinned: no sched_setaffinity or nvidia-smi"
    proc = subprocess.run(
        ["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", "0"],
        capture_output=True,
        text=True,
    )
    bus = proc.stdout.strip().lower()
    if proc.returncode or not bus:
        return "not pinned: nvidia-smi gave no PCI bus id"
    domain, _, rest = bus.partition(":")
    local = Path(f"/sys/bus/pci/devices/{domain[-4:]}:{rest}/local_cpulist")
    if not local.exists():
        return f"not pinned: no {local}"
    allowed = os.sched_getaffinity(0)
    cpus = parse_cpu_list(local.read_text()) & allowed
    if not cpus or cpus == allowed:
        return f"not pinned: GPU-local CPUs {local.read_text().strip()}, allowed {cpu_list(allowed)}"
    os.sched_setaffinity(0, cpus)
    return f"pinned to {cpu_list(cpus)} (GPU 0 at {bus}; allowed were {cpu_list(allowed)})"
