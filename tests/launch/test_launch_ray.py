"""launch/ray/launch.py on a real local Ray cluster (head + a second raylet, loopback, CPU actors, gloo).

Why: the launcher's promises are about a live cluster (placement, env per rank, collectives, a dead
actor taking the group down, restarts resuming from the checkpoint), so each is checked by running the
launcher as users do, as a separate driver process, against one cluster started for this module.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import free_port

ray = pytest.importorskip(
    "ray", reason="ray is not installed: pip install 'ray[default]==2.60.0' (extra 'ray')"
)

# The launch script's own mechanics: run on one leg of scripts/test.sh (pyproject.toml's one_leg marker).
pytestmark = pytest.mark.one_leg

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch" / "ray" / "launch.py"
DIST_CHECK = Path(__file__).resolve().parent / "dist_check.py"


def _ray_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    # Ray maps 127.0.0.1 to the host's outward IP unless told this is a one-machine cluster; the tests must
    # stay on loopback, so the cluster is single-node (multi-node ordering is covered by test_nodes_ordered...).
    env.update(
        RAY_USAGE_STATS_ENABLED="0",
        PYTHONUNBUFFERED="1",
        RAY_DEDUP_LOGS="0",
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_AUTH_MODE="token",  # ray start enables token auth; drivers must opt in to send the token
    )
    return env


def _alive_nodes(address: str) -> int:
    code = "import ray,sys; ray.init(address=sys.argv[1], log_to_driver=False); print(sum(n['Alive'] for n in ray.nodes()))"
    out = subprocess.run(
        [sys.executable, "-c", code, address], env=_ray_env(), capture_output=True, text=True, timeout=60
    )
    return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else 0


def _launch_one_rank(ray_tmpdir: str, out: Path, *launcher_args: str) -> subprocess.CompletedProcess:
    """launch.py with one CPU rank running dist_check.py, no RAY_ADDRESS and Ray's temporary folder (where
    `ray start` records its cluster) at ``ray_tmpdir``."""
    program = [str(DIST_CHECK), "--out", str(out)]
    return _launch(None, [*launcher_args, "--procs-per-node", "1"], program, ray_tmpdir=ray_tmpdir)


LOCAL_START = ("--num-cpus", "2", "--node-ip-address", "127.0.0.1")
STARTS_ITS_OWN = "no Ray cluster started by `ray start` on this machine: starting a local one for this job"


def test_starts_a_local_cluster_when_none_is_running(tmp_path: Path) -> None:
    """No --address and no cluster: the driver starts a local Ray, runs the ranks, and stops it again."""
    rt = tempfile.mkdtemp(prefix="rl", dir="/tmp")  # RAY_TMPDIR: no other cluster can be found there
    try:
        res = _launch_one_rank(rt, tmp_path, *LOCAL_START)
        assert res.returncode == 0, res.stdout + res.stderr
        assert STARTS_ITS_OWN in res.stdout
        rec = json.loads((tmp_path / "rank_0.json").read_text())  # world size 1
        assert rec["allreduce"] == rec["expected"] == 1.0 and rec["env"]["WORLD_SIZE"] == "1"
        assert rec["env"]["MASTER_ADDR"] == "127.0.0.1" and rec["env"]["RANK"] == "0"
        leftovers = subprocess.run(["pgrep", "-f", rt], capture_output=True, text=True).stdout.split()
        deadline = time.monotonic() + 15
        while leftovers and time.monotonic() < deadline:
            time.sleep(0.5)
            leftovers = subprocess.run(["pgrep", "-f", rt], capture_output=True, text=True).stdout.split()
        assert not leftovers, f"Ray processes of the local cluster still running: {leftovers}"
    finally:
        shutil.rmtree(rt, ignore_errors=True)


def test_a_cluster_another_driver_started_is_not_joined(tmp_path: Path) -> None:
    """Another job's driver started a local cluster for itself (ray.init() without `ray start`): a second
    launch without --address starts its own instead of joining that one, which stops with its driver and
    would take this job down with it ("Failed to connect to GCS"; Ray's address "auto" joins it)."""
    rt = tempfile.mkdtemp(prefix="rl", dir="/tmp")
    other = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import ray, time; ray.init(num_cpus=1, _node_ip_address='127.0.0.1', include_dashboard=False);"
            "print(ray.get_runtime_context().gcs_address, flush=True); time.sleep(600)",
        ],
        env={**_ray_env(), "RAY_TMPDIR": rt},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        other_address = other.stdout.readline().strip()
        assert other_address and other.poll() is None, "the other driver's cluster did not start"
        res = _launch_one_rank(rt, tmp_path, *LOCAL_START)
        assert res.returncode == 0, res.stdout + res.stderr
        assert STARTS_ITS_OWN in res.stdout and other_address not in res.stdout + res.stderr, res.stdout
        assert json.loads((tmp_path / "rank_0.json").read_text())["allreduce"] == 1.0
        assert other.poll() is None, "the other job's driver ended"
    finally:
        os.killpg(other.pid, signal.SIGKILL)
        other.wait(timeout=30)
        subprocess.run(["pkill", "-9", "-f", rt], check=False)
        shutil.rmtree(rt, ignore_errors=True)


@pytest.mark.parametrize("where", ["recorded", "--address"])
def test_a_cluster_that_is_gone_is_named_at_once(tmp_path: Path, where: str) -> None:
    """A `ray start` record left by a cluster that is gone (stopped without `ray stop`), or an --address nothing
    answers at: exit 2 at once, naming the address and what to do, instead of Ray's minutes of retries."""
    rt = tempfile.mkdtemp(prefix="rl", dir="/tmp")
    try:
        dead = f"127.0.0.1:{free_port()}"
        if where == "recorded":
            os.mkdir(os.path.join(rt, "ray"))
            Path(rt, "ray", "ray_current_cluster").write_text(dead)
            args: tuple[str, ...] = ()
        else:
            args = ("--address", dead)
        started = time.monotonic()
        res = _launch_one_rank(rt, tmp_path, *args)
        assert res.returncode == 2 and time.monotonic() - started < 60, res.stdout + res.stderr
        assert f"no Ray cluster answers at {dead} (" in res.stderr, res.stderr
        hint = "`ray stop` clears the record" if where == "recorded" else "(--address)"
        assert hint in res.stderr, res.stderr
    finally:
        shutil.rmtree(rt, ignore_errors=True)


def test_joins_the_cluster_ray_start_recorded(cluster: str, cluster_root: str, tmp_path: Path) -> None:
    """No --address, a cluster `ray start` started on this machine: the driver joins it, as ray.init()
    without an address would (--num-cpus and --node-ip-address only shape a cluster it starts)."""
    res = _launch_one_rank(cluster_root, tmp_path, *LOCAL_START)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"joining the Ray cluster `ray start` started on this machine ({cluster})" in res.stdout, (
        res.stdout
    )
    assert json.loads((tmp_path / "rank_0.json").read_text())["allreduce"] == 1.0


@pytest.fixture(scope="module")
def cluster_root() -> Iterator[str]:
    """The RAY_TMPDIR under which the module's `ray start` records its cluster (in ``ray/``, where Ray looks)."""
    root = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's unix socket paths must fit 107 bytes
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(cluster_root: str) -> Iterator[str]:
    """A head node with 4 CPUs on 127.0.0.1, started by `ray start --block` for this module, stopped after."""
    temp = os.path.join(cluster_root, "ray")
    os.mkdir(temp)
    port = free_port()
    address = f"127.0.0.1:{port}"
    log = open(Path(temp) / "head.out", "wb")  # noqa: SIM115
    head = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            "--head",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--num-cpus=4",
            "--num-gpus=0",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={temp}",
            "--block",
        ],
        env=_ray_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )

    def stop() -> None:
        if head.poll() is None:
            head.send_signal(signal.SIGTERM)  # with --block, `ray start` stops every process it started
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=5)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)

    try:
        deadline = time.monotonic() + 90
        while _alive_nodes(address) < 1:
            if head.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    "ray start --head failed:\n" + (Path(temp) / "head.out").read_text()[-3000:]
                )
            time.sleep(1)
    except BaseException:
        stop()
        raise
    try:
        yield address
    finally:
        stop()


def _launch(
    address: str | None,
    launcher_args: list[str],
    program: list[str],
    timeout: float = 120,
    ray_tmpdir: str | None = None,
    **popen: object,
) -> subprocess.CompletedProcess:
    """launch.py at ``address`` (None: no --address), Ray's temporary folder at ``ray_tmpdir`` if given."""
    cmd = [sys.executable, str(LAUNCH), *(["--address", address] if address else [])]
    cmd += ["--entry", sys.executable, *launcher_args, "--", *program]
    env = _ray_env() | ({"RAY_TMPDIR": ray_tmpdir} if ray_tmpdir else {})
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO, **popen)


def _results(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize(
    ("nodes", "procs", "tp"),
    [(1, 2, 2), (1, 3, 1)],
    ids=["world2-tp2", "world3"],  # world size 1: test_starts_a_local_cluster_when_none_is_running
)
def test_env_and_collectives(cluster: str, tmp_path: Path, nodes: int, procs: int, tp: int) -> None:
    """Every rank gets a consistent env; gloo all-reduce and megatron TP/DP groups give the expected sums."""
    out = tmp_path / "out"
    res = _launch(
        cluster,
        ["--nodes", str(nodes), "--procs-per-node", str(procs), "--log-dir", str(tmp_path / "l")],
        [str(DIST_CHECK), "--out", str(out), "--tp", str(tp)],
    )
    assert res.returncode == 0, res.stdout + res.stderr
    world = nodes * procs
    recs = _results(out, world)
    ports = {r["env"]["MASTER_PORT"] for r in recs}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for r, rec in enumerate(recs):
        env = rec["env"]
        assert env["RANK"] == str(r) and env["WORLD_SIZE"] == str(world)
        assert env["LOCAL_RANK"] == str(r % procs) and env["LOCAL_WORLD_SIZE"] == str(procs)
        assert env["NODE_RANK"] == str(r // procs)
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["CUDA_VISIBLE_DEVICES"] == ""
        assert rec["allreduce"] == rec["expected"] == world * (world + 1) / 2
        assert rec["tp_size"] == tp and rec["tp_rank"] == r % tp and rec["tp_allreduce"] == tp
        assert rec["dp_size"] == world // tp and rec["dp_allreduce"] == world // tp
    # Each rank's output is streamed to the driver with its rank prefix and kept in --log-dir.
    for r in range(world):
        assert f"[rank {r}] dist_check: rank {r}/{world}" in res.stdout
        assert "ok=True" in (tmp_path / "l" / "attempt_0" / f"rank_{r}.log").read_text()


def test_more_nodes_than_the_cluster_has_is_refused(cluster: str, tmp_path: Path) -> None:
    res = _launch(
        cluster, ["--nodes", "2", "--procs-per-node", "1"], [str(DIST_CHECK), "--out", str(tmp_path)]
    )
    assert res.returncode == 2 and "need 2 node(s) with CPU>=1 and GPU>=0" in res.stderr, res.stderr


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_killed_actor_stops_the_group(cluster: str, tmp_path: Path) -> None:
    """SIGKILL one rank's actor: the driver tears everything down within seconds and exits non-zero."""
    drv, actor_pids, proc_pids = _start_long_run(cluster, tmp_path / "out")
    os.kill(actor_pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    try:
        _rest, err = drv.communicate(timeout=60)
    finally:
        drv.kill()
    elapsed = time.monotonic() - t0
    assert drv.returncode != 0
    assert "rank 1 (node 0 127.0.0.1, local rank 1) died" in err, err
    assert elapsed < 20, f"teardown took {elapsed:.1f}s"
    _wait_dead([*proc_pids.values(), actor_pids[0]], timeout=10)


def _start_long_run(cluster: str, out: Path) -> tuple[subprocess.Popen, dict[int, int], dict[int, int]]:
    """Start a 2-rank driver that runs ~forever; return it with the ranks' actor and process pids."""
    cmd = [
        sys.executable,
        str(LAUNCH),
        "--address",
        cluster,
        "--entry",
        sys.executable,
        "--nodes",
        "1",
        "--procs-per-node",
        "2",
        "--",
        str(DIST_CHECK),
        "--out",
        str(out),
        "--train-iters",
        "1000",
        "--iter-seconds",
        "0.2",
    ]
    drv = subprocess.Popen(
        cmd, env=_ray_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )
    actor_pids: dict[int, int] = {}
    proc_pids: dict[int, int] = {}
    assert drv.stdout is not None
    deadline = time.monotonic() + 90
    for line in drv.stdout:  # the driver logs each rank's actor pid and process pid at start
        m = re.search(r"rank (\d) \(.*\): actor pid (\d+), process pid (\d+)", line)
        if m:
            actor_pids[int(m[1])], proc_pids[int(m[1])] = int(m[2]), int(m[3])
        if "iteration 2/" in line or time.monotonic() > deadline:
            break
    if len(actor_pids) != 2:
        drv.kill()
        raise AssertionError("driver did not report both ranks")
    return drv, actor_pids, proc_pids


def _wait_dead(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for pid in pids:
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(pid), f"pid {pid} still running {timeout}s after the group should have stopped"


def test_killed_driver_takes_the_ranks_with_it(cluster: str, tmp_path: Path) -> None:
    """SIGKILL the driver: Ray kills the actors it owned, and each rank process dies with its actor."""
    drv, actor_pids, proc_pids = _start_long_run(cluster, tmp_path / "out")
    drv.kill()
    drv.communicate(timeout=30)
    _wait_dead([*proc_pids.values(), *actor_pids.values()], timeout=30)


def test_raising_rank_fails_fast_with_reason(cluster: str, tmp_path: Path) -> None:
    """A rank that exits non-zero: its rank, exit code and last output are reported; exit code non-zero."""
    t0 = time.monotonic()
    res = _launch(
        cluster,
        ["--nodes", "1", "--procs-per-node", "2"],
        [str(DIST_CHECK), "--out", str(tmp_path), "--raise-rank", "1"],
        timeout=90,
    )
    assert res.returncode == 3, res.stdout + res.stderr
    assert "rank 1 (node 0 127.0.0.1, local rank 1) exited with code 3" in res.stderr
    assert "raising on purpose" in res.stderr  # the tail of the rank's output
    assert time.monotonic() - t0 < 60


def test_max_restarts_resumes_from_checkpoint(cluster: str, tmp_path: Path) -> None:
    """Rank 1 crashes once at iteration 3; --max-restarts 1 reruns the group, which resumes at 2."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    res = _launch(
        cluster,
        ["--nodes", "1", "--procs-per-node", "2", "--max-restarts", "1", "--ckpt-dir", str(ckpt)],
        [str(DIST_CHECK), "--out", str(out), "--train-iters", "5", "--fail-rank", "1", "--fail-at-iter", "3"],
        timeout=180,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "rank 1 (node 0 127.0.0.1, local rank 1) was killed by SIGKILL" in res.stderr
    assert "restarting the whole group (1/1)" in res.stdout
    assert "attempt 1: resuming from" in res.stdout and "latest_checkpointed_iteration.txt: 2)" in res.stdout
    for rec in _results(out, 2):
        assert rec["env"]["TWINKLE_RESTART_COUNT"] == "1"
        assert rec["start_iteration"] == 2 and rec["end_iteration"] == 5
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "5"


def test_unwritable_log_dir_is_refused_at_once(cluster: str, tmp_path: Path) -> None:
    """--log-dir below a regular file (unwritable for root too) with chatty ranks: a clear error within
    seconds, not ranks blocked forever on output nobody drains."""
    (tmp_path / "file").write_text("not a directory")
    log_dir = tmp_path / "file" / "logs"
    t0 = time.monotonic()
    res = _launch(
        cluster,
        ["--nodes", "1", "--procs-per-node", "2", "--log-dir", str(log_dir)],
        [str(DIST_CHECK), "--out", str(tmp_path / "out"), "--print-kib", "256"],
        timeout=90,
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"launch.py: error: --log-dir {log_dir} is not writable" in res.stderr, res.stderr
    assert "Not a directory" in res.stderr
    assert time.monotonic() - t0 < 30


def test_restarts_exhausted_exit_non_zero(cluster: str, tmp_path: Path) -> None:
    res = _launch(
        cluster,
        ["--nodes", "1", "--procs-per-node", "1", "--max-restarts", "1"],
        [str(DIST_CHECK), "--out", str(tmp_path), "--raise-rank", "0"],
        timeout=90,
    )
    assert res.returncode == 3
    assert "giving up after 1 restart(s)" in res.stderr


# ------------------------------------------------------------------ no cluster needed below


def _module():
    spec = importlib.util.spec_from_file_location("twinkle_ray_launch", LAUNCH)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def test_rank_whose_log_cannot_be_written_is_stopped_not_blocked(tmp_path: Path) -> None:
    """The log fills the disk mid-run (/dev/full: every write fails with ENOSPC, for root too) while the
    rank prints 512 KiB: the rank is stopped and wait() says why, instead of the rank blocking on its pipe."""
    import threading

    m = _module()
    worker = m.RankWorker()
    chatty = [sys.executable, "-c", "import time\nfor _ in range(512): print('x' * 1023)\ntime.sleep(60)"]
    assert worker.start(chatty, {}, str(tmp_path), "/dev/full")["pid"] > 0
    res: dict = {}
    waiter = threading.Thread(target=lambda: res.update(worker.wait()), daemon=True)
    waiter.start()
    waiter.join(timeout=30)
    try:
        assert not waiter.is_alive(), "the rank blocked on its undrained output"
    finally:
        worker.stop(0.5)
    assert res["rc"] != 0 and res["error"] is not None, res
    assert "writing its log /dev/full failed" in res["error"] and "No space left" in res["error"], res
    # A log directory that cannot be created on the rank's node: the rank is not started.
    (tmp_path / "file").write_text("x")
    res = worker.start(chatty, {}, str(tmp_path), str(tmp_path / "file" / "r.log"))
    assert res["error"].startswith(f"--log-dir: cannot write {tmp_path / 'file' / 'r.log'}: "), res
    assert "a part of the path is a file, not a directory" in res["error"], res
    # A command or --workdir that does not exist: named, not started.
    res = worker.start(["/no/such/python"], {}, str(tmp_path), None)
    assert res["error"].startswith(f"cannot run /no/such/python in --workdir {tmp_path}: No such file"), res
    res = worker.start(chatty, {}, str(tmp_path / "nope"), None)
    assert f"in --workdir {tmp_path / 'nope'}: No such file or directory" in res["error"], res


def test_command_building() -> None:
    m = _module()
    entry = "python -m twinkle_specs.launch"
    assert m.build_command(["/x/pretrain_gpt.py", "--hf-model", "d"], entry, "/c") == [
        "python",
        "-m",
        "twinkle_specs.launch",
        "/x/pretrain_gpt.py",
        "--hf-model",
        "d",
        "--save",
        "/c",
        "--load",
        "/c",
    ]
    assert m.build_command(["bash", "run.sh", "--save=/s"], entry, "/c") == [
        "bash",
        "run.sh",
        "--save=/s",
        "--load",
        "/c",
    ]
    assert m.build_command(["torchrun-free"], entry, None) == ["torchrun-free"]


def test_nodes_ordered_by_ip_and_checked() -> None:
    m = _module()
    nodes = [
        {"Alive": True, "NodeManagerAddress": "10.0.0.10", "NodeID": "b", "Resources": {"CPU": 8, "GPU": 8}},
        {"Alive": True, "NodeManagerAddress": "10.0.0.9", "NodeID": "a", "Resources": {"CPU": 8, "GPU": 8}},
        {"Alive": True, "NodeManagerAddress": "10.0.0.2", "NodeID": "c", "Resources": {"CPU": 8, "GPU": 4}},
        {"Alive": False, "NodeManagerAddress": "10.0.0.1", "NodeID": "d", "Resources": {"CPU": 8, "GPU": 8}},
    ]
    assert [n["NodeID"] for n in m.pick_nodes(nodes, None, 8, 8)] == ["a", "b"]  # 10.0.0.9 < 10.0.0.10
    with pytest.raises(m.LaunchError, match="need 3 node"):
        m.pick_nodes(nodes, 3, 8, 8)


def test_gpu_local_ranks_follow_gpu_ids() -> None:
    """Each GPU rank sees all of its node's GPUs; LOCAL_RANK k is the actor that holds the k-th one."""
    m = _module()
    infos = [{"gpu_ids": ["3"]}, {"gpu_ids": ["1"]}, {"gpu_ids": ["10"]}, {"gpu_ids": ["2"]}]
    assert m.local_order(infos, True) == ([1, 3, 0, 2], "1,2,3,10")
    assert m.local_order(infos, False) == ([0, 1, 2, 3], "")
    with pytest.raises(m.LaunchError, match="exactly one GPU"):
        m.local_order([{"gpu_ids": []}], True)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--procs-per-node", "2"], "no per-rank command: put it after --"),
        (["--", "x.py"], "give --gpus-per-node N (GPU ranks) or --procs-per-node N"),
        (["--gpus-per-node", "8", "--procs-per-node", "4", "--", "x.py"], "run one rank per GPU"),
        (["--procs-per-node", "1", "--env", "NOEQUALS", "--", "x.py"], "expected KEY=VALUE"),
    ],
)
def test_bad_flags_are_refused(argv: list[str], needle: str) -> None:
    res = subprocess.run([sys.executable, str(LAUNCH), *argv], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and needle in res.stderr, res.stderr


def test_relative_ckpt_dir_is_refused() -> None:
    res = subprocess.run(
        [sys.executable, str(LAUNCH), "--procs-per-node", "1", "--ckpt-dir", "rel", "--", "x.py"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "--ckpt-dir must be an absolute path" in res.stderr


@pytest.mark.parametrize(
    ("address", "dialled"),
    [("10.1.2.3:6379", ("10.1.2.3", 6379)), ("[fd00::1]:6379", ("fd00::1", 6379)), ("auto", None)],
)
def test_reachability_check_dials_the_address_ray_would(monkeypatch, address, dialled):
    """host:port and [IPv6]:port are dialled (without the brackets); other forms are left to Ray."""
    mod = _module()
    seen = []

    class Conn:
        def close(self) -> None:
            pass

    monkeypatch.setattr(mod.socket, "create_connection", lambda addr, timeout: seen.append(addr) or Conn())
    mod.require_reachable(address, "--address")
    assert seen == ([dialled] if dialled else [])
