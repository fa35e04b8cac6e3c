#!/usr/bin/env python3
"""Run one training process per rank on a Ray cluster, torchrun-style.

    python launch/ray/launch.py --nodes 2 --gpus-per-node 8 --ckpt-dir /shared/ckpt/run1 -- \\
        /opt/Megatron-LM/pretrain_gpt.py --hf-model /shared/Qwen3-0.6B <Megatron flags>

Why a launcher and not ``ray job submit torchrun ...``: Ray owns the resources, so the ranks must be
Ray actors placed by Ray (one STRICT_PACK placement group per node), and a dead actor must take the
whole group down at once instead of leaving the other ranks blocked in a collective.

Each rank is an actor that runs the command as a child process with RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT and CUDA_VISIBLE_DEVICES set, so the program
calls ``init_process_group`` (env://) and then Megatron's model-parallel init exactly as under torchrun.
A first command word ending in ``.py`` or starting with ``-`` is run through ``--entry`` (default
``python -m twinkle_specs.launch``). See docs/launch.md.
"""

from __future__ import annotations

import argparse
import ctypes
import ipaddress
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_ENTRY = "python -m twinkle_specs.launch"
TRACKER = "latest_checkpointed_iteration.txt"
# Driver environment forwarded to every rank (Ray workers inherit the raylet's env, not the driver's).
FORWARD_PREFIXES = ("NCCL_", "TORCH_", "TWINKLE_", "HF_", "CUDA_DEVICE_MAX_CONNECTIONS", "PYTHONPATH")


class LaunchError(RuntimeError):
    """A configuration or cluster problem, reported as one clear line."""


def log(msg: str) -> None:
    print(f"[ray-launch {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- command line


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Split launcher flags from the per-rank command at the first ``--``."""
    if "--" in argv:
        i = argv.index("--")
        own, command = argv[:i], argv[i + 1 :]
    else:
        own, command = argv, []
    p = argparse.ArgumentParser(
        prog="launch/ray/launch.py",
        description="Run one process per rank on a Ray cluster (see docs/launch.md).",
        epilog="Everything after -- is the per-rank command.",
    )
    p.add_argument(
        "--address",
        default=None,
        help="Ray address (host:port, or 'auto': any Ray cluster running here); default: RAY_ADDRESS, "
        "else the cluster `ray start` started on this machine, else start one for this job",
    )
    p.add_argument("--nodes", type=int, default=None, help="nodes to use (default: every node that fits)")
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPU ranks per node (one GPU each)")
    p.add_argument(
        "--procs-per-node",
        type=int,
        default=None,
        help="ranks per node; CPU ranks when --gpus-per-node is 0 (default: --gpus-per-node)",
    )
    p.add_argument("--cpus-per-proc", type=float, default=1.0, help="CPUs reserved per rank (default 1)")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the whole group up to N times after a "
        "failure; with --ckpt-dir it resumes from the latest checkpoint",
    )
    p.add_argument(
        "--ckpt-dir",
        default=None,
        help="shared checkpoint dir: adds --save/--load DIR to the command unless it already has them",
    )
    p.add_argument("--log-dir", default=None, help="also write each rank's output to DIR/rank_<R>.log")
    p.add_argument(
        "--workdir",
        default=os.getcwd(),
        help="working dir of every rank (default: cwd; must exist on every node)",
    )
    p.add_argument(
        "--entry",
        default=os.environ.get("ENTRY", DEFAULT_ENTRY),
        help=f"runs a command whose first word is a .py file or a flag (default: {DEFAULT_ENTRY})",
    )
    p.add_argument(
        "--master-port", type=int, default=None, help="default: a free port probed on the master node"
    )
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra env for every rank")
    p.add_argument("--node-ip-address", default=None, help="IP for a local cluster this script starts")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of a local cluster this script starts")
    p.add_argument("--placement-timeout", type=float, default=120.0, help="seconds to wait for resources")
    p.add_argument("--poll-interval", type=float, default=1.0, help="seconds between output/health polls")
    p.add_argument(
        "--stop-grace", type=float, default=3.0, help="seconds between SIGTERM and SIGKILL at teardown"
    )
    args = p.parse_args(own)
    args.command = command
    if not command:
        p.error("no per-rank command: put it after --, e.g. -- /path/pretrain_gpt.py --hf-model DIR ...")
    if args.gpus_per_node < 0:
        p.error("--gpus-per-node must be >= 0")
    if args.procs_per_node is None:
        if args.gpus_per_node == 0:
            p.error("give --gpus-per-node N (GPU ranks) or --procs-per-node N (CPU ranks)")
        args.procs_per_node = args.gpus_per_node
    if args.procs_per_node < 1:
        p.error("--procs-per-node must be >= 1")
    if args.gpus_per_node and args.procs_per_node != args.gpus_per_node:
        p.error(
            f"--procs-per-node {args.procs_per_node} != --gpus-per-node {args.gpus_per_node}: "
            "run one rank per GPU"
        )
    if args.nodes is not None and args.nodes < 1:
        p.error("--nodes must be >= 1")
    if args.max_restarts < 0:
        p.error("--max-restarts must be >= 0")
    for kv in args.env:
        if "=" not in kv or kv.startswith("="):
            p.error(f"--env {kv!r}: expected KEY=VALUE")
    return args


def build_command(command: list[str], entry: str, ckpt_dir: str | None) -> list[str]:
    """Prefix the entry for a bare pretrain_gpt.py, and add Megatron's --save/--load for resume."""
    cmd = list(command)
    if cmd[0].endswith(".py") or cmd[0].startswith("-"):
        cmd = shlex.split(entry) + cmd
    if ckpt_dir:
        has = {w.split("=", 1)[0] for w in cmd}
        if "--save" not in has:
            cmd += ["--save", ckpt_dir]
        if "--load" not in has:
            cmd += ["--load", ckpt_dir]
    return cmd


# ----------------------------------------------------------------------------- the per-rank actor


def _die_with_parent() -> None:
    """Child side: get SIGKILL when the actor process dies, so no rank outlives a killed actor."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class RankWorker:
    """One rank: reports where it landed, then runs the command and streams its output."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.tail: deque[str] = deque(maxlen=30)
        self.pump: threading.Thread | None = None
        self.fresh: list[str] = []  # lines not yet fetched by the driver (read())
        self.lock = threading.Lock()
        self.error: str | None = None  # why the output could not be drained; the rank was stopped

    def info(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {
            "ip": ray.util.get_node_ip_address(),
            "node_id": ctx.get_node_id(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
        }

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def start(self, cmd: list[str], env: dict[str, str], cwd: str, log_path: str | None) -> dict[str, Any]:
        """Starts the rank; ``{"pid": ...}``, or ``{"error": ...}`` when its log file cannot be opened or
        its command not started (a configuration error: restarting cannot help)."""
        log = None
        if log_path:
            try:
                Path(log_path).parent.mkdir(parents=True, exist_ok=True)
                log = open(log_path, "a", buffering=1)  # noqa: SIM115 - closed by _pump
            except OSError as e:
                return {"error": f"--log-dir: cannot write {log_path}: {_os_reason(e)}"}
        full_env = {**os.environ, **env}
        try:
            self.proc = subprocess.Popen(
                cmd,
                env=full_env,
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        except OSError as e:
            self._close(log)
            culprit = f" ({e.filename})" if e.filename else ""
            return {
                "error": f"cannot run {shlex.join(cmd[:1])} in --workdir {cwd}: {e.strerror or e}{culprit}"
            }
        self.pump = threading.Thread(target=self._pump, args=(log,), daemon=True)
        self.pump.start()
        return {"pid": self.proc.pid}

    def _pump(self, log: Any) -> None:
        """Collect the child's output for the driver to fetch; the driver prints it, so no line is lost
        to Ray's asynchronous log forwarding when the group ends.

        The pipe is drained to the end whatever happens: a rank whose output nobody reads blocks forever.
        A log that cannot be written (full disk, quota) stops the rank, and the driver reports why."""
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            with self.lock:
                self.tail.append(line)
                self.fresh.append(line)
            if log is None:
                continue
            try:
                log.write(line + "\n")
            except Exception as e:  # noqa: BLE001 - any failure: stop the rank, keep draining
                self.error = f"writing its log {log.name} failed ({e}); the rank was stopped"
                self._close(log)
                log = None
                threading.Thread(target=self.stop, args=(3.0,), daemon=True).start()
        self._close(log)

    @staticmethod
    def _close(log: Any) -> None:
        if log is not None:
            try:
                log.close()
            except OSError:
                pass  # already reported by the failed write

    def read(self) -> list[str]:
        with self.lock:
            out, self.fresh = self.fresh, []
        return out

    def wait(self) -> dict[str, Any]:
        assert self.proc is not None
        rc = self.proc.wait()
        if self.pump:
            self.pump.join(timeout=5)
        return {"rc": rc, "tail": list(self.tail), "error": self.error}

    def stop(self, grace: float) -> None:
        """SIGTERM the rank's process group, SIGKILL what is left after ``grace`` seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


# ----------------------------------------------------------------------------- the driver


@dataclass
class Rank:
    rank: int
    node_rank: int
    local_rank: int
    actor: Any
    info: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)


def _ip_key(ip: str) -> tuple[int, int | str]:
    try:
        return (0, int(ipaddress.ip_address(ip)))
    except ValueError:
        return (1, ip)


def pick_nodes(nodes: list[dict[str, Any]], want: int | None, cpus: float, gpus: int) -> list[dict[str, Any]]:
    """Alive nodes with room for one node's ranks, ordered by IP (then node id): node rank = position."""
    fit = [
        n
        for n in nodes
        if n.get("Alive")
        and n.get("Resources", {}).get("CPU", 0) >= cpus
        and n.get("Resources", {}).get("GPU", 0) >= gpus
    ]
    fit.sort(key=lambda n: (_ip_key(n["NodeManagerAddress"]), n["NodeID"]))
    need = want or len(fit)
    if need == 0 or len(fit) < need:
        have = ", ".join(
            f"{n['NodeManagerAddress']}(CPU={n.get('Resources', {}).get('CPU', 0)}, "
            f"GPU={n.get('Resources', {}).get('GPU', 0)})"
            for n in nodes
            if n.get("Alive")
        )
        raise LaunchError(
            f"need {need or 1} node(s) with CPU>={cpus:g} and GPU>={gpus} free for one node's ranks, "
            f"found {len(fit)}; cluster nodes: {have or 'none'}. "
            "Lower --procs-per-node/--cpus-per-proc/--nodes"
        )
    return fit[:need]


def _gpu_key(gpu_id: str) -> tuple[int, int | str]:
    return (0, int(gpu_id)) if gpu_id.isdigit() else (1, gpu_id)


def local_order(infos: list[dict[str, Any]], gpus: bool) -> tuple[list[int], str]:
    """Local-rank order of one node's actors, and the node's CUDA_VISIBLE_DEVICES.

    Every rank of a node sees all GPUs Ray gave that node's ranks, sorted, and LOCAL_RANK k is the actor
    holding the k-th of them, so Megatron's ``torch.cuda.set_device(LOCAL_RANK)`` picks the rank's own GPU.
    CPU ranks keep placement order and see no GPU.
    """
    if not gpus:
        return list(range(len(infos))), ""
    missing = [i for i, info in enumerate(infos) if len(info["gpu_ids"]) != 1]
    if missing:
        raise LaunchError(
            f"GPU ranks must hold exactly one GPU each; got {[infos[i]['gpu_ids'] for i in missing]}"
        )
    order = sorted(range(len(infos)), key=lambda i: _gpu_key(infos[i]["gpu_ids"][0]))
    return order, ",".join(infos[i]["gpu_ids"][0] for i in order)


class Group:
    """One attempt: placement groups, actors and processes for every rank, torn down together."""

    def __init__(self, args: argparse.Namespace, cmd: list[str], attempt: int) -> None:
        self.args, self.cmd, self.attempt = args, cmd, attempt
        self.pgs: list[Any] = []
        self.ranks: list[Rank] = []

    def place(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        a = self.args
        per_node_cpu = a.cpus_per_proc * a.procs_per_node
        nodes = pick_nodes(ray.nodes(), a.nodes, per_node_cpu, a.gpus_per_node)
        bundle: dict[str, float] = {"CPU": a.cpus_per_proc}
        if a.gpus_per_node:
            bundle["GPU"] = 1
        for n in nodes:
            pg = placement_group(
                [dict(bundle)] * a.procs_per_node,
                strategy="STRICT_PACK",
                bundle_label_selector=[{"ray.io/node-id": n["NodeID"]}] * a.procs_per_node,
            )
            self.pgs.append(pg)
        ready, _ = ray.wait(
            [pg.ready() for pg in self.pgs], num_returns=len(self.pgs), timeout=a.placement_timeout
        )
        if len(ready) < len(self.pgs):
            raise LaunchError(
                f"placement groups not ready after {a.placement_timeout:g}s: {len(nodes)} node(s) x "
                f"{a.procs_per_node} x {bundle} are not free (other jobs running?)"
            )
        actor_cls = ray.remote(RankWorker)
        pending = []
        for node_rank, (n, pg) in enumerate(zip(nodes, self.pgs, strict=True)):
            for j in range(a.procs_per_node):
                actor = actor_cls.options(
                    num_cpus=a.cpus_per_proc,
                    num_gpus=1 if a.gpus_per_node else 0,
                    max_concurrency=4,  # wait() blocks; stop() must still get through
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=j),
                ).remote()
                pending.append((node_rank, n, actor))
        infos = ray.get([act.info.remote() for _, _, act in pending], timeout=a.placement_timeout)
        by_node: dict[int, list[tuple[Any, dict[str, Any]]]] = {}
        for (node_rank, n, actor), info in zip(pending, infos, strict=True):
            if info["node_id"] != n["NodeID"]:
                raise LaunchError(
                    f"actor for node rank {node_rank} landed on {info['ip']}, not {n['NodeManagerAddress']}"
                )
            by_node.setdefault(node_rank, []).append((actor, info))
        world = len(nodes) * a.procs_per_node
        for node_rank in sorted(by_node):
            order, visible = local_order([info for _, info in by_node[node_rank]], bool(a.gpus_per_node))
            members = [by_node[node_rank][i] for i in order]
            for local_rank, (actor, info) in enumerate(members):
                rank = node_rank * a.procs_per_node + local_rank
                r = Rank(rank, node_rank, local_rank, actor, info)
                r.env = {
                    "RANK": str(rank),
                    "LOCAL_RANK": str(local_rank),
                    "WORLD_SIZE": str(world),
                    "LOCAL_WORLD_SIZE": str(a.procs_per_node),
                    "NODE_RANK": str(node_rank),
                    "GROUP_RANK": str(node_rank),
                    "CUDA_VISIBLE_DEVICES": visible,
                    "TWINKLE_RESTART_COUNT": str(self.attempt),
                }
                self.ranks.append(r)
        self.ranks.sort(key=lambda r: r.rank)

    def run(self) -> tuple[int, str]:
        """Start every rank; return (0, '') when all exit 0, else (code, why) for the first failure."""
        import ray

        a = self.args
        master = self.ranks[0]
        port = a.master_port or ray.get(master.actor.free_port.remote(), timeout=60)
        common = {k: v for k, v in os.environ.items() if k.startswith(FORWARD_PREFIXES)}
        common.update(kv.split("=", 1) for kv in a.env)
        common.update({"MASTER_ADDR": master.info["ip"], "MASTER_PORT": str(port)})
        log(
            f"attempt {self.attempt}: {len(self.ranks)} rank(s) on {len(self.pgs)} node(s), "
            f"master {master.info['ip']}:{port}; command: {shlex.join(self.cmd)}"
        )
        starts = []
        for r in self.ranks:
            env = {**common, **r.env}
            log_path = (
                str(Path(a.log_dir) / f"attempt_{self.attempt}" / f"rank_{r.rank}.log") if a.log_dir else None
            )
            starts.append(r.actor.start.remote(self.cmd, env, a.workdir, log_path))
        started = ray.get(starts, timeout=60)
        for r, res in zip(self.ranks, started, strict=True):
            if "error" in res:
                raise LaunchError(f"rank {r.rank} on {r.info['hostname']} ({r.info['ip']}): {res['error']}")
        for r, res in zip(self.ranks, started, strict=True):
            log(
                f"rank {r.rank} (node {r.node_rank} {r.info['ip']}, local rank {r.local_rank}): "
                f"actor pid {r.info['pid']}, process pid {res['pid']}"
            )
        waits = {r.actor.wait.remote(): r for r in self.ranks}
        try:
            return self._monitor(waits)
        finally:
            self._print_output(self.ranks)  # the last lines of every rank that can still be asked

    def _print_output(self, ranks: list[Rank], timeout: float = 5.0) -> None:
        """Fetch and print the ranks' new output lines as ``[rank R] line`` (dead actors are skipped)."""
        import ray

        if not ranks:
            return
        refs = {r.actor.read.remote(): r for r in ranks}
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        for ref in sorted(done, key=lambda x: refs[x].rank):
            try:
                lines = ray.get(ref, timeout=1)
            except Exception:  # noqa: BLE001 - an actor that died has nothing more to say
                continue
            for line in lines:
                print(f"[rank {refs[ref].rank}] {line}", flush=True)

    def _monitor(self, waits: dict[Any, Rank]) -> tuple[int, str]:
        """Poll until every rank is done or one fails, printing output as it comes."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayError

        running = list(self.ranks)
        while waits:
            done, _ = ray.wait(list(waits), num_returns=1, timeout=self.args.poll_interval)
            self._print_output(running, timeout=self.args.poll_interval + 5)
            for ref in done:
                r = waits.pop(ref)
                running.remove(r)
                where = f"rank {r.rank} (node {r.node_rank} {r.info['ip']}, local rank {r.local_rank})"
                try:
                    res = ray.get(ref, timeout=10)
                except RayActorError as e:
                    return (
                        1,
                        f"{where} died: its actor process (pid {r.info['pid']}) exited: {_first_line(e)}",
                    )
                except (RayError, GetTimeoutError) as e:
                    return 1, f"{where} failed inside Ray: {_first_line(e)}"
                if res["error"]:
                    return 1, f"{where}: {res['error']}"
                rc = res["rc"]
                if rc != 0:
                    how = f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with code {rc}"
                    tail = "\n".join(f"    {ln}" for ln in res["tail"][-10:])
                    return (rc if rc > 0 else 1), f"{where} {how}; last output:\n{tail}"
        return 0, ""

    def teardown(self) -> None:
        """Stop every rank's process, then kill the actors and free the placement groups."""
        import ray
        from ray.util.placement_group import remove_placement_group

        stops = []
        for r in self.ranks:
            try:
                stops.append(r.actor.stop.remote(self.args.stop_grace))
            except Exception:  # noqa: BLE001 - a dead actor cannot be asked; its child got PDEATHSIG
                pass
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=self.args.stop_grace + 6)
        for r in self.ranks:
            ray.kill(r.actor, no_restart=True)
        for pg in self.pgs:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - best effort; the driver exit frees it too
                pass
        self.ranks, self.pgs = [], []


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return next((ln.strip() for ln in text if ln.strip()), type(e).__name__)


def read_iteration(ckpt_dir: str | None) -> str | None:
    if not ckpt_dir:
        return None
    p = Path(ckpt_dir) / TRACKER
    return p.read_text().strip() if p.is_file() else None


def require_reachable(address: str, what: str) -> None:
    """Fails at once when nothing listens at a host:port ``address``: ray.init() would wait minutes for a
    cluster that is not there. Other forms (``auto``, ``ray://``) are left to Ray."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "://" in address:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()  # [IPv6]:port
    except OSError as e:
        raise LaunchError(f"no Ray cluster answers at {address} ({what}): {e}") from None


def connect(args: argparse.Namespace) -> None:
    """Join --address (or RAY_ADDRESS); else the cluster `ray start` last started on this machine (the one
    ray.init() without an address joins); else start a local cluster for this job. Not Ray's "auto", which
    also joins a cluster another driver started for itself: that one stops with its driver, and a job that
    joined it with it ("Failed to connect to GCS")."""
    import ray
    from ray._private.services import find_bootstrap_address  # the address `ray start` records

    kwargs: dict[str, Any] = {"log_to_driver": True, "include_dashboard": False}
    address = args.address or os.environ.get("RAY_ADDRESS")
    if address:
        require_reachable(address, "--address" if args.address else "RAY_ADDRESS")
        ray.init(address=address, **kwargs)
        return
    recorded = find_bootstrap_address(None)
    if recorded:
        require_reachable(
            recorded,
            "recorded by `ray start` on this machine; `ray stop` clears the record, or give --address",
        )
        log(f"joining the Ray cluster `ray start` started on this machine ({recorded})")
        ray.init(address=recorded, **kwargs)
        return
    if args.node_ip_address:
        kwargs["_node_ip_address"] = args.node_ip_address
    if args.num_cpus is not None:
        kwargs["num_cpus"] = args.num_cpus
    log("no Ray cluster started by `ray start` on this machine: starting a local one for this job")
    ray.init(address="local", **kwargs)


def check_log_dir(log_dir: str) -> None:
    """Creates --log-dir and writes a file there, so an unwritable one fails here in one line instead of in
    every rank (a rank whose output cannot be logged would otherwise block on its full pipe)."""
    probe = Path(log_dir) / f".launch-write-check.{os.getpid()}"
    try:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        where = f" ({e.filename})" if e.filename and str(e.filename) != log_dir else ""
        raise LaunchError(
            f"--log-dir {log_dir} is not writable{where}: {_os_reason(e)}; choose a directory you can write"
        ) from e


def _os_reason(e: OSError) -> str:
    if isinstance(e, (FileExistsError, NotADirectoryError)):  # mkdir below a regular file
        return f"{e.strerror} (a part of the path is a file, not a directory)"
    return str(e.strerror or e)


def main(argv: list[str] | None = None) -> int:
    """Run the group, restart it from the latest checkpoint up to --max-restarts times."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cmd = build_command(args.command, args.entry, args.ckpt_dir)
    if args.ckpt_dir and not Path(args.ckpt_dir).is_absolute():
        print(
            "launch.py: error: --ckpt-dir must be an absolute path on storage every node mounts",
            file=sys.stderr,
        )
        return 2
    if args.log_dir:
        try:
            check_log_dir(args.log_dir)
        except LaunchError as e:
            print(f"launch.py: error: {e}", file=sys.stderr)
            return 2

    def on_term(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    import ray
    from ray.exceptions import RayError

    if __name__ != "__main__":  # imported (tests, wrappers): ship RankWorker by value to the workers
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

    try:
        connect(args)
    except LaunchError as e:
        print(f"launch.py: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001
        print(
            f"launch.py: error: cannot connect to or start a Ray cluster: {e}",
            file=sys.stderr,
        )
        return 2
    code = 1
    try:
        for attempt in range(args.max_restarts + 1):
            it = read_iteration(args.ckpt_dir)
            if it is not None:
                log(
                    f"attempt {attempt}: resuming from {args.ckpt_dir} "
                    f"(latest_checkpointed_iteration.txt: {it})"
                )
            group = Group(args, cmd, attempt)
            code, why = 1, ""
            try:
                group.place()
                code, why = group.run()
            except LaunchError as e:
                print(f"launch.py: error: {e}", file=sys.stderr)
                return 2
            except RayError as e:  # e.g. an actor died while the group was being set up: restartable
                why = f"starting the group failed: {_first_line(e)}"
            finally:
                t0 = time.monotonic()
                group.teardown()
                if code != 0:
                    log(f"group torn down in {time.monotonic() - t0:.1f}s")
            if code == 0:
                log("all ranks finished with exit code 0")
                return 0
            print(f"launch.py: error: {why}", file=sys.stderr, flush=True)
            if attempt < args.max_restarts:
                log(f"restarting the whole group ({attempt + 1}/{args.max_restarts})")
        if args.max_restarts:
            print(f"launch.py: error: giving up after {args.max_restarts} restart(s)", file=sys.stderr)
        return code
    except KeyboardInterrupt as e:
        print(f"launch.py: interrupted ({e}); ranks stopped", file=sys.stderr)
        return 130
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
