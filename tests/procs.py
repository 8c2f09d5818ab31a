"""Real target processes for the tests: start, handshake, and always kill and reap.

A target script prints ``READY <pid>`` on stdout once it is in the state under test; :func:`spawn`
waits for that line (bounded), never for a fixed time.
"""

import os
import select
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
TARGETS = os.path.join(HERE, "targets")
REPO = os.path.dirname(HERE)
PYENV = "/root/.pyenv/versions"


def _base_scale() -> float:
    """How much slower than a quiet developer machine this one is taken to be: ``PROBE_TEST_SCALE`` when
    set, else 2 on a machine of two cores or fewer (CI's), else 1."""
    try:
        return max(0.1, float(os.environ["PROBE_TEST_SCALE"]))
    except (KeyError, ValueError):
        return 2.0 if (os.cpu_count() or 1) <= 2 else 1.0


BASE_SCALE = _base_scale()


def scaled(seconds: float) -> float:
    """``seconds`` stretched to this machine and its load now: a start-up wait is a bound, not a figure,
    and a torch import takes 20 s and more on a loaded 2-core box. Failing late costs only time; a wait
    ends at once when the process it waits for exits."""
    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        load = 1.0
    return seconds * BASE_SCALE * min(3.0, max(1.0, load))


def pyenv_python(version: str) -> str:
    """The interpreter of CPython ``version`` ("3.12") installed by pyenv, or "" when there is none."""
    if os.path.isdir(PYENV):
        for name in sorted(os.listdir(PYENV)):
            if name == version or name.startswith(version + "."):
                path = os.path.join(PYENV, name, "bin", "python" + version)
                if os.path.exists(path):
                    return path
    return ""


@dataclass
class Proc:
    popen: subprocess.Popen
    script: str
    lines: List[str] = field(default_factory=list)
    _pending: bytearray = field(default_factory=bytearray)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def read_line(self, timeout: float = 10.0) -> str:
        """The next stdout line of the target (bounded wait, ``timeout`` scaled to the machine).

        Reads the pipe's file descriptor directly into our own buffer: select() on a buffered stream
        misses lines already sitting in the stream's buffer.
        """
        timeout = scaled(timeout)
        deadline = time.monotonic() + timeout
        assert self.popen.stdout is not None
        fd = self.popen.stdout.fileno()
        while b"\n" not in self._pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("%s printed no line within %.1f s" % (self.script, timeout))
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                self.popen.wait(5)
                err = self.popen.stderr.read().decode("utf-8", "replace") if self.popen.stderr else ""
                raise RuntimeError("%s exited (code %s) before printing the line: %s"
                                   % (self.script, self.popen.returncode, err[-2000:]))
            self._pending.extend(chunk)
        line, _, rest = bytes(self._pending).partition(b"\n")
        self._pending[:] = rest
        return line.decode("utf-8", "replace")

    def kill(self) -> None:
        stop(self.popen)


def target_env(probe: bool = True, **extra: str) -> Dict[str, str]:
    # The suite's own runtime directory (set in conftest) is kept; every other PROBE variable is the test's.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROBE") or k == "PROBE_RUNTIME_DIR"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    if probe:
        env["PROBE"] = "1"
    # The suite's tests of SQL in the agent (its limits, interrupts, memory guard, audit trail, the fan-out
    # through node helpers) keep DuckDB there; by default an agent leaves such queries to the client
    # (tests/test_sql_placement.py, which passes PROBE_SQL_IN_AGENT="").
    # PROBE_TEST_SQL_IN_AGENT= (empty) runs the suite's targets as users get them, to see what else depends on it.
    env["PROBE_SQL_IN_AGENT"] = os.environ.get("PROBE_TEST_SQL_IN_AGENT", "1")
    env.update(extra)
    return env


def spawn(script: str, args: Sequence[str] = (), env: Optional[Dict[str, str]] = None, probe: bool = True,
          python: str = sys.executable, timeout: float = 30.0, wait_socket: bool = True) -> Proc:
    """Start ``tests/targets/<script>`` and wait for its ``READY`` line (and its agent socket)."""
    path = os.path.join(TARGETS, script)
    popen = subprocess.Popen([python, path, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=env if env is not None else target_env(probe))
    proc = Proc(popen, script)
    try:
        line = proc.read_line(timeout)
        while not line.startswith("READY"):
            proc.lines.append(line)
            line = proc.read_line(timeout)
        if probe and wait_socket:
            wait_for_socket(popen.pid, timeout)
    except BaseException:
        stop(popen)
        raise
    return proc


@contextmanager
def running(script: str, *args: str, **kwargs: object) -> Iterator[Proc]:
    """A target for a ``with`` block (or a module-scoped fixture): started, then always killed and reaped."""
    proc = spawn(script, args, **kwargs)  # type: ignore[arg-type]
    try:
        yield proc
    finally:
        proc.kill()


def crash_record_of(directory: str, pid: int) -> str:
    """The name of ``pid``'s crash record in runtime directory ``directory`` ("" while there is none)."""
    return next((n for n in os.listdir(directory) if n.startswith("%d-" % pid) and n.endswith(".crash")), "")


def die_with_record(directory: str, script: str, args: Sequence[str], how: Optional[int] = None) -> Proc:
    """Run ``script`` with an agent whose runtime directory is ``directory``, wait until its crash record
    is armed, then end it (``how``: a signal; None: it ends by itself). Returns the reaped process."""
    proc = spawn(script, args, env=target_env(PROBE_RUNTIME_DIR=str(directory)), wait_socket=False)
    try:
        deadline = time.monotonic() + scaled(10)
        while not crash_record_of(str(directory), proc.pid):
            assert time.monotonic() < deadline, "no crash record armed"
            time.sleep(0.05)
        if how is not None:
            os.kill(proc.pid, how)
        proc.popen.wait(scaled(20))
    finally:
        proc.kill()
    return proc


def wait_for_socket(pid: int, timeout: float = 10.0) -> str:
    from probe import _paths

    path = _paths.socket_path(pid)
    timeout = scaled(timeout)
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError("no agent socket %s after %.1f s" % (path, timeout))
        time.sleep(0.01)
    return path


def stop(popen: subprocess.Popen) -> None:
    """Terminate, then kill, and always reap."""
    if popen.poll() is None:
        try:
            popen.send_signal(signal.SIGTERM)
            popen.wait(5)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(5)
    for stream in (popen.stdout, popen.stderr):
        if stream:
            stream.close()


@dataclass
class CliResult:
    code: int
    out: str
    err: str


def run_cli(*args: str, input: Optional[str] = None, timeout: float = 60.0, env: Optional[Dict[str, str]] = None) -> CliResult:
    """Run the real ``probe`` command (``python -m probe``) and capture everything."""
    done = subprocess.run([sys.executable, "-m", "probe", *args], capture_output=True, text=True, input=input,
                          timeout=timeout, env=env if env is not None else target_env(probe=False), cwd=REPO)
    return CliResult(done.returncode, done.stdout, done.stderr)
