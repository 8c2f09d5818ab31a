"""The agent's file descriptors: it never acts on a number that is no longer its own (a program that closes
what it does not know and opens its own there), and a process started with 0-2 closed does not get the
agent's socket or crash record as its stdout or stderr."""

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from procs import TARGETS, Proc, run_cli, scaled, stop, target_env, wait_for_socket

from probe import _paths


def _ask_program(path: str) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(scaled(10))
        client.connect(path)
        chunks = []
        while True:
            chunk = client.recv(4096)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def _until(check, timeout: float, what: str):
    deadline = time.monotonic() + scaled(timeout)
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.1)
    raise AssertionError("%s within %.0f s; last: %r" % (what, scaled(timeout), last))


def test_a_program_that_closes_the_agents_fds_keeps_its_own_connections_and_files(tmp_path):
    path = str(tmp_path / "program.sock")  # the program listens at .0 and .1
    data = tmp_path / "data"
    data.mkdir()
    env = target_env(PROBE_LISTEN="127.0.0.1:0")
    popen = subprocess.Popen([sys.executable, os.path.join(TARGETS, "closes_fds.py"), path, str(data)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc = Proc(popen, "closes_fds.py")
    try:
        assert proc.read_line(30).startswith("READY")
        wait_for_socket(popen.pid)
        assert run_cli(str(popen.pid), "health").code == 0
        record = [n for n in os.listdir(_paths.runtime_dir()) if n.startswith("%d-" % popen.pid)]
        assert len(record) == 1 and record[0].endswith(".crash"), record

        popen.stdin.write(b"close\n")
        popen.stdin.flush()
        serving = proc.read_line(10)
        assert serving.startswith("SERVING"), serving

        # Every client of the program's sockets is the program's: none is taken by the agent.
        count = int(serving.split()[1])
        assert count == 2, serving  # the agent's unix and TCP numbers both went to listening sockets of the program
        paths = ["%s.%d" % (path, i) for i in range(count)] * 15
        with ThreadPoolExecutor(len(paths)) as pool:  # at once: they wait in the backlogs together
            answers = list(pool.map(_ask_program, paths))
        assert answers == [b"PROGRAM\n"] * len(paths), answers

        # The agent listens again on sockets of its own (unix and TCP), and answers.
        _until(lambda: run_cli(str(popen.pid), "health").code == 0, 10, "the agent answering on its unix socket again")
        fds = {int(n): os.readlink("/proc/%d/fd/%s" % (popen.pid, n)) for n in os.listdir("/proc/%d/fd" % popen.pid)}
        assert sum(1 for t in fds.values() if t.startswith("socket:")) >= 3, fds  # the program's, and the agent's two
        assert any(t.endswith(".crash") for t in fds.values()), fds  # the crash record, open again

        # An uncaught exception goes to the crash record, not into a file of the program's that took its number.
        popen.stdin.write(b"raise\n")
        popen.stdin.flush()
        popen.wait(scaled(10))
        for name in os.listdir(data):
            assert (data / name).read_bytes() == b"", name
        crash = open(os.path.join(_paths.runtime_dir(), record[0]), encoding="utf-8").read()
        assert "the program's own error" in crash, crash
    finally:
        stop(popen)
        if popen.stdin:
            popen.stdin.close()


def test_a_process_started_with_stdio_closed_gets_neither_socket_nor_record_as_stdio(tmp_path):
    marker = tmp_path / "ready"
    code = ("import os, signal, time\n"
            "def wrote(*_):\n"
            "    for fd in (1, 2):\n"
            "        try:\n"
            "            os.write(fd, b'the program wrote on fd %%d\\n' %% fd)\n"
            "        except OSError:\n"
            "            pass\n"
            "signal.signal(signal.SIGUSR1, wrote)\n"
            "open(%r, 'w').close()\n"
            "while True:\n"
            "    time.sleep(0.1)\n" % str(marker))
    popen = subprocess.Popen(["bash", "-c", 'exec "$0" -c "$1" <&- >&- 2>&-', sys.executable, code],
                             env=target_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        _until(lambda: marker.exists(), 30, "the target started")
        wait_for_socket(popen.pid)
        stdio = {fd: os.readlink("/proc/%d/fd/%d" % (popen.pid, fd)) for fd in (0, 1, 2)
                 if os.path.lexists("/proc/%d/fd/%d" % (popen.pid, fd))}
        assert all(t == "/dev/null" for t in stdio.values()), stdio
        os.kill(popen.pid, signal.SIGUSR1)
        time.sleep(0.5)
        assert run_cli(str(popen.pid), "health").code == 0
        for name in os.listdir(_paths.runtime_dir()):
            if name.startswith("%d-" % popen.pid) and name.endswith(".crash"):
                text = open(os.path.join(_paths.runtime_dir(), name), encoding="utf-8", errors="replace").read()
                assert "wrote on fd 2" not in text, text
    finally:
        stop(popen)
