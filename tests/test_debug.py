"""probe T debug: debugpy in the target, spoken to over DAP by a real client; gated like eval."""

import json
import socket
import threading
import time
from typing import Any, Dict, List

import pytest

from procs import REPO, pyenv_python, run_cli, target_env

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


def test_debugpy_stops_whole_and_starts_again_on_the_same_port_or_another(target_factory):
    """After --stop nothing of debugpy listens or waits in the target, and a new start listens where asked
    (pydevd kept the first session's port, and its accept thread listened again on the stopped socket)."""
    proc = target_factory("idle.py")
    client = probe.connect(str(proc.pid))
    first = run_cli(str(proc.pid), "debug", "--port", "0")
    assert first.code == 0, first.err
    port = int(first.out.split("127.0.0.1:")[1].split()[0])
    for attempt in ("the same port", "any port"):
        stopped = run_cli(str(proc.pid), "debug", "--stop")
        assert stopped.code == 0 and "debugpy stopped" in stopped.out, stopped.err
        assert _port_is_free(port), "the port is still taken after --stop"
        assert client.eval("import threading; " + _PYDEVD_THREADS).value == "[]"
        again = run_cli(str(proc.pid), "debug", "--port", str(port) if attempt == "the same port" else "0",
                        timeout=30)
        assert again.code == 0 and "debugpy listens" in again.out, (attempt, again.err)
        port = int(again.out.split("127.0.0.1:")[1].split()[0])
        dap = Dap(port)
        try:
            assert dap.response(dap.send("initialize", adapterID="probe-test", clientID="probe-test"))["success"]
        finally:
            dap.sock.close()
    assert run_cli(str(proc.pid), "debug", "--stop").code == 0


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
