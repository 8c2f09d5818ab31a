"""A hung process stays readable however often it is looked at.

An agent whose GIL a C call holds accepts no connection; every connection made to it waits in its listen
backlog (128) until it runs again, whether or not its client still waits. The client therefore does not
connect to an agent it can already tell cannot answer, and diagnoses a full backlog at once instead of
waiting on it; once the agent runs again, it drains what was left there and runs none of it.
"""

import json
import os
import socket
import time
from typing import List, Tuple

import pytest

from procs import Proc, run_cli, scaled, spawn

pytest.importorskip("pystack", reason="reading from outside needs pystack (a dependency of probe on Linux)")

BOUND_S = 8.0  # for a whole command against a GIL-held process (the figure is about 1 s; the box is shared)


def _socket_path(pid: int) -> str:
    from probe import _paths

    return _paths.socket_path(pid)


def _queued(path: str) -> int:
    """Connections waiting in the backlog of the unix socket listening at ``path`` (accepted by nobody
    yet): /proc/net/unix lists each with the listener's path, in state 02 (connecting)."""
    count = 0
    with open("/proc/net/unix") as table:
        for line in table:
            fields = line.split()
            if len(fields) >= 8 and fields[7] == path and fields[5] == "02":
                count += 1
    return count


def _wait_until(check, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + scaled(timeout)
    while not check():
        assert time.monotonic() < deadline, "timed out waiting for " + what
        time.sleep(0.05)


def _holding_gil(proc: Proc, calls: Tuple[str, ...] = ("35", "230")) -> None:
    """The main thread is inside libc sleep() (or the system call numbered in ``calls``: "0", read()) called
    through ctypes.PyDLL: it keeps the GIL."""
    def in_sleep() -> bool:
        try:
            with open("/proc/%d/task/%d/syscall" % (proc.pid, proc.pid)) as handle:
                return handle.read().split()[0] in calls
        except (OSError, IndexError):
            return False
    _wait_until(in_sleep, "the main thread's call that holds the GIL")


def _heartbeat_older_than(path: str, seconds: float) -> None:
    _wait_until(lambda: time.time() - os.stat(path).st_mtime > seconds, "the agent's heartbeat to go stale")


def _fill_backlog(path: str, request: bytes = b"") -> List[socket.socket]:
    """Connect until the kernel refuses (EAGAIN: the backlog is full), sending ``request`` on each."""
    held = []
    while len(held) < 1000:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(path)
        except BlockingIOError:
            sock.close()
            return held
        if request:
            sock.send(request)
        held.append(sock)
    raise AssertionError("the backlog never filled")


def _timed(*args: str):
    started = time.monotonic()
    result = run_cli(*args, timeout=120)
    elapsed = time.monotonic() - started
    assert elapsed < scaled(BOUND_S), "probe %s took %.1f s: %s" % (" ".join(args), elapsed, result.err)
    return result


def test_a_gil_held_process_looked_at_again_and_again_keeps_nothing_queued(target_factory):
    proc = target_factory("hung.py", "gil")
    other = target_factory("idle.py")
    path = _socket_path(proc.pid)
    _holding_gil(proc)
    _heartbeat_older_than(path, 2.5)
    before = _queued(path)
    pid = str(proc.pid)
    commands = [("list",), (pid, "health"), (pid, "backtrace"), (pid, "backtrace", "--json"),
                (pid, "query", "SELECT count(*) AS n FROM python.backtrace"), (pid, "eval", "1 + 1"),
                ("-t", pid, "-t", str(other.pid), "backtrace"), (pid, "tables")]
    for args in commands:
        result = _timed(*args)
        assert "Traceback" not in result.err, result.err
    assert _queued(path) == before, "the commands left %d connections queued in the agent" % (_queued(path) - before)
    backtrace = _timed(pid, "backtrace")
    assert backtrace.code == 0 and "hold_gil" in backtrace.out and "holds the GIL" in backtrace.err


def test_a_full_backlog_is_diagnosed_at_once_not_waited_on(target_factory):
    proc = target_factory("hung.py", "gil")
    path = _socket_path(proc.pid)
    _holding_gil(proc)
    held = _fill_backlog(path)
    try:
        assert len(held) >= 100
        backtrace = _timed(str(proc.pid), "backtrace")
        assert backtrace.code == 0, backtrace.err
        assert "hold_gil" in backtrace.out and "holds the GIL" in backtrace.err
        health = _timed(str(proc.pid), "health")
        assert health.code == 5 and "holds the GIL" in health.err + health.out
        # Told to wait for the agent instead of deciding: bounded by that wait, and says why it got nothing.
        waited = _timed(str(proc.pid), "--wait", "1", "eval", "1 + 1")
        assert waited.code == 5 and "queue of waiting connections is full" in waited.err, waited.err
    finally:
        for sock in held:
            sock.close()


def test_an_agent_that_runs_again_drains_the_abandoned_connections_and_runs_none(target_factory, tmp_path):
    marker, release = tmp_path / "ran", str(tmp_path / "release")
    os.mkfifo(release, 0o600)
    proc = spawn("hung.py", ("gil_until", release))  # keeps the GIL until a byte comes on the FIFO
    try:
        path = _socket_path(proc.pid)
        _holding_gil(proc, ("0",))
        body = json.dumps({"code": "open(%r, 'a').write('x')" % str(marker)}).encode()
        request = (b"POST /v1/eval HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: "
                   b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        for sock in _fill_backlog(path, request):
            sock.close()  # given up on, as a client that timed out does
        assert _queued(path) >= 100
        fifo = os.open(release, os.O_WRONLY | os.O_NONBLOCK)  # the target holds it open for reading
        try:
            os.write(fifo, b"x")  # the agent runs again
        finally:
            os.close(fifo)
        _wait_until(lambda: run_cli(str(proc.pid), "health", timeout=60).code == 0, "the agent to answer again", 60)
        _wait_until(lambda: _queued(path) == 0, "the abandoned connections to be drained")
        assert not marker.exists(), "a request whose client had gone away was run"
        assert run_cli(str(proc.pid), "eval", "40 + 2", timeout=60).out.strip() == "42"
    finally:
        proc.kill()


def test_an_import_that_holds_the_gil_is_named_as_one_not_as_a_call_that_never_lets_go(target_factory):
    proc = target_factory("hung.py", "gil_import")
    _holding_gil(proc)
    result = _timed(str(proc.pid), "backtrace")
    assert result.code == 0 and "holds_gil_on_import" in result.out
    assert "while importing a module" in result.err and "does not let go" not in result.err, result.err


def test_wait_on_a_gil_held_process_says_once_why_nothing_came(target_factory):
    proc = target_factory("hung.py", "gil")
    _holding_gil(proc)
    started = time.monotonic()
    result = run_cli(str(proc.pid), "--wait", "2", "eval", "1 + 1", timeout=120)
    elapsed = time.monotonic() - started
    assert result.code == 5 and "holds the GIL" in result.err, result.err
    assert result.err.count("holds the GIL") == 1 and "may still run" not in result.err, result.err
    assert elapsed < 2 + scaled(4), "took %.1f s" % elapsed
