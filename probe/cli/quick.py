"""``probe PID backtrace`` at the speed of a compiled tool: the plain command line, answered by the process's
agent at once, taken before the rest of the CLI is imported.

py-spy dumps a small process in about 9 ms; a Python interpreter starts in about as much, and ``probe.cli.fast``
(click-free) still imports some twenty modules of the client (typing, threading, the client's records and
its error words), which took longer than the whole of py-spy. So the one command line people time against
py-spy, ``probe PID backtrace`` (the pid as digits, nothing else, no probe variable in the environment that
the CLI reads), is tried here first, with the standard library's C modules and three small modules of
probe's own (``probe._paths``, ``probe.errors``, ``probe.cli.render_stack``):

* the agent's socket is found, and its stale neighbours cleared, as the client does (``probe._paths``);
* no socket: py-spy's read of the process starts at once (``probe.reader.ahead``), and the client's own
  words for a failed connect (``probe.client.explain``, without the rest of the client) say why no agent
  answers; where they mark a live process without agent, its stacks, read from outside, are printed with
  them (the usual path's output, byte for byte), else the usual path runs;
* a socket whose heartbeat is late, a full backlog, or any failure to connect: nothing was sent, and the
  usual path runs (which reads from outside, explains, waits);
* the request sent is the one the client sends; an answer within the client's grace time (``GRACE_S``)
  that is a 200 with a bounded body is printed as the usual path prints it (``render_stack``, the same
  bytes: tests compare both);
* no answer within that grace: the socket, request sent, is handed to the usual path
  (``probe.client.connection.hand_over``), which watches the process from there as it would have;
* any other answer (an error, something that is not an agent's): the usual path asks again and says why.

Nothing here weakens what the client checks: the socket is the one ``probe._paths`` finds (in the runtime
directory the user alone may enter), and the agent checks its peer's uid as for every request.
"""

from __future__ import annotations

import io
import os
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, List, Optional

__all__ = ["run", "ENVIRONMENT", "GRACE_S"]

GRACE_S = 0.05
"""How long the agent may take before the usual path's watch of the process takes over (= outside.GRACE_S)."""
STALE_S = 0.45
"""A heartbeat older than this sends the command to the usual path before connecting (= connection._STALE_S)."""
TIMEOUT_S = 30.0
"""The client's wait for a whole answer when no --timeout is given (= connection.DEFAULT_TIMEOUT)."""
MAX_BODY = 64 << 20
"""A larger answer is left to the usual path (it reads up to 256 MiB, within its bound on answers in flight)."""
ENVIRONMENT = ("PROBE_TOKEN", "PROBE_TOKEN_FILE", "PROBE_VIA", "PROBE_CACERT", "PROBE_CERT", "PROBE_KEY")
"""The variables the CLI's options read (``probe.cli.spec.GLOBAL_PARAMS``; a test keeps the two the same): with
any set, the usual path reads the command line. ``PROBE_CLI_FAST=0`` sends every command line there too."""


class _Frame:
    """One frame of the answer, with the attributes ``render_backtrace`` reads (``probe.client.results.Frame``'s)."""

    __slots__ = ("thread_id", "thread_name", "native_id", "is_main", "depth", "func", "file", "lineno", "code")
    frame_type = "python"

    def __init__(self, *values: Any) -> None:
        (self.thread_id, self.thread_name, self.native_id, self.is_main, self.depth, self.func, self.file,
         self.lineno, self.code) = values


def run(args: List[str]) -> Optional[int]:
    """The exit code of ``probe PID backtrace`` answered here; None where the usual path must run (nothing
    was printed; a request may have been handed to it)."""
    if len(args) != 2 or args[1] != "backtrace" or not (args[0].isascii() and args[0].isdigit()):
        return None
    if os.environ.get("PROBE_CLI_FAST") == "0" or any(os.environ.get(name) for name in ENVIRONMENT):
        return None
    from probe import _paths

    pid = int(args[0])
    path = _paths.find_socket_path(pid)
    if _paths.runtime_dir_problem(os.path.dirname(path)):  # the usual path says what is wrong with it
        return None
    _paths.remove_stale_files(keep=(pid,))  # as every command given a pid does
    try:
        age = time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        # no agent: its stacks are read from outside, and a line says why
        from probe.reader import memory

        threads = memory.read_threads(pid, os.path.dirname(path))
        if threads is None:
            _read_ahead(pid)  # py-spy's read, which the usual path's will take
        elif _own_read(pid, path, threads) is not None:
            return 0
        return _outside(pid, args[0], path)
    except OSError:
        return None
    if age > STALE_S:
        return None
    sock = _send(path)
    if sock is None:
        return None
    import select

    try:
        readable, _, _ = select.select([sock], [], [], GRACE_S)
    except BaseException:
        sock.close()
        raise
    if not readable:
        from probe.client.connection import hand_over

        hand_over(sock, path, "GET", "/v1/backtrace")
        return None
    raw = _answer(sock)
    if raw is None:
        return None
    from probe.cli.render_stack import render_backtrace

    try:
        frames = [_Frame(thread_id, name, native_id, bool(is_main), depth, *raw["frames"][position])
                  for thread_id, name, native_id, is_main, chain in raw["threads"]
                  for depth, position in enumerate(chain)]
        text = "\n".join(render_backtrace(frames))
    except (KeyError, TypeError, ValueError, IndexError):
        return None  # not an agent's answer: the usual path asks again, and says so
    _say(text)
    return 0


def _own_read(pid: int, path: str, threads: List[Any]) -> Optional[int]:
    """``probe PID backtrace`` of a process with no agent socket in the plain case (``probe.reader.agentless``:
    the client would only say that no agent runs there), with the stacks read from its memory
    (``probe.reader.memory``, which the usual path's ``probe.reader.live`` reads first too): the usual path's
    note and stacks, byte for byte. None where the case is not plain (the usual path explains)."""
    from probe.reader import agentless, memory

    if not agentless.plain(pid, path):
        return None
    from probe.cli.render_stack import render_backtrace
    from probe.reader.lines import getline

    frames = [_Frame(ident, name, native, is_main, depth, func, file, line, _code(getline, file, line))
              for native, ident, name, is_main, stack in threads if not name.startswith("probe-")
              for depth, (func, file, line) in enumerate(stack)]
    text = "\n".join(render_backtrace(frames))
    _say("probe: %s\n  %s\n  stacks %s" % (agentless.MESSAGE % pid, agentless.HINT % pid, memory.SOURCE), err=True)
    _say(text)
    return 0


def _code(getline: Any, file: str, line: int) -> Optional[str]:
    """A frame's source line as ``probe.reader.stacks`` shows it (stripped; None where there is none)."""
    if line <= 0:
        return None
    try:
        return getline(file, line).strip() or None
    except (OSError, ValueError):
        return None


def _read_ahead(pid: int) -> None:
    """Start py-spy's read of ``pid`` now, which the usual path would start once it has imported what it needs
    to say why no agent answers (``probe.reader.ahead``): only for a running Python process of this user, whose
    read the usual path certainly makes, and as it makes it (``pyspy_source``, the process not stopped)."""
    from probe.reader import ahead

    try:
        if os.stat("/proc/%d" % pid).st_uid != os.geteuid():
            return
        if not os.path.basename(os.readlink("/proc/%d/exe" % pid)).startswith("python"):
            return
        with open("/proc/%d/stat" % pid, "rb") as handle:
            stat = handle.read()
        if stat[stat.rindex(b")") + 2:][:1] not in (b"R", b"S", b"D"):  # stopped, traced, dying: left to it
            return
        exe = ahead.which("py-spy")
        if exe is not None:
            ahead.start(ahead.dump_argv(exe, pid))
    except (OSError, ValueError):
        return


def _outside(pid: int, label: str, path: str) -> Optional[int]:
    """``probe PID backtrace`` of a process with no agent socket, as the usual path runs it (the client's
    ``backtrace``, its connect failing): the error the client makes of the failed connect
    (``probe.client.explain``), and where that marks a live process that runs no agent, its stacks read from
    outside and printed with the note on stderr. Anything else (another error, no stacks) is left to the usual
    path, which says it in its words."""
    from probe.client.explain import explain
    from probe.client.fallback import frames_of, note_for, outside_stacks
    from probe.client.targets import Target
    from probe.client.transport import UnixAddress
    from probe.errors import ConnectError

    address = UnixAddress(path)
    try:
        try:
            os.stat(path)
        except FileNotFoundError:  # as transport's failed connect: the ConnectError's context is this
            raise ConnectError("no agent at %s (no such socket)" % (address,)) from None
    except ConnectError as refused:
        error = explain(Target(label, address, pid), refused)
    else:
        return None  # an agent's socket since: the usual path asks it
    if getattr(error, "agentless_pid", None) is None:
        return None
    stacks = outside_stacks(error, agentless=True)
    if stacks is None:
        return None
    from probe.cli.render_stack import render_backtrace

    text = "\n".join(render_backtrace(frames_of(stacks)))
    _say("probe: " + str(note_for(error, stacks)), err=True)
    _say(text)
    return 0


def _send(path: str) -> Any:
    """A unix socket connected to ``path`` with the request sent (as ``probe.client.transport`` sends it);
    None where the connect failed or would wait (a full backlog), nothing sent."""
    import _socket

    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.connect(path)  # unix: completes at once, or EAGAIN when the backlog is full
        sock.settimeout(TIMEOUT_S)
        sock.sendall(b"GET /v1/backtrace HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
    except OSError:
        sock.close()
        return None
    except BaseException:
        sock.close()
        raise
    return sock


def _answer(sock: Any) -> Any:
    """The JSON body of a 200 answer read whole within ``TIMEOUT_S``, or None (anything else, which the usual
    path asks for again and explains); closes ``sock``."""
    deadline = time.monotonic() + TIMEOUT_S
    try:
        buf = b""
        end = -1
        while end < 0:
            chunk = _recv(sock, 65536, deadline)
            if not chunk or len(buf) > 65536:
                return None
            buf += chunk
            end = buf.find(b"\r\n\r\n")
        lines = buf[:end].decode("latin-1").split("\r\n")
        if lines[0].split(" ", 2)[:2] != ["HTTP/1.1", "200"]:
            return None
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = headers.get("content-length", "")
        if not (length.isascii() and length.isdigit() and len(length) <= 12) or int(length) > MAX_BODY:
            return None
        body = bytearray(buf[end + 4:end + 4 + int(length)])
        while len(body) < int(length):
            chunk = _recv(sock, min(1 << 20, int(length) - len(body)), deadline)
            if not chunk:
                return None
            body += chunk
    except OSError:  # a timeout too
        return None
    finally:
        sock.close()
    try:
        raw = _loads(body.decode("utf-8"))
    except Exception:  # not JSON (ValueError, StopIteration from the scanner, RecursionError): not an agent's
        return None
    return raw if isinstance(raw, dict) else None


class _Decoding:
    """What ``json.loads`` gives the C scanner: its settings, none changed."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int

    @staticmethod
    def parse_constant(name: str) -> float:
        return {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}[name]


def _loads(text: str) -> Any:
    """``json.loads(text)`` by the C scanner it runs on, without importing the json package (its encoder and
    decoder modules cost some 2 ms); by ``json.loads`` itself where the interpreter has no such scanner."""
    try:
        from _json import make_scanner
    except ImportError:
        import json

        return json.loads(text)
    blank = " \t\n\r"
    value, end = make_scanner(_Decoding)(text, len(text) - len(text.lstrip(blank)))
    if text[end:].strip(blank):
        raise ValueError("extra data after the JSON value")
    return value


def _recv(sock: Any, size: int, deadline: float) -> bytes:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("past the deadline")
    sock.settimeout(left)
    return bytes(sock.recv(size))


def _say(text: str, err: bool = False) -> None:
    """``probe.cli.output.say(text, err)``: control characters made visible, and written as it is on a plain
    text stream whose encoding is no ASCII; anything else is left to ``say`` itself (which leaves it to click)."""
    stream = sys.stderr if err else sys.stdout
    if stream is not None and type(stream) is io.TextIOWrapper and not _ascii(stream.encoding):
        from probe.cli.render_stack import visible

        stream.write(visible(text, lines=True) + "\n")
        stream.flush()
        return
    from probe.cli.output import say

    say(text, err=err)


def _ascii(encoding: Optional[str]) -> bool:
    import codecs

    try:
        return codecs.lookup(encoding or "ascii").name == "ascii"
    except LookupError:
        return False
