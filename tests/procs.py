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
        """The next stdout line of the target (bounded wait).

        Reads the pipe's file descriptor directly into our own buffer: select() on a buffered stream
        misses lines already sitting in the stream's buffer.
        """
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
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROBE")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    if probe:
        env["PROBE"] = "1"
    env.update(extra)
    return env


def spawn(script: str, args: Sequence[str] = (), env: Optional[Dict[str, str]] = None, probe: bool = True,
          python: str = sys.executable, timeout: float = 20.0, wait_socket: bool = True) -> Proc:
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


def wait_for_socket(pid: int, timeout: float = 10.0) -> str:
    from probe import _paths

    path = _paths.socket_path(pid)
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
