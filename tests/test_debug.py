"""probe T debug: debugpy in the target, spoken to over DAP by a real client; gated like eval."""

import json
import os
import socket
import threading
import time
from typing import Any, Dict, List

import pytest

from other_user import NOBODY, run_as
from procs import REPO, pyenv_python, run_cli, scaled, target_env

import probe

pytest.importorskip("debugpy")


class Dap:
    """A minimal Debug Adapter Protocol client: Content-Length framed JSON over a socket."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=15)
        self.buffer = b""
        self.seq = 0
        self.events: List[Dict[str, Any]] = []

    def send(self, command: str, **arguments: Any) -> int:
        self.seq += 1
        body = json.dumps({"seq": self.seq, "type": "request", "command": command, "arguments": arguments}).encode()
        self.sock.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        return self.seq

    def _message(self) -> Dict[str, Any]:
        while b"\r\n\r\n" not in self.buffer:
            self._fill()
        head, _, rest = self.buffer.partition(b"\r\n\r\n")
        length = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0].split(b":")[1])
        while len(rest) < length:
            self.buffer = head + b"\r\n\r\n" + rest
            self._fill()
            head, _, rest = self.buffer.partition(b"\r\n\r\n")
        self.buffer = rest[length:]
        return json.loads(rest[:length])

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise EOFError("debugpy closed the connection")
        self.buffer += chunk

    def response(self, seq: int) -> Dict[str, Any]:
        for i, message in enumerate(self.events):
            if message.get("type") == "response" and message.get("request_seq") == seq:
                return self.events.pop(i)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            message = self._message()
            if message.get("type") == "response" and message.get("request_seq") == seq:
                return message
            self.events.append(message)
        raise TimeoutError("no response to request %d" % seq)

    def event(self, name: str) -> Dict[str, Any]:
        for i, message in enumerate(self.events):
            if message.get("event") == name:
                return self.events.pop(i)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            message = self._message()
            if message.get("event") == name:
                return message
            self.events.append(message)
        raise TimeoutError("no %s event" % name)


@pytest.mark.parametrize("python", ["own", "3.12"])
def test_an_ide_attaches_and_sees_the_threads(target_factory, python):
    if python == "own":
        proc = target_factory("idle.py")
        expected, func = {"MainThread", "loader-0", "heartbeat"}, "main_sleep"
    else:  # a target whose environment lacks debugpy: it gets ours, the way the injector exposes probe
        interpreter = pyenv_python(python)
        if not interpreter:
            pytest.skip("no CPython %s here" % python)
        proc = target_factory("explicit_start.py", python=interpreter, env=target_env(probe=False, PYTHONPATH=REPO))
        expected, func = {"MainThread", "worker-1"}, "<module>"
    client = probe.connect(str(proc.pid))
    if python != "own":
        assert client.eval("import importlib.util; importlib.util.find_spec('debugpy')").value is None
    started = run_cli(str(proc.pid), "debug", "--port", "0")
    assert started.code == 0, started.err
    port = int(started.out.split("127.0.0.1:")[1].split()[0])
    assert '"request": "attach"' in started.out and '"port": %d' % port in started.out
    dap = Dap(port)
    try:
        assert dap.response(dap.send("initialize", adapterID="probe-test", clientID="probe-test",
                                     linesStartAt1=True, columnsStartAt1=True, pathFormat="path"))["success"]
        attach = dap.send("attach", justMyCode=False)
        dap.event("initialized")
        assert dap.response(dap.send("configurationDone"))["success"]
        assert dap.response(attach)["success"]
        threads = dap.response(dap.send("threads"))["body"]["threads"]
        names = {t["name"] for t in threads}
        assert expected <= names, names
        main = [t["id"] for t in threads if t["name"] == "MainThread"][0]
        dap.response(dap.send("pause", threadId=main))
        dap.event("stopped")
        frames = dap.response(dap.send("stackTrace", threadId=main))["body"]["stackFrames"]
        assert func in [f["name"] for f in frames]
        dap.response(dap.send("continue", threadId=main))
        dap.send("disconnect")
    finally:
        dap.sock.close()
    stopped = run_cli(str(proc.pid), "debug", "--stop")
    assert stopped.code == 0 and "stopped" in stopped.out, stopped.err
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    assert client.eval("1 + 1").value == "2"  # the target runs on


def test_debug_is_refused_without_eval_and_off_loopback(target_factory):
    proc = target_factory("idle.py", env=target_env(PROBE_EVAL="0"))
    refused = run_cli(str(proc.pid), "debug", "--port", "0")
    assert refused.code == 4 and "eval is switched off" in refused.err, refused.err
    open_ = run_cli(str(proc.pid), "debug", "--host", "0.0.0.0")
    assert open_.code == 2 and "no authentication" in open_.err and "--insecure" in open_.err


def _port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


_PYDEVD_THREADS = "sorted(type(t).__name__ for t in threading._active.values() if 'PyDB' in type(t).__qualname__)"


def test_debugpy_stops_whole_and_is_not_started_twice_in_a_process(target_factory):
    """After --stop nothing of debugpy listens or waits in the target. A second start in the same process is
    refused: pydevd does not start cleanly twice (after a stop and an interrupted snippet, a second start
    left a thread spinning with the GIL, and the agent answered nothing more)."""
    proc = target_factory("idle.py")
    client = probe.connect(str(proc.pid))
    first = run_cli(str(proc.pid), "debug", "--port", "0")
    assert first.code == 0, first.err
    port = int(first.out.split("127.0.0.1:")[1].split()[0])
    stopped = run_cli(str(proc.pid), "debug", "--stop")
    assert stopped.code == 0 and "debugpy stopped" in stopped.out, stopped.err
    assert _port_is_free(port), "the port is still taken after --stop"
    assert client.eval("import threading; " + _PYDEVD_THREADS).value == "[]"
    assert client.eval("1 + 1", timeout=5).value == "2"
    again = run_cli(str(proc.pid), "debug", "--port", "0", timeout=60)
    assert again.code == 4 and "not started a second time" in again.err, again.err
    assert "one debugpy session per process" in again.err
    assert run_cli(str(proc.pid), "health", timeout=30).code == 0


def _traced_frames(client: Any) -> str:
    """Every frame, of every thread, that still carries one of debugpy's trace functions."""
    return client.eval(
        "import sys\nleft = []\nfor ident, frame in sys._current_frames().items():\n"
        "    while frame is not None:\n"
        "        t = frame.f_trace\n"
        "        if t is not None and 'pydev' in (type(t).__module__ or '') + getattr(t, '__module__', ''):\n"
        "            left.append(frame.f_code.co_name)\n"
        "        frame = frame.f_back\n"
        "left", timeout=10).value


@pytest.mark.parametrize("script", ["idle.py", "grad_loop.py"])
def test_after_an_ide_session_and_a_stop_an_interrupted_snippet_leaves_the_agent_answering(target_factory, script):
    """pydevd traced the agent's threads and left its trace functions on their frames after --stop; a
    snippet that ran past its limit then wedged SQL and backtraces for good (on a torch process above all).
    The agent's threads are never traced now, and a stop clears what pydevd left on any frame."""
    proc = target_factory(script, timeout=60)
    client = probe.connect(str(proc.pid), timeout=20)
    assert client.query_rows("SELECT 1").rows  # the query watchdog's thread exists before debugpy starts
    started = run_cli(str(proc.pid), "debug", "--port", "0")
    assert started.code == 0, started.err
    dap = Dap(int(started.out.split("127.0.0.1:")[1].split()[0]))
    try:
        assert dap.response(dap.send("initialize", adapterID="probe-test", clientID="probe-test"))["success"]
        attach = dap.send("attach", justMyCode=False)
        dap.event("initialized")
        assert dap.response(dap.send("configurationDone"))["success"]
        assert dap.response(attach)["success"]
        threads = {t["name"] for t in dap.response(dap.send("threads"))["body"]["threads"]}
        assert not any(name.startswith("probe-") for name in threads), threads  # the IDE sees the program only
        dap.send("disconnect")
    finally:
        dap.sock.close()
    assert run_cli(str(proc.pid), "debug", "--stop").code == 0
    spun = run_cli(str(proc.pid), "eval", "--eval-timeout", "1", "import time\nwhile True: time.sleep(0.01)", timeout=60)
    assert spun.code == 5 and "interrupted" in spun.err, spun.err
    for _ in range(5):
        answered = run_cli(str(proc.pid), "query", "SELECT count(*) AS n FROM python.backtrace", timeout=60)
        assert answered.code == 0, answered.err
        assert run_cli(str(proc.pid), "backtrace", timeout=60).code == 0
    assert _traced_frames(client) == "[]"


def _as_nobody(port: int) -> bytes:
    """What a process of user nobody gets from debugpy's port: DAP's first request, sent as uid 65534."""
    return run_as(NOBODY, lambda: _first_answer(port))


def _first_answer(port: int) -> bytes:
    body = json.dumps({"seq": 1, "type": "request", "command": "initialize",
                       "arguments": {"adapterID": "probe-test"}}).encode()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)
            return sock.recv(100) or b"<closed>"
    except OSError as exc:
        return ("<%s>" % type(exc).__name__).encode()


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another user needs root")
def test_another_local_user_cannot_reach_debugpy_and_it_stops_by_itself(target_factory):
    proc = target_factory("idle.py")
    started = run_cli(str(proc.pid), "debug", "--port", "0", "--window", "3")
    assert started.code == 0 and "admits only connections from" in started.out, started.err
    port = int(started.out.split("127.0.0.1:")[1].split()[0])
    assert not _as_nobody(port).startswith(b"Content-Length"), "another user got an answer from debugpy"
    assert _first_answer(port).startswith(b"Content-Length")  # the owner still does
    status = probe.connect(str(proc.pid)).eval("from probe.agent import debugger; debugger.status()['refused']")
    assert status.value == "1"
    deadline = time.monotonic() + scaled(20)
    while not _port_is_free(port):  # no IDE attached for 3 s: it stops listening by itself
        assert time.monotonic() < deadline, "debugpy still listens long after its window"
        time.sleep(0.2)
    assert run_cli(str(proc.pid), "health", timeout=30).code == 0


def test_a_port_in_use_is_refused_at_once_and_the_agent_serves_on(target_factory):
    """debugpy, asked for a taken port, waits for ever with the agent's request thread inside: refused
    before it is asked, with a hint that works."""
    proc = target_factory("idle.py")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        refused = run_cli(str(proc.pid), "debug", "--port", str(port), timeout=30)
        assert refused.code == 2 and "port %d on 127.0.0.1 is in use" % port in refused.err, refused.err
        assert "--port 0 for any free one" in refused.err
        followed = run_cli(str(proc.pid), "debug", "--port", "0", timeout=30)
        assert followed.code == 0 and "debugpy listens" in followed.out, followed.err
    assert run_cli(str(proc.pid), "debug", "--stop").code == 0
    assert probe.connect(str(proc.pid)).eval("1 + 1").value == "2"


def test_after_debug_stops_the_agent_still_answers_once_a_snippet_is_interrupted(target_factory):
    """debugpy traced every thread that existed when it started, and its stop untraced only its own: the
    agent's threads kept calling a debugger that was gone, and after an interrupted snippet the agent
    answered nothing more (its accept thread spun)."""
    proc = target_factory("idle.py")
    assert run_cli(str(proc.pid), "debug", "--port", "0").code == 0
    assert run_cli(str(proc.pid), "debug", "--stop").code == 0
    client = probe.connect(str(proc.pid), timeout=10)
    box: Dict[str, Any] = {}
    spinner = threading.Thread(target=lambda: box.setdefault("r", client.eval("while True: pass", eval_id="spin-9",
                                                                             timeout=20)))
    spinner.start()
    running = ("import sys, threading; me = threading.get_ident(); sum(1 for i, f in sys._current_frames().items() "
               "if i != me and f.f_code.co_filename == '<probe-eval>')")
    deadline = time.monotonic() + 10
    while client.eval(running).value != "1":  # interrupted once it runs
        assert time.monotonic() < deadline, "the snippet never started"
        time.sleep(0.05)
    assert client.interrupt_eval("spin-9") == "interrupted"
    spinner.join(15)
    assert "EvalInterrupted" in (box["r"].error or "")
    answered = run_cli(str(proc.pid), "health", timeout=15)
    assert answered.code == 0 and str(proc.pid) in answered.out, answered.err
