"""launch/slurm/train.sbatch on a real single-node Slurm (slurmctld + slurmd started here, CPU only).

Why: the sbatch script is what users submit, so the tests submit that very file to a real controller
and check that every rank gets a working torch.distributed + megatron-core parallel state, and that a
killed rank or a time-limit signal leads to a requeue that resumes from the saved checkpoint.
The input-validation tests run the script outside Slurm and need no cluster.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import free_port

# The launch script's own mechanics: run on one leg of scripts/test.sh (pyproject.toml's one_leg marker).
pytestmark = pytest.mark.one_leg

REPO = Path(__file__).resolve().parents[2]
SBATCH_SCRIPT = REPO / "launch" / "slurm" / "train.sbatch"
DIST_CHECK = Path(__file__).resolve().parent / "dist_check.py"
TORCHRUN = f"{sys.executable} -m torch.distributed.run"
# How long a job credential stays valid (Slurm's default 120 s), which is also how long a requeued job waits
# before it starts again. 5 s was too short on a loaded 2-core machine: srun reached slurmd 6.5 s after the
# requeued job's step credential was made, and slurmd refused it as expired.
CRED_EXPIRE_S = 15


def _plugin_exists(name: str) -> bool:
    pats = [
        f"/usr/lib/*/slurm-wlm/{name}.so",
        f"/usr/lib*/slurm*/{name}.so",
        f"/usr/local/lib/slurm/{name}.so",
    ]
    return any(glob.glob(p) for p in pats)


@dataclass
class Slurm:
    """A running test cluster: SLURM_CONF and a scratch dir shared by controller, node and jobs."""

    root: Path
    env: dict[str, str]

    def run(self, *cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, check=check, timeout=timeout)

    def submit(self, *sbatch_args: str, env: dict[str, str], program: list[str]) -> str:
        out = self.run("sbatch", "--parsable", *sbatch_args, str(SBATCH_SCRIPT), *program, timeout=30)
        return out.stdout.strip().split(";")[0]

    def job_info(self, job_id: str) -> dict[str, str]:
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait_done(self, job_id: str, timeout: float = 150) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job_info(job_id)
            if info.get("JobState") in {
                "COMPLETED",
                "FAILED",
                "CANCELLED",
                "TIMEOUT",
                "NODE_FAIL",
                "OUT_OF_MEMORY",
            }:
                return info
            time.sleep(0.5)
        self.run("scancel", job_id, check=False)
        raise AssertionError(f"job {job_id} did not finish in {timeout}s: {self.job_info(job_id)}")


def _start_munge(root: Path) -> str:
    """Fallback for Slurm builds without auth/none: a private munged with a generated key."""
    if shutil.which("munged") is None:
        pytest.skip("Slurm has no auth/none plugin and munged is not installed: cannot start slurm-wlm")
    d = root / "munge"
    d.mkdir(mode=0o700)
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = d / "munge.socket"
    subprocess.run(
        [
            "munged",
            "--force",
            f"--key-file={key}",
            f"--socket={sock}",
            f"--pid-file={d / 'munged.pid'}",
            f"--log-file={d / 'munged.log'}",
            f"--seed-file={d / 'munged.seed'}",
        ],
        check=True,
        timeout=20,
    )
    return str(sock)


def _write_conf(root: Path, auth_lines: list[str]) -> Path:
    ctld, slurmd = free_port(), free_port()
    conf = root / "slurm.conf"
    lines = [
        "ClusterName=twinkletest",
        "SlurmctldHost=localhost(127.0.0.1)",
        "SlurmUser=root",
        "SlurmdUser=root",
        *auth_lines,
        f"SlurmctldPort={ctld}",
        f"SlurmdPort={slurmd}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        # A requeued job waits cred_expire (CRED_EXPIRE_S here) before it may start; the scheduler runs every 2 s.
        "SchedulerParameters=sched_interval=2,bf_interval=1",
        "JobRequeue=1",
        "ReturnToService=2",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SlurmdParameters=config_overrides",
        "KillWait=5",
        "NodeName=localhost NodeAddr=127.0.0.1 CPUs=4 RealMemory=4000 State=UNKNOWN",
        "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
    ]
    conf.write_text("\n".join(lines) + "\n")
    return conf


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    """Start slurmctld + slurmd as root on loopback for this module; stop them and every job after."""
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"  # Debian puts the daemons in /usr/sbin
    tools = ("slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "srun")
    missing = [b for b in tools if not shutil.which(b, path=path)]
    if missing:
        pytest.skip(
            f"slurm-wlm is not installed ({', '.join(missing)} not found); scripts/setup.sh installs it"
        )
    if os.geteuid() != 0:
        pytest.skip("the Slurm tests start slurmctld/slurmd as root, and this process is not root")
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    munge_pid = root / "munge" / "munged.pid"
    if (
        _plugin_exists("auth_none")
        and _plugin_exists("cred_none")
        and os.environ.get("TWINKLE_SLURM_AUTH") != "munge"
    ):
        auth = ["AuthType=auth/none", "CredType=cred/none", f"AuthInfo=cred_expire={CRED_EXPIRE_S}"]
    else:
        sock = _start_munge(root)
        auth = [
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={sock},cred_expire={CRED_EXPIRE_S}",
        ]
    conf = _write_conf(root, auth)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env["SLURM_CONF"] = str(conf)
    env["PATH"] = path
    logs = [open(root / "slurmctld.stdout", "wb"), open(root / "slurmd.stdout", "wb")]  # noqa: SIM115
    daemons = [
        subprocess.Popen(
            ["slurmctld", "-D", "-c", "-f", str(conf)], env=env, stdout=logs[0], stderr=subprocess.STDOUT
        ),
        subprocess.Popen(
            ["slurmd", "-D", "-f", str(conf), "-N", "localhost"],
            env=env,
            stdout=logs[1],
            stderr=subprocess.STDOUT,
        ),
    ]
    cluster = Slurm(root, env)

    def stop() -> None:
        subprocess.run(["scancel", "--user=root"], env=env, capture_output=True, timeout=20, check=False)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and cluster.run("squeue", "-h", check=False).stdout.strip():
            time.sleep(0.5)
        for p in daemons:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in daemons:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        for f in logs:
            f.close()
        if munge_pid.exists():
            os.kill(int(munge_pid.read_text().strip()), signal.SIGTERM)

    deadline = time.monotonic() + 40
    state = ""
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in daemons):
            break
        state = cluster.run("sinfo", "-h", "-o", "%T", check=False, timeout=10).stdout.strip()
        if state == "idle":
            break
        time.sleep(0.5)
    if state != "idle":
        stop()
        tail = "".join(
            (root / f).read_text(errors="replace")[-1500:]
            for f in ("slurmctld.log", "slurmd.log", "slurmctld.stdout", "slurmd.stdout")
            if (root / f).exists()
        )
        pytest.skip(
            f"slurm-wlm is installed but slurmctld/slurmd could not be started (node {state!r}):\n{tail}"
        )
    try:
        yield cluster
    finally:
        stop()


def _job_env(cluster: Slurm, tmp: Path, **extra: str) -> dict[str, str]:
    env = dict(cluster.env)
    env.update(
        CKPT_DIR=str(tmp / "ckpt"),
        LOG_DIR=str(tmp / "logs"),
        GPUS_PER_NODE="0",
        TORCHRUN=TORCHRUN,
        ENTRY=sys.executable,
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def _submit(cluster: Slurm, tmp: Path, sbatch_args: list[str], program: list[str], **extra: str) -> str:
    env = _job_env(cluster, tmp, **extra)
    out = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"--chdir={tmp}",
            f"--output={tmp / 'job.out'}",
            *sbatch_args,
            str(SBATCH_SCRIPT),
            *program,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def _results(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(world)]


def _job_log(tmp: Path) -> str:
    return (tmp / "job.out").read_text(errors="replace") if (tmp / "job.out").exists() else "(no job.out)"


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_multi_task_job_initializes_distributed(slurm: Slurm, tmp_path: Path, launcher: str) -> None:
    """Two ranks per node through the user's sbatch script: env, gloo all-reduce, megatron parallel state."""
    out = tmp_path / "out"
    sbatch_args = ["--ntasks-per-node=2"] if launcher == "srun" else ["--cpus-per-task=2"]
    extra = {"LAUNCHER": launcher}
    if launcher == "torchrun":
        extra["NPROC_PER_NODE"] = "2"
    # First word ends in .py: the script prefixes it with $ENTRY, as it does for pretrain_gpt.py.
    job = _submit(slurm, tmp_path, sbatch_args, [str(DIST_CHECK), "--out", str(out), "--tp", "2"], **extra)
    info = slurm.wait_done(job)
    assert info["JobState"] == "COMPLETED", _job_log(tmp_path)
    res = _results(out, 2)
    port = 10000 + (int(job) % 5000) * 4
    for r, rec in enumerate(res):
        env = rec["env"]
        assert env["RANK"] == str(r) and env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == str(r)
        assert env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "localhost" and env["MASTER_PORT"] == str(port)
        assert env["SLURM_JOB_ID"] == job
        if launcher == "srun":
            assert env["SLURM_PROCID"] == str(r)
        assert rec["allreduce"] == rec["expected"] == 3.0
        assert rec["tp_size"] == 2 and rec["tp_rank"] == r and rec["tp_allreduce"] == 2.0
        assert rec["dp_size"] == 1 and rec["dp_allreduce"] == 1.0
    log = _job_log(tmp_path)
    assert f"{launcher}, 1 node(s) x 2 rank(s)" in log
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "1"  # --save got CKPT_DIR


def _wait_for(cond, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _tracker(tmp: Path) -> int:
    p = tmp / "ckpt" / "latest_checkpointed_iteration.txt"
    try:
        return int(p.read_text().strip())
    except (FileNotFoundError, ValueError):
        return 0


def test_killed_rank_requeues_and_resumes(slurm: Slurm, tmp_path: Path) -> None:
    """SIGKILL one rank mid-run: the step fails, the script requeues the job, the rerun resumes."""
    out = tmp_path / "out"
    prog = [sys.executable, str(DIST_CHECK), "--out", str(out), "--train-iters", "5", "--iter-seconds", "0.6"]
    job = _submit(slurm, tmp_path, ["--cpus-per-task=2"], prog, NPROC_PER_NODE="2", MAX_REQUEUES="1")
    _wait_for(lambda: _tracker(tmp_path) >= 2 and (out / "pid_rank_1").exists(), 90, "iteration 2")
    os.kill(int((out / "pid_rank_1").read_text()), signal.SIGKILL)
    killed_at = _tracker(tmp_path)
    info = slurm.wait_done(job)
    log = _job_log(tmp_path)
    assert info["JobState"] == "COMPLETED", log
    assert info["Restarts"] == "1", info
    assert "requeueing job" in log and "the job step failed" in log, log
    assert "resuming from" in log, log
    for rec in _results(out, 2):
        assert rec["env"]["SLURM_RESTART_COUNT"] == "1"
        assert rec["start_iteration"] >= killed_at >= 2  # continued from the checkpoint, not from 0
        assert rec["end_iteration"] == 5
    assert _tracker(tmp_path) == 5


def test_time_limit_signal_checkpoints_and_requeues(slurm: Slurm, tmp_path: Path) -> None:
    """USR1 to the batch shell (what --signal=B:USR1@300 sends) -> SIGTERM to ranks -> save -> requeue."""
    out = tmp_path / "out"
    prog = [
        sys.executable,
        str(DIST_CHECK),
        "--out",
        str(out),
        "--train-iters",
        "8",
        "--iter-seconds",
        "0.5",
        "--exit-signal-handler",
    ]
    job = _submit(slurm, tmp_path, ["--cpus-per-task=2"], prog, NPROC_PER_NODE="2", MAX_REQUEUES="1")
    _wait_for(lambda: _tracker(tmp_path) >= 2, 90, "iteration 2")
    slurm.run("scancel", "--signal=USR1", "--batch", job)
    info = slurm.wait_done(job)
    log = _job_log(tmp_path)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log
    assert "received SIGUSR1" in log and "time limit near" in log, log
    for rec in _results(out, 2):
        assert rec["env"]["SLURM_RESTART_COUNT"] == "1"
        assert 2 <= rec["start_iteration"] < 8 and rec["end_iteration"] == 8


def test_configuration_error_fails_without_requeue(slurm: Slurm, tmp_path: Path) -> None:
    """The launcher refuses the command (no --hf-model, exit code 2): the job fails once with that message
    instead of being requeued MAX_REQUEUES times as if a rank had crashed."""
    standin = REPO / "tests" / "standin" / "standin_pretrain_gpt.py"
    prog = [sys.executable, "-m", "twinkle_specs.launch", str(standin), "--lora-rank", "4"]
    job = _submit(slurm, tmp_path, ["--cpus-per-task=2"], prog, NPROC_PER_NODE="1", MAX_REQUEUES="3")
    info = slurm.wait_done(job, timeout=150)
    log = _job_log(tmp_path)
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", (info, log)
    assert "configuration error, not requeueing" in log and "--hf-model DIR is required" in log, log
    assert "requeueing job" not in log, log


def test_container_without_pyxis_is_refused(slurm: Slurm, tmp_path: Path) -> None:
    """CONTAINER_IMAGE on a cluster without pyxis: the job fails at once and says why."""
    job = _submit(
        slurm,
        tmp_path,
        [],
        [str(DIST_CHECK), "--out", str(tmp_path)],
        NPROC_PER_NODE="1",
        CONTAINER_IMAGE="nvcr.io#nvidia/pytorch:25.01-py3",
    )
    info = slurm.wait_done(job, timeout=60)
    assert info["JobState"] == "FAILED"
    assert "pyxis plugin is missing" in _job_log(tmp_path)


# ------------------------------------------------------------------ no cluster needed below


def _run_script(env_extra: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env.update(env_extra)
    return subprocess.run(
        ["bash", str(SBATCH_SCRIPT), *args], env=env, capture_output=True, text=True, timeout=30
    )


FAKE_JOB = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu[001-002]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_SUBMIT_DIR": "/tmp",
    "MASTER_ADDR": "gpu001",
    "DRY_RUN": "1",
}


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({}, "SLURM_JOB_ID is not set: submit this script with sbatch"),
        ({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1"}, "CKPT_DIR is not set"),
        ({**FAKE_JOB, "CKPT_DIR": "rel/dir"}, "CKPT_DIR=rel/dir is relative"),
        ({**FAKE_JOB, "CKPT_DIR": "/tmp/c"}, "GPUS_PER_NODE is not set and the job has no GPUs"),
        ({**FAKE_JOB, "CKPT_DIR": "/tmp/c", "GPUS_PER_NODE": "0"}, "NPROC_PER_NODE=0 must be a positive"),
        (
            {**FAKE_JOB, "CKPT_DIR": "/tmp/c", "GPUS_PER_NODE": "8", "NPROC_PER_NODE": "4"},
            "differs from GPUS",
        ),
        (
            {**FAKE_JOB, "CKPT_DIR": "/tmp/c", "GPUS_PER_NODE": "8", "LAUNCHER": "mpirun"},
            "LAUNCHER=mpirun is not",
        ),
        (
            {**FAKE_JOB, "CKPT_DIR": "/tmp/c", "SLURM_GPUS_ON_NODE": "8", "LAUNCHER": "srun"},
            "LAUNCHER=srun needs the tasks per node",
        ),
    ],
)
def test_bad_input_is_refused_with_a_clear_message(env: dict[str, str], needle: str, tmp_path: Path) -> None:
    env = {**env, "LOG_DIR": str(tmp_path / "logs")}
    if env.get("CKPT_DIR") == "/tmp/c":
        env["CKPT_DIR"] = str(tmp_path / "c")
    res = _run_script(env, "pretrain_gpt.py")
    assert res.returncode == 2, res
    assert needle in res.stderr, res.stderr


def test_unshared_checkpoint_dir_is_refused(tmp_path: Path) -> None:
    """The shared-dir check: a node that cannot see the marker file written on the batch node stops the job.

    One machine cannot have an unshared directory, so srun is replaced by a stub that answers as a second
    node would when it does not see the file (it prints its hostname).
    """
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text("#!/bin/sh\necho gpu002\n")
    (fake / "srun").chmod(0o755)
    env = {**FAKE_JOB, "CKPT_DIR": str(tmp_path / "c"), "GPUS_PER_NODE": "8", "LOG_DIR": str(tmp_path / "l")}
    env.update(DRY_RUN="0", PATH=f"{fake}:{os.environ['PATH']}")
    res = _run_script(env, "pretrain_gpt.py")
    assert res.returncode == 2, res
    assert f"CKPT_DIR={tmp_path / 'c'} is not shared: nodes [gpu002 ] cannot see a file" in res.stderr, (
        res.stderr
    )
    assert not list((tmp_path / "c").glob(".twinkle-shared-check*"))


def test_no_program_is_refused(tmp_path: Path) -> None:
    res = _run_script({**FAKE_JOB, "CKPT_DIR": str(tmp_path), "GPUS_PER_NODE": "8", "LOG_DIR": str(tmp_path)})
    assert res.returncode == 2 and "no program given" in res.stderr


def test_dry_run_multi_node_gpu_container_command(tmp_path: Path) -> None:
    """The srun line users get on a 2-node GPU cluster with pyxis: torchrun per node, flags, ckpt flags."""
    ckpt = tmp_path / "ckpt"
    env = {
        **FAKE_JOB,
        "CKPT_DIR": str(ckpt),
        "SLURM_GPUS_ON_NODE": "8",
        "LOG_DIR": str(tmp_path / "logs"),
        "CONTAINER_IMAGE": "nvcr.io#nvidia/pytorch:25.01-py3",
        "CONTAINER_MOUNTS": "/data:/data",
        "SLURM_CPUS_PER_TASK": "64",
    }
    res = _run_script(
        env, "/opt/Megatron-LM/pretrain_gpt.py", "--hf-model", "/m", "--tensor-model-parallel-size", "2"
    )
    assert res.returncode == 0, res.stderr
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("DRY_RUN:"))
    for part in [
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=64",
        "--kill-on-bad-exit=1",
        "--container-image=nvcr.io#nvidia/pytorch:25.01-py3",
        "/data:/data",
        "python -m twinkle_specs.launch /opt/Megatron-LM/pretrain_gpt.py --hf-model /m",
        f"--save {ckpt} --load {ckpt}",
    ]:
        assert part in line, (part, line)
    assert "torchrun, 2 node(s) x 8 rank(s), GPUs/node 8" in res.stdout
    assert "master gpu001:" in res.stdout


def test_dry_run_keeps_user_save_load_and_srun_mode(tmp_path: Path) -> None:
    env = {
        **FAKE_JOB,
        "CKPT_DIR": str(tmp_path / "c"),
        "SLURM_GPUS_PER_NODE": "h100:4",
        "LAUNCHER": "srun",
        "SLURM_NTASKS_PER_NODE": "4",
        "LOG_DIR": str(tmp_path / "logs"),
    }
    res = _run_script(env, "torchrun-free.sh", "--save", "/x", "--load=/y")
    assert res.returncode == 0, res.stderr
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("DRY_RUN:"))
    assert "--ntasks=8" in line and "--ntasks-per-node=4" in line and "RANK=$SLURM_PROCID" in line
    assert line.endswith("rank torchrun-free.sh --save /x --load=/y"), line
