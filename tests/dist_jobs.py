"""Several multi-rank jobs in one torchrun launch (no tests here).

Why: starting torchrun and its ranks (each imports torch, megatron-core and transformers) costs the 2-core
CI machine about 10 s, more than most layouts' own work. So a test module declares its multi-rank jobs
(one per layout) on a module-scoped ``DistJobs``, and the first test that needs a job's outputs launches
every pending job of that world size that this pytest run selected, in one torchrun; each test then
asserts on its own job's outputs, as it did on a launch of its own.

Worker side (``run_jobs``): the ranks run the jobs one after another in one process group. Each job
starts from the torch RNG state the first one started from (a fresh worker's, which torch seeds at
random), with megatron's CUDA RNG tracker emptied on a GPU (build_model seeds it for the job's layout),
so it computes what it would in a launch of its own; the job itself
initialises megatron's parallel state for its layout and destroys it at its end. After each job the
ranks meet and rank 0 marks it done. A job that raises writes its traceback into its directory and ends
the process (torchrun then stops the other ranks).

Test side (``DistJobs``): a job left without its done mark failed, or made no progress within the
timeout a launch of its own had; its test fails with the launch's output, and the jobs after it run in a
fresh launch, so one failing layout does not hide the others.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DONE = "job-done"


def run_jobs(run_one: Callable[[list[str]], None], argv: list[str]) -> None:
    """A torchrun worker's job loop, inside its initialised process group: ``run_one(job_argv)`` runs
    one job. Without ``--jobs FILE`` the command line is that one job (a launch by hand)."""
    import torch
    import torch.distributed as dist

    if "--jobs" not in argv:
        run_one(argv)
        return
    jobs = json.loads(Path(argv[argv.index("--jobs") + 1]).read_text())
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    rank = dist.get_rank()
    for job in jobs:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

            torch.cuda.set_rng_state_all(cuda_rng)
            get_cuda_rng_tracker().reset()  # build_model seeds it for this job's layout
        try:
            run_one(job["argv"])
        except BaseException:
            Path(job["dir"], f"error-rank{rank}.txt").write_text(traceback.format_exc())
            raise
        dist.barrier()
        if rank == 0:
            Path(job["dir"], DONE).write_text("")


@dataclass
class _Job:
    nproc: int
    prepare: Callable[[Path], list[str]]
    test: str
    dir: Path
    state: str = "pending"  # "done" or "failed" once launched
    error: str = ""


class DistJobs:
    """A test module's multi-rank jobs on ``script`` (whose main hands its job to ``run_jobs``), each
    launched with the others of its world size that this run selected, on first use of its outputs.

    ``cpu_only`` hides the GPUs (gloo ranks) as ``run_dist`` does; ``timeout`` is what one job may take
    (the first of a launch with the start-up)."""

    def __init__(
        self, script: Path, root: Path, request, *, timeout: int = 300, cpu_only: bool = False
    ) -> None:
        self.script, self.root, self.timeout, self.cpu_only = script, root, timeout, cpu_only
        self.jobs: dict[str, _Job] = {}
        self.launches = 0
        items = [i for i in request.session.items if getattr(i, "module", None) is request.module]
        self.selected = {n for i in items for n in (i.name, getattr(i, "originalname", i.name))}

    def add(self, name: str, nproc: int, prepare: Callable[[Path], list[str]], *, test: str) -> None:
        """Job ``name`` on ``nproc`` ranks: ``prepare(dir)`` makes its inputs (here, just before its
        launch) and returns the worker's arguments, its outputs going to ``dir``. ``test`` (``test_x`` or
        ``test_x[id]``) is the test that reads it: the job joins its launch when that test was selected."""
        assert name not in self.jobs, f"two jobs named {name}"
        self.jobs[name] = _Job(nproc, prepare, test, self.root / name)

    def out(self, name: str) -> Path:
        """Job ``name``'s output directory, once it ran (raises AssertionError with its output if not)."""
        job = self.jobs[name]
        if job.state == "pending":
            self._launch(
                [
                    n
                    for n, j in self.jobs.items()
                    if j.state == "pending" and j.nproc == job.nproc and (j.test in self.selected or j is job)
                ]
            )
        if job.state == "failed":
            raise AssertionError(f"job {name}: {job.error}")
        return job.dir

    def _launch(self, names: list[str]) -> None:
        from conftest import torchrun

        nproc = self.jobs[names[0]].nproc
        specs = []
        for n in names:
            job = self.jobs[n]
            job.dir.mkdir(parents=True)
            specs.append({"dir": str(job.dir), "argv": job.prepare(job.dir)})
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        if self.cpu_only or not _cuda():
            env["CUDA_VISIBLE_DEVICES"] = ""
        while names:
            self.launches += 1
            spec, log = self.root / f"launch-{self.launches}.json", self.root / f"launch-{self.launches}.log"
            spec.write_text(json.dumps(specs))
            cmd = [*torchrun(nproc), str(self.script), "--jobs", str(spec)]
            done, why = self._run(cmd, env, log, [self.jobs[n] for n in names])
            for n in names[:done]:
                self.jobs[n].state = "done"
            if done == len(names) and not why:
                return
            why = why or "the launch ended before this job was done"
            failed = names[min(done, len(names) - 1)]
            errors = "".join(
                f"\n{p.name}:\n{p.read_text()[-4000:]}"
                for p in sorted(self.jobs[failed].dir.glob("error-rank*"))
            )
            tail = log.read_text(errors="replace")[-12000:]
            self.jobs[failed].state = "failed"
            self.jobs[failed].error = f"{' '.join(cmd)} ({why}){errors}\n-- launch output:\n{tail}"
            if done == len(names):  # every job finished, then the launch failed: none of them is trusted
                for n in names[:done]:
                    self.jobs[n].state, self.jobs[n].error = "failed", self.jobs[failed].error
                return
            cut = names.index(failed) + 1
            names, specs = names[cut:], specs[cut:]

    def _run(self, cmd: list[str], env: dict, log: Path, jobs: list[_Job]) -> tuple[int, str]:
        """Runs one launch; returns how many of ``jobs`` (in order) it finished, and why it stopped
        short or failed ('' when it exited 0)."""
        with log.open("w") as out:
            proc = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        done, since = 0, time.monotonic()
        try:
            while proc.poll() is None:
                time.sleep(0.2)
                now = sum(1 for _ in _prefix_done(jobs))
                if now > done:
                    done, since = now, time.monotonic()
                elif time.monotonic() - since > self.timeout:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return done, f"no job finished for {self.timeout} s: killed"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        done = sum(1 for _ in _prefix_done(jobs))
        return done, f"exit code {proc.returncode}" if proc.returncode else ""


def _prefix_done(jobs: list[_Job]):
    for job in jobs:
        if not (job.dir / DONE).exists():
            return
        yield job


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
