"""The node helper of its own (issue 18): ranks started by no launcher probe knows (here: plain processes
with the variables srun or mpirun would set) start one helper per node and job, register with it, and are
listed, read from outside and named when dead through ``MASTER:PROBE_PORT``; the helper holds none of the
job's output streams and leaves once its ranks are gone. Each test runs in its own runtime directory."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional

import pytest

from probe.client import transport
from procs import TARGETS, Proc, run_cli, scaled, target_env
from test_cluster import _free_ports
from test_torchrun import _free_port_pair


def _until(check, timeout: float, what: str):
    deadline = time.monotonic() + scaled(timeout)
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for %s" % what)
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        with open("/proc/%d/stat" % pid, "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def _helper_pid(runtime: str, port: int) -> Optional[int]:
    path = os.path.join(runtime, "node-%d.sock" % port)
    try:
        answer = transport.request(transport.UnixAddress(path), "GET", "/v1/health", None, {}, 5.0)
    except Exception:
        return None
    return json.loads(bytes(answer.body))["pid"] if answer.status == 200 else None


@contextmanager
def ranks_of(tmp_path, count: int, script: str = "rank_states.py", **extra: str) -> Iterator[Dict[str, object]]:
    """``count`` ranks of one job as srun would start them (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS), each
    a plain child of the test, in a runtime directory of the test's own; yields the job: its port, the
    runtime directory, the env, and rank -> Proc. Every rank, and a node helper still there, is killed and
    reaped (a helper is the ranks' to start: it is no child of ours, so it is waited for, bounded)."""
    runtime = str(tmp_path / "run")
    os.mkdir(runtime, 0o700)
    port = _free_ports(count)
    env = target_env(**dict(dict(PROBE_PORT="127.0.0.1:%d" % port, PROBE_RUNTIME_DIR=runtime, PROBE_HELPER_LINGER_S="2",
                                 SLURM_NTASKS=str(count), SLURM_NODEID="0"), **extra))
    procs: Dict[int, Proc] = {}
    job: Dict[str, object] = {"port": port, "runtime": runtime, "env": target_env(probe=False, PROBE_RUNTIME_DIR=runtime),
                              "ranks": procs}
    try:
        for rank in range(count):
            popen = subprocess.Popen([sys.executable, os.path.join(TARGETS, script)], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=dict(env, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank)))
            procs[rank] = Proc(popen, "%s rank %d" % (script, rank))
        for proc in procs.values():
            line = proc.read_line(60)
            assert line.startswith("READY"), line
        yield job
    finally:
        helper = _helper_pid(runtime, port)
        for proc in procs.values():
            proc.kill()
        if helper is not None:
            try:
                _until(lambda: not _alive(helper), 30, "the node helper to leave once its ranks are gone")
            finally:
                if _alive(helper):
                    os.kill(helper, signal.SIGKILL)


def _ranks(job: Dict[str, object]) -> List[Dict[str, object]]:
    out = run_cli("127.0.0.1:%d" % job["port"], "ranks", "-f", "json", env=job["env"])  # type: ignore[arg-type]
    return json.loads(out.out) if out.code == 0 else []


def test_ranks_of_no_known_launcher_start_one_helper_and_are_listed_read_and_named(tmp_path):
    with ranks_of(tmp_path, 3, GIL_RANK="2") as job:
        procs: Dict[int, Proc] = job["ranks"]  # type: ignore[assignment]
        port = job["port"]
        listed = _until(lambda: (lambda rows: rows if len(rows) == 3 else None)(_ranks(job)), 30, "3 ranks listed")
        assert [(m["rank"], m["local_rank"], m["port"], m["pid"]) for m in listed] == [
            (r, r, port + r, procs[r].pid) for r in range(3)]  # type: ignore[operator]

        # One helper for the node and job, a process of its own: no rank's child in the rank's session.
        helper = _helper_pid(job["runtime"], port)  # type: ignore[arg-type]
        assert helper is not None and helper not in [p.pid for p in procs.values()]
        assert os.getsid(helper) == helper, "the helper runs in a session of its own"
        # Each rank that finds no helper starts one; those that lose the node's lock exit at once: one stays.
        helpers = _until(lambda: (lambda found: found if found == [str(helper)] else None)(
            [p for p in os.listdir("/proc") if p.isdigit() and _is_helper_of(int(p), port)]),  # type: ignore[arg-type]
            20, "one helper left for the node and job")
        assert helpers == [str(helper)], helpers

        stacks = run_cli("127.0.0.1:%d" % port, "--all-ranks", "backtrace", env=job["env"])  # type: ignore[arg-type]
        assert stacks.code == 0, stacks.err
        assert "hold_the_gil" in stacks.out and "[stack of rank 2 read from outside]" in stacks.out, stacks.out
        assert "ranks 0-1 (2)" in stacks.out, stacks.out

        procs[1].popen.send_signal(signal.SIGKILL)
        procs[1].popen.wait(10)
        dead = _until(lambda: [m for m in _ranks(job) if m["state"] == "dead"], 15, "rank 1 shown dead")
        assert [m["rank"] for m in dead] == [1]
        partial = run_cli("127.0.0.1:%d" % port, "--all-ranks", "query", "SELECT pid FROM process.info", "-f", "json",
                          env=job["env"])  # type: ignore[arg-type]
        assert partial.code == 7, (partial.code, partial.err)
        assert [r["rank"] for r in json.loads(partial.out)] == [0]
        assert "rank 1 (" in partial.err and "exited" in partial.err, partial.err


def test_a_rank_not_registered_yet_is_named_and_the_answer_is_partial(tmp_path):
    """Rank 0 of a job of 2 is up; rank 1 has not registered (under Lightning's ddp a rank learns its
    number only in init_process_group, and registers a moment later). A command across ranks asks again
    for a moment, then names rank 1 as not listed and exits 7: it never answers for fewer ranks in silence."""
    with ranks_of(tmp_path, 1, SLURM_NTASKS="2") as job:
        master = "127.0.0.1:%d" % job["port"]
        _until(lambda: run_cli(master, "ranks", "-f", "json", env=job["env"]).out.strip().startswith("["), 30,
               "rank 0 listed")  # type: ignore[arg-type]
        partial = run_cli(master, "--all-ranks", "query", "SELECT pid FROM process.info", "-f", "json",
                          env=job["env"])  # type: ignore[arg-type]
        assert partial.code == 7, (partial.code, partial.err)
        assert [r["rank"] for r in json.loads(partial.out)] == [0], partial.out
        assert "rank 1 of the job's 2 is not listed by its helpers" in partial.err, partial.err


def _is_helper_of(pid: int, port: int) -> bool:
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as handle:
            argv = handle.read().split(b"\0")
    except OSError:
        return False
    return b"probe.host" in argv and str(port).encode() in argv and _alive(pid)


def test_the_helper_holds_none_of_the_jobs_output_and_leaves_after_its_ranks(tmp_path):
    """A launcher that reads its ranks' output until it closes (subprocess.run with capture_output, a log
    collector) must see it close when the ranks end, although the helper they started lingers a moment."""
    with ranks_of(tmp_path, 1, GIL_RANK="none") as job:
        proc = job["ranks"][0]  # type: ignore[index]
        _until(lambda: _ranks(job), 30, "rank 0 listed")
        helper = _helper_pid(job["runtime"], job["port"])  # type: ignore[arg-type]
        proc.popen.send_signal(signal.SIGKILL)
        proc.popen.wait(10)
        assert proc.popen.stdout.read() == b""  # end of file at once: no other process holds the pipe
        assert _alive(helper), "the helper lingers after its last rank died, so that the death can be read"
        assert [m["state"] for m in _ranks(job)] == ["dead"]
        _until(lambda: not _alive(helper), 30, "the helper to leave")
        assert not os.path.exists(os.path.join(job["runtime"], "node-%d.sock" % job["port"]))  # type: ignore[str-format]


def test_registration_is_checked_and_tcp_may_not_register(tmp_path):
    with ranks_of(tmp_path, 1, GIL_RANK="none") as job:
        _until(lambda: _ranks(job), 30, "rank 0 listed")
        unix = transport.UnixAddress(os.path.join(job["runtime"], "node-%d.sock" % job["port"]))  # type: ignore[str-format]
        for body, wanted in ((b"[]", "JSON object"), (b'{"pid": 1, "rank": 0, "source": "x"}', "not this helper's user"),
                             (b'{"pid": %d, "rank": -1, "source": "x"}' % os.getpid(), "rank must be an integer"),
                             (b'{"pid": 4194305, "rank": 0, "source": "x"}', "pid must be an integer"),
                             (b'{"pid": %d, "rank": 0, "source": "x y"}' % os.getpid(), "source must be a word")):
            if body.startswith(b'{"pid": 1,') and os.getuid() == 0:
                continue  # as root, pid 1 is this helper's user's
            answer = transport.request(unix, "POST", "/v1/register", body, {}, 5.0)
            assert answer.status in (400, 403) and wanted in bytes(answer.body).decode(), (body, bytes(answer.body))
        token = open(os.path.join(job["runtime"], "job-%d.token" % job["port"])).read().strip()  # type: ignore[str-format]
        tcp = transport.TcpAddress("127.0.0.1", job["port"] - 1)  # type: ignore[operator]
        answer = transport.request(tcp, "POST", "/v1/register", b'{"pid": %d, "rank": 5, "source": "x"}' % os.getpid(),
                                   None, 5.0, token=token)
        assert answer.status == 403 and "unix socket" in bytes(answer.body).decode()
        assert [m["rank"] for m in _ranks(job)] == [0], "nothing that was refused is listed"

        # Aimed at the helper's pid (it is in `probe list`), probe says what it is and how to reach its ranks.
        helper = _helper_pid(job["runtime"], job["port"])  # type: ignore[arg-type]
        aimed = run_cli(str(helper), "health", env=job["env"])  # type: ignore[arg-type]
        assert aimed.code == 3 and "is the node helper of the job with PROBE_PORT=%d" % job["port"] in aimed.err, aimed
        assert "`probe 127.0.0.1:%d ranks`" % job["port"] in aimed.err, aimed.err


def test_a_rank_numbered_only_by_torch_distributed_registers_once_it_knows(tmp_path):
    """No launcher variable names the rank (Lightning's rank 0, a spawn child): it is listed once the program
    initialised its default process group, with the number torch.distributed gave it."""
    pytest.importorskip("torch")
    runtime = str(tmp_path / "run")
    os.mkdir(runtime, 0o700)
    port = _free_port_pair()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        store_port = sock.getsockname()[1]
    env = target_env(PROBE_PORT="127.0.0.1:%d" % port, PROBE_RUNTIME_DIR=runtime, PROBE_HELPER_LINGER_S="2")
    code = ("import os, sys, threading, torch.distributed as dist\n"
            "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:%d', rank=0, world_size=1)\n"
            "print('READY', os.getpid(), flush=True)\n"
            "threading.Event().wait(600)\n" % store_port)
    popen = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc = Proc(popen, "init_process_group")
    helper = None
    try:
        assert proc.read_line(90).startswith("READY")
        job = {"port": port, "env": target_env(probe=False, PROBE_RUNTIME_DIR=runtime)}
        listed = _until(lambda: _ranks(job), 30, "the rank listed after init_process_group")
        helper = _helper_pid(runtime, port)
        assert [(m["rank"], m["world_size"], m["pid"], m["local_rank"]) for m in listed] == [(0, 1, popen.pid, None)]
        assert listed[0]["port"] != port, "a process with no local rank at start takes no rank's port"
        health = json.loads(run_cli(str(popen.pid), "health", "--json", env=job["env"]).out)
        assert health["rank_source"] == "torch.distributed" and listed[0]["port"] == int(health["tcp"].rpartition(":")[2])
    finally:
        proc.kill()
        if helper is not None:
            try:
                _until(lambda: not _alive(helper), 30, "the node helper to leave")
            finally:
                if _alive(helper):
                    os.kill(helper, signal.SIGKILL)


def test_a_list_of_targets_is_numbered_by_the_ranks_they_say_they_are(tmp_path):
    """``--hosts`` / ``-t`` name ranks in any order: rank 2 is rank 2, not the first line of the file. Where
    a target cannot say its rank, every target keeps its place in the list, and stderr says why."""
    with ranks_of(tmp_path, 3, GIL_RANK="none") as job:
        procs: Dict[int, Proc] = job["ranks"]  # type: ignore[assignment]
        port = job["port"]
        hosts = tmp_path / "hosts.txt"
        hosts.write_text("".join("127.0.0.1:%d\n" % (port + r) for r in (2, 0, 1)))  # type: ignore[operator]
        asked = run_cli("--hosts", str(hosts), "query", "SELECT pid FROM process.info", "-f", "json",
                        env=job["env"])  # type: ignore[arg-type]
        assert asked.code == 0, asked.err
        assert [(r["rank"], r["pid"]) for r in json.loads(asked.out)] == [(r, procs[r].pid) for r in range(3)]
        listed = run_cli("--hosts", str(hosts), "ranks", "-f", "json", env=job["env"])  # type: ignore[arg-type]
        assert [(m["rank"], m["pid"], m["local_rank"], m["world_size"]) for m in json.loads(listed.out)] == [
            (r, procs[r].pid, r, 3) for r in range(3)], listed

        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            nobody = "127.0.0.1:%d" % free.getsockname()[1]
        mixed = run_cli("-t", "127.0.0.1:%d" % (port + 2), "-t", nobody, "--all-ranks", "query",  # type: ignore[operator]
                        "SELECT pid FROM process.info", "-f", "json", env=job["env"])  # type: ignore[arg-type]
        assert mixed.code == 7, mixed
        assert [(r["rank"], r["pid"]) for r in json.loads(mixed.out)] == [(0, procs[2].pid)]
        assert "the ranks shown are places in the list of targets (from 0): %s did not say its rank" % nobody in mixed.err
