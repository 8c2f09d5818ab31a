"""One HTTP/1.1 request over a unix socket or TCP, on a plain socket.

The CLI's start-up time is part of every command's latency, and ``http.client`` alone costs ~20 ms of
imports; the agent speaks a small, strict subset of HTTP (one request per connection,
``Content-Length`` bodies), so a small client suffices. Its records are NamedTuples rather than
dataclasses for the same reason (defining a frozen dataclass costs ~0.8 ms at import, a NamedTuple
~0.1 ms). Socket errors become :class:`ConnectError` or
:class:`Timeout` that name the target and what was waited for.
"""

import socket
import time
from typing import Dict, NamedTuple, Optional, Tuple, Union

from probe.errors import ConnectError, Timeout

__all__ = ["UnixAddress", "TcpAddress", "Address", "HttpResponse", "QueueFull", "request", "send_request", "read_response"]

MAX_RESPONSE_BYTES = 1024 * 1024 * 1024


class UnixAddress(NamedTuple):
    path: str

    def __str__(self) -> str:
        return "unix:%s" % self.path


class TcpAddress(NamedTuple):
    host: str
    port: int

    def __str__(self) -> str:
        return "%s:%d" % (self.host, self.port)


Address = Union[UnixAddress, TcpAddress]


class HttpResponse(NamedTuple):
    status: int
    headers: Dict[str, str]
    body: bytes


class QueueFull(socket.timeout):
    """The agent's listen backlog is full: it has not accepted connections for a while (it cannot run, or
    every slot is taken). A unix socket refuses such a connect at once (EAGAIN) instead of queueing it."""


def _connect(address: Address, timeout: float, queue_wait: Optional[float] = None) -> socket.socket:
    """A connected socket. ``queue_wait``: how long to keep trying while a unix agent's backlog is full
    (default: the whole ``timeout``); past it, :class:`QueueFull`. A unix connect never blocks: one that
    would wait on a full backlog is refused at once and retried here, so the wait stays ours to bound."""
    if isinstance(address, UnixAddress):
        deadline = time.monotonic() + (timeout if queue_wait is None else min(queue_wait, timeout))
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                sock.connect(address.path)  # unix: completes at once, or EAGAIN when the backlog is full
                sock.settimeout(timeout)
                return sock
            except BlockingIOError:
                sock.close()
                if time.monotonic() >= deadline:
                    raise QueueFull("the agent's connection queue stayed full") from None
                time.sleep(0.01)
            except BaseException:
                sock.close()
                raise
    sock = socket.create_connection((address.host, address.port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def request(address: Address, method: str, path: str, body: Optional[bytes] = None,
            headers: Optional[Dict[str, str]] = None, timeout: float = 30.0) -> HttpResponse:
    """Send one request and read the whole response; ``timeout`` bounds every socket operation."""
    sock = send_request(address, method, path, body, headers, timeout)
    return read_response(sock, address, timeout)


def send_request(address: Address, method: str, path: str, body: Optional[bytes] = None,
                 headers: Optional[Dict[str, str]] = None, timeout: float = 30.0,
                 queue_wait: Optional[float] = None) -> socket.socket:
    """Connect and send one request; the caller waits for the answer (``read_response``), or closes
    the socket to give up on it (the agent then runs nothing for it). ``queue_wait``: see ``_connect``;
    :class:`QueueFull` passes through to a caller that set it."""
    host = address.host if isinstance(address, TcpAddress) else "localhost"
    lines = ["%s %s HTTP/1.1" % (method, path), "Host: %s" % host, "Connection: close",
             "Content-Length: %d" % len(body or b"")]
    if body:
        lines.append("Content-Type: application/json")
    lines.extend("%s: %s" % item for item in (headers or {}).items())
    payload = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")
    try:
        sock = _connect(address, timeout, queue_wait)
    except QueueFull:
        if queue_wait is not None:
            raise
        raise Timeout("%s accepted no connection within %.1f s: its queue of connections is full" % (address, timeout),
                      hint="the agent cannot run (see `probe list`), or is overwhelmed; retry later") from None
    except FileNotFoundError:
        raise ConnectError("no agent at %s (no such socket)" % (address,)) from None
    except ConnectionRefusedError:
        raise ConnectError("no agent at %s (connection refused)" % (address,)) from None
    except socket.timeout:
        raise Timeout("connecting to %s timed out after %.1f s" % (address, timeout)) from None
    except OSError as exc:
        raise ConnectError("cannot connect to %s: %s" % (address, exc.strerror or exc)) from None
    try:
        sock.sendall(payload)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the agent answered before it read all of the request (e.g. 413): read that answer
    except socket.timeout:
        sock.close()
        raise Timeout("sending to %s timed out after %.1f s" % (address, timeout)) from None
    except OSError as exc:
        sock.close()
        raise ConnectError("connection to %s failed: %s" % (address, exc.strerror or exc)) from None
    except BaseException:
        sock.close()
        raise
    return sock


def read_response(sock: socket.socket, address: Address, timeout: float) -> HttpResponse:
    """The whole answer to the request sent on ``sock``; closes ``sock``."""
    try:
        sock.settimeout(timeout)
        return _read_response(sock, address, timeout)
    except socket.timeout:
        raise Timeout("no answer from %s within %.1f s" % (address, timeout),
                      hint="the agent may be busy; retry with a larger --timeout") from None
    except OSError as exc:
        raise ConnectError("connection to %s failed: %s" % (address, exc.strerror or exc)) from None
    finally:
        sock.close()


def _read_response(sock: socket.socket, address: Address, timeout: float) -> HttpResponse:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectError("%s closed the connection without an answer" % (address,))
        buf += chunk
        if len(buf) > 65536 and b"\r\n\r\n" not in buf:
            raise ConnectError("%s sent an oversized response header" % (address,))
    head, _, rest = buf.partition(b"\r\n\r\n")
    status, headers = _parse_head(head, address)
    # The agent always sends Content-Length: without it an answer cut short could pass for a whole one.
    raw_length = headers.get("content-length", "")
    if not (raw_length.isascii() and raw_length.isdigit() and len(raw_length) <= 12):
        raise ConnectError("%s sent an answer without a valid Content-Length (%r)" % (address, raw_length[:40]))
    length = int(raw_length)
    if length > MAX_RESPONSE_BYTES:
        raise ConnectError("%s sent a response of %d bytes, more than the client accepts" % (address, length))
    chunks = [rest]
    got = len(rest)
    while got < length:
        chunk = sock.recv(min(1 << 20, length - got))
        if not chunk:
            raise ConnectError("%s closed the connection after %d of the %d bytes of its answer" % (address, got, length),
                               hint="the answer was cut short (an agent gives up on a client that takes no byte "
                                    "for 10 s); retry")
        chunks.append(chunk)
        got += len(chunk)
    return HttpResponse(status, headers, b"".join(chunks)[:length])


def _parse_head(head: bytes, address: Address) -> Tuple[int, Dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise ConnectError("%s does not speak HTTP (got %r)" % (address, lines[0][:60]))
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers
