"""A pseudo-terminal for the CLI's interactive behaviour: width, progress lines, Ctrl-C typed for real."""

import fcntl
import os
import pty
import select
import signal
import struct
import sys
import termios
import time
from typing import Callable, Dict, List, Optional, Tuple

from procs import REPO, target_env

__all__ = ["run_in_pty", "has_socket", "sockets", "Terminal"]


def run_in_pty(args: List[str], columns: int = 80, when: Optional[Callable[[int], bool]] = None,
               timeout: float = 30.0, env: Optional[Dict[str, str]] = None) -> Tuple[int, str, int]:
    """Run ``probe ARGS`` on a pseudo-terminal ``columns`` wide; once ``when(its pid)`` is true, type Ctrl-C.

    Returns (exit status, everything written to the terminal, the CLI's pid)."""
    environ = dict(env if env is not None else target_env(probe=False))
    environ.pop("COLUMNS", None)
    pid, fd = pty.fork()
    if pid == 0:  # the child: the CLI, with the terminal as its controlling terminal
        try:
            fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
            os.chdir(REPO)
            os.execve(sys.executable, [sys.executable, "-m", "probe", *args], environ)
        finally:
            os._exit(127)
    out = b""
    sent = False
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if when is not None and not sent and when(pid):
                os.write(fd, b"\x03")
                sent = True
            ready, _, _ = select.select([fd], [], [], 0.05)
            if ready:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
        else:
            raise AssertionError("probe %s did not end within %.0f s: %r" % (args, timeout, out[-500:]))
    finally:
        if time.monotonic() >= deadline:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    return os.waitstatus_to_exitcode(status), out.decode("utf-8", "replace").replace("\r\n", "\n"), pid


def has_socket(pid: int) -> bool:
    """True once process ``pid`` holds a socket: the CLI has sent its request (the handshake for Ctrl-C)."""
    try:
        return any(os.readlink("/proc/%d/fd/%s" % (pid, fd)).startswith("socket:")
                   for fd in os.listdir("/proc/%d/fd" % pid))
    except OSError:
        return False


def sockets(pid: int) -> int:
    """How many sockets process ``pid`` holds (0 once it is gone)."""
    try:
        return sum(os.readlink("/proc/%d/fd/%s" % (pid, fd)).startswith("socket:") for fd in os.listdir("/proc/%d/fd" % pid))
    except OSError:
        return 0


class Terminal:
    """``probe ... repl`` on the child side of a pty; everything it prints is collected here."""

    def __init__(self, args, home: str, env: Optional[Dict[str, str]] = None) -> None:
        env = dict(env if env is not None else target_env(probe=False), HOME=str(home), TERM="dumb")
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: becomes the REPL
            os.chdir(REPO)
            os.execve(sys.executable, [sys.executable, "-m", "probe", *args, "repl"], env)
        self.seen = ""

    def expect(self, text: str, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError("%r not printed within %.0f s; the terminal shows:\n%s" % (text, timeout, self.seen))
            ready, _, _ = select.select([self.fd], [], [], remaining)
            if ready:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:  # the child is gone
                    chunk = b""
                if not chunk:
                    raise AssertionError("the REPL exited before printing %r:\n%s" % (text, self.seen))
                self.seen += chunk.decode("utf-8", "replace")
        index = self.seen.index(text) + len(text)
        taken, self.seen = self.seen[:index], self.seen[index:]
        return taken

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait_exit(self, timeout: float = 10.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.pid = 0
                return os.waitstatus_to_exitcode(status)
            try:
                os.read(self.fd, 65536) if select.select([self.fd], [], [], 0.05)[0] else None
            except OSError:
                pass
        raise AssertionError("the REPL did not exit within %.0f s" % timeout)

    def close(self) -> None:
        if self.pid:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.fd)
