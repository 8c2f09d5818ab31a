"""One HTTP/1.1 request over a unix socket or TCP, on a plain socket.

The CLI's start-up time is part of every command's latency, and ``http.client`` alone costs ~20 ms of
imports; the agent speaks a small, strict subset of HTTP (one request per connection,
``Content-Length`` bodies), so a small client suffices. Its records are NamedTuples rather than
dataclasses for the same reason (defining a frozen dataclass costs ~0.8 ms at import, a NamedTuple
~0.1 ms). Socket errors become :class:`ConnectError` or
:class:`Timeout` that name the target and what was waited for.

What comes back is bounded, since the other end may be no honest agent: an answer must arrive whole
within the time given (a server that sends a byte now and then is cut off as one that sends nothing),
one answer may hold at most ``MAX_RESPONSE_BYTES``, and the answers being received or parsed at once,
across every target this process talks to, at most ``MAX_IN_FLIGHT_BYTES``.

TLS: once ``use_tls`` was called (the CLI's ``--cacert``, ``--cert``, ``--key``), or where
``PROBE_CACERT`` / ``PROBE_CERT`` / ``PROBE_KEY`` are set, every TCP connection of this process speaks
TLS, verifying the other end's certificate against the CA and its name against the address's host; a
process that serves TLS itself (``PROBE_TLS_CERT``, a host helper asking its ranks) falls back to
``PROBE_TLS_CLIENT_CA`` as its CA and, for mutual TLS, to its own certificate as its client's.
Unix sockets never use TLS.
"""

import os
import socket
import sys
import threading
import time
from typing import Any, Dict, NamedTuple, Optional, Tuple, Union

from probe.client.wording import option
from probe.errors import ConnectError, ConnectionRefused, Timeout, TooLarge, UsageError

__all__ = ["UnixAddress", "TcpAddress", "Address", "HttpResponse", "QueueFull", "request", "send_request", "read_response",
           "release", "request_bytes", "use_tls", "tls_context", "MAX_RESPONSE_BYTES", "MAX_IN_FLIGHT_BYTES"]

MAX_RESPONSE_BYTES = 256 << 20
"""The largest answer taken from one target; a larger one is refused before its body is read. An agent
bounds its own answers well below it: a query's result at ``PROBE_MAX_RESULT_BYTES`` (64 MiB of Arrow
data by default, twice that as JSON), a snippet's output at ``PROBE_EVAL_OUTPUT`` characters."""
MAX_IN_FLIGHT_BYTES = 512 << 20
"""Bytes of answers held at once between their first byte and their caller's ``release`` (parsed), across
every target of this process (a fan-out over many ranks, several ``-t``): an answer that does not fit
waits, within its own time limit, for others to be done. The client's peak is about twice this: a JSON
body and its text while it is decoded."""
_FREE_BYTES = 64 << 10  # an answer this small is read without waiting for room (512 open requests: 32 MiB)


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
    body: Union[bytes, bytearray]  # received into one growing buffer: a copy would double a large answer


def release(response: HttpResponse) -> None:
    """Say that ``response``'s body has been parsed: its bytes no longer count in ``MAX_IN_FLIGHT_BYTES``
    (freeing the body says so too)."""
    ticket = getattr(response.body, "ticket", None)
    if ticket is not None:
        ticket.give()


class QueueFull(socket.timeout):
    """The agent's listen backlog is full: it has not accepted connections for a while (it cannot run, or
    every slot is taken). A unix socket refuses such a connect at once (EAGAIN) instead of queueing it."""


def _connect(address: Address, timeout: float, queue_wait: Optional[float] = None, to: Any = None) -> socket.socket:
    """A connected socket. ``queue_wait``: how long to keep trying while a unix agent's backlog is full
    (default: the whole ``timeout``); past it, :class:`QueueFull`. A unix connect never blocks: one that
    would wait on a full backlog is refused at once and retried here, so the wait stays ours to bound.
    ``to``: the TCP socket address to connect to (the one a handshake proved), instead of resolving the host."""
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
    wait = timeout if queue_wait is None else min(queue_wait, timeout)
    if to is not None:
        sock = socket.socket(socket.AF_INET6 if len(to) == 4 else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.settimeout(wait)
            sock.connect(to)
        except BaseException:
            sock.close()
            raise
    else:
        sock = socket.create_connection((address.host, address.port), timeout=wait)
    sock.settimeout(timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    context = tls_context()
    if context is not None:
        return _handshake(context, sock, address)
    return sock


_tls: Any = None  # None: not looked yet; False: plain TCP; else the ssl.SSLContext
_tls_words = ""  # how the CA was given, for the errors
_tls_cert = [False]  # a client certificate was given: for the words of a refusal


def use_tls(cacert: Optional[str] = None, cert: Optional[str] = None, key: Optional[str] = None) -> None:
    """Speak TLS on every TCP connection from now on: verify agents against ``cacert`` (PEM; the system's
    CAs where None) and, given ``cert`` (and ``key``, where it is not in the same file), show that client
    certificate to agents that ask for one (mutual TLS). Nothing given: as the environment says."""
    global _tls, _tls_words
    if cacert is None and cert is None and key is None:
        _tls = None
        return
    _tls, _tls_words = _make_tls(cacert, cert, key), option("--cacert", "cacert=")
    _tls_cert[0] = bool(cert or key)


def tls_context() -> Any:
    """The client's ``ssl.SSLContext``, or None for plain TCP (see the module's docstring)."""
    global _tls, _tls_words
    if _tls is None:
        env = os.environ
        cacert, cert, key = env.get("PROBE_CACERT") or None, env.get("PROBE_CERT") or None, env.get("PROBE_KEY") or None
        _tls_words = "$PROBE_CACERT"
        if cacert is None and env.get("PROBE_TLS_CERT"):  # a process serving TLS, asking others of its job
            cacert, _tls_words = env.get("PROBE_TLS_CLIENT_CA") or None, "$PROBE_CACERT in the job"
        if cert is None and env.get("PROBE_TLS_CLIENT_CA") and env.get("PROBE_TLS_CERT"):
            cert, key = env.get("PROBE_TLS_CERT"), env.get("PROBE_TLS_KEY") or None
        _tls = _make_tls(cacert, cert, key) if (cacert or cert) else False
        _tls_cert[0] = bool(cert or key)
    return _tls or None


def _make_tls(cacert: Optional[str], cert: Optional[str], key: Optional[str]) -> Any:
    import ssl  # only where TLS is used: the import costs a few ms of every command

    try:
        context = ssl.create_default_context(cafile=cacert)
    except (OSError, ValueError) as exc:
        raise UsageError("cannot read the CA file %s: %s" % (cacert, getattr(exc, "strerror", None) or exc)) from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert or key:
        try:
            context.load_cert_chain(cert or key or "", key)
        except (OSError, ValueError) as exc:
            raise UsageError("cannot use the client certificate %s%s: %s" % (cert, " with key %s" % key if key else "",
                                                                             getattr(exc, "strerror", None) or exc)) from None
    return context


def _handshake(context: Any, sock: socket.socket, address: "TcpAddress") -> socket.socket:
    """``sock`` wrapped in TLS, its handshake done (within the socket's timeout); a refusal becomes a
    ConnectError that says what to change."""
    import ssl

    try:
        return context.wrap_socket(sock, server_hostname=address.host.strip("[]"))
    except ssl.SSLCertVerificationError as exc:
        sock.close()
        raise ConnectError("the certificate of the agent at %s is not trusted: %s" % (address, exc.verify_message or exc),
                           hint="give the CA that signed it (%s), and address the agent by a name its "
                                "certificate holds" % _tls_words) from None
    except ssl.SSLError as exc:
        sock.close()
        if exc.reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST"):
            raise ConnectError("the agent at %s speaks plain TCP, not TLS" % (address,),
                               hint="leave out %s (and $PROBE_CACERT)" % option("--cacert", "cacert=")) from None
        raise ConnectError("TLS with the agent at %s failed: %s" % (address, _tls_reason(exc))) from None
    except BaseException:
        sock.close()
        raise


def _is_tls_error(exc: BaseException) -> bool:
    return type(exc).__module__ == "ssl" and not isinstance(exc, socket.timeout)


def _tls_refused(address: "Address", exc: BaseException) -> ConnectError:
    """A TLS error after the handshake: with TLS 1.3 an agent refuses a client certificate (or the lack of
    one) only then, with an alert, or by closing the connection."""
    return ConnectError("TLS with the agent at %s failed: %s" % (address, _tls_reason(exc)))


def _tls_reason(exc: BaseException) -> str:
    """An ssl error in words, saying what to do for the common refusals of mutual TLS."""
    reason = str(getattr(exc, "reason", "") or exc)
    cert, key = option("--cert", "cert="), option("--key", "key=")
    if "CERTIFICATE_REQUIRED" in reason.upper():
        return "it asks for a client certificate: give %s and %s" % (cert, key)
    if "UNKNOWN_CA" in reason.upper() or "BAD_CERTIFICATE" in reason.upper():
        return "it refused the client certificate (%s): give one signed by the CA it trusts" % reason.lower()
    if "EOF" in reason.upper() or "ZERO_RETURN" in reason.upper():
        if _tls_cert[0]:
            return ("it closed the connection right after the handshake: it may have refused the client "
                    "certificate (give one signed by the CA it trusts)")
        return ("it closed the connection right after the handshake: it may ask for a client certificate "
                "(mutual TLS): give %s and %s" % (cert, key))
    return reason


def request(address: Address, method: str, path: str, body: Optional[bytes] = None,
            headers: Optional[Dict[str, str]] = None, timeout: float = 30.0, token: Optional[str] = None) -> HttpResponse:
    """Send one request and read the whole response, all within ``timeout`` seconds (``token``: see
    ``send_request``)."""
    deadline = time.monotonic() + timeout
    sock = send_request(address, method, path, body, headers, timeout, token=token)
    return read_response(sock, address, timeout, deadline)


scope_cap: Optional[str] = None
"""The most that this process's requests may do (``read``, ``control``), sent as ``X-Probe-Scope`` on
each: set by a process that serves others what it reads (``probe mcp``, the page), so that an agent
grants no more, and shows a read or control request no secret-looking local (``probe.tables.redact``).
A request's own ``X-Probe-Scope`` header (a host helper asking for a client) takes its place."""


def request_bytes(address: Address, method: str, path: str, body: Optional[bytes],
                  headers: Optional[Dict[str, str]], keep_alive: bool = False) -> bytes:
    """The bytes of one request as sent (its ``Authorization``, if any, already in ``headers``).
    ``keep_alive``: ask the listener to keep the connection for the next request (``probe.client.multiplex``)."""
    host = address.host if isinstance(address, TcpAddress) else "localhost"
    lines = ["%s %s HTTP/1.1" % (method, path), "Host: %s" % host,
             "Connection: keep-alive" if keep_alive else "Connection: close",
             "Content-Length: %d" % len(body or b"")]
    if body:
        lines.append("Content-Type: application/json")
    lines.extend("%s: %s" % item for item in (headers or {}).items())
    if scope_cap and not any(k.lower() == "x-probe-scope" for k in (headers or {})):
        lines.append("X-Probe-Scope: %s" % scope_cap)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


def send_request(address: Address, method: str, path: str, body: Optional[bytes] = None,
                 headers: Optional[Dict[str, str]] = None, timeout: float = 30.0,
                 queue_wait: Optional[float] = None, token: Optional[str] = None) -> socket.socket:
    """Connect and send one request; the caller waits for the answer (``read_response``), or closes
    the socket to give up on it (the agent then runs nothing for it). ``queue_wait``: see ``_connect``;
    :class:`QueueFull` passes through to a caller that set it. Over TCP it bounds the connect: an agent
    that cannot run accepts nothing, and once its backlog is full the kernel drops new connections, so a
    connect waits to its timeout (the caller then asks the rank's host helper why).

    ``token``: over TCP, the listener first proves it holds it (``probe.client.proof``), and the request
    carries a MAC, never the token; on a unix socket the peer's uid is what counts, and it is not used.
    This is the one place a token goes out: nothing else sends ``Authorization``."""
    to = None
    if token and isinstance(address, TcpAddress):
        from probe.client.proof import authorization

        to, value = authorization(address, token, method, path, body, timeout, queue_wait, sys.modules[__name__])
        headers = dict(headers or {}, Authorization=value)
    payload = request_bytes(address, method, path, body, headers)
    try:
        sock = _connect(address, timeout, queue_wait, to)
    except QueueFull:
        if queue_wait is not None:
            raise
        raise Timeout("%s accepted no connection within %.1f s: its queue of connections is full" % (address, timeout),
                      hint="the agent cannot run (see `probe list`), or is overwhelmed; retry later") from None
    except FileNotFoundError:
        raise ConnectError("no agent at %s (no such socket)" % (address,)) from None
    except ConnectionRefusedError:
        raise ConnectionRefused("no agent at %s (connection refused)" % (address,)) from None
    except socket.timeout:
        waited = timeout if queue_wait is None else min(queue_wait, timeout)
        raise Timeout("connecting to %s timed out after %.1f s" % (address, waited)) from None
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
        if _is_tls_error(exc):
            raise _tls_refused(address, exc) from None
        raise ConnectError("connection to %s failed: %s" % (address, exc.strerror or exc)) from None
    except BaseException:
        sock.close()
        raise
    return sock


def read_response(sock: socket.socket, address: Address, timeout: float,
                  deadline: Optional[float] = None) -> HttpResponse:
    """The whole answer to the request sent on ``sock``, within ``timeout`` seconds from now (or by
    ``deadline``, a ``time.monotonic()`` value, where the wait began earlier); closes ``sock``."""
    progress = _Progress(time.monotonic() + timeout if deadline is None else deadline)
    try:
        return _read_response(sock, address, progress)
    except socket.timeout:
        wait = option("--timeout", "timeout=")
        if progress.received:
            raise Timeout("the answer from %s did not arrive whole within %.1f s (%d bytes came)"
                          % (address, timeout, progress.received),
                          hint="%s bounds the whole answer: raise it for a large answer over a slow link"
                               % wait) from None
        raise Timeout("no answer from %s within %.1f s" % (address, timeout),
                      hint="the agent may be busy; retry with a larger %s" % wait) from None
    except OSError as exc:
        if _is_tls_error(exc):
            raise _tls_refused(address, exc) from None
        raise ConnectError("connection to %s failed: %s" % (address, exc.strerror or exc)) from None
    finally:
        sock.close()


class _Progress:
    """When the answer must be in by, and how much of it came."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.received = 0

    def recv(self, sock: socket.socket, size: int) -> bytes:
        """Up to ``size`` bytes; ``socket.timeout`` once the deadline has passed, however the bytes trickle."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("past the deadline")
        sock.settimeout(left)
        chunk = sock.recv(size)
        self.received += len(chunk)
        return chunk


class _Room:
    """The bytes of answers held between their first byte and their release, in this process
    (``MAX_IN_FLIGHT_BYTES``)."""

    def __init__(self) -> None:
        self.used = 0
        self._changed = threading.Condition(threading.RLock())  # a body freed by the GC inside take() gives back

    def take(self, size: int, deadline: float) -> bool:
        """Reserve ``size`` bytes, waiting until others give theirs back or ``deadline`` passes (False).
        An answer larger than the whole room still goes alone."""
        with self._changed:
            while self.used and self.used + size > MAX_IN_FLIGHT_BYTES:  # read now: a script may change it
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            self.used += size
            return True

    def give(self, size: int) -> None:
        with self._changed:
            self.used -= size
            self._changed.notify_all()


_room = _Room()


class _Ticket:
    """An answer's place in the room, given back once: by ``release``, or when its body is freed."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size

    def give(self) -> None:
        size, self.size = self.size, 0
        if size:
            _room.give(size)

    __del__ = give


class _Body(bytearray):
    """An answer's body, with its place in the room while it is large."""

    ticket: Optional[_Ticket] = None


def _read_response(sock: socket.socket, address: Address, progress: _Progress) -> HttpResponse:
    buf = b""
    end = -1
    while end < 0:
        chunk = progress.recv(sock, 65536)
        if not chunk:
            raise ConnectError("%s closed the connection without an answer" % (address,))
        buf += chunk
        end = buf.find(b"\r\n\r\n", max(0, len(buf) - len(chunk) - 3))  # only where it can newly be
        if end < 0 and len(buf) > 65536:
            raise ConnectError("%s sent an oversized response header" % (address,))
    head, rest = buf[:end], buf[end + 4:]
    status, headers, length = checked_head(head, address)
    body = _Body(rest[:length])
    room = length if length - len(body) > _FREE_BYTES else 0
    if room and not _room.take(room, progress.deadline):
        raise Timeout("the answer from %s (%.0f MB) found no room in time: the answers of other targets being "
                      "received filled the client's bound of %d MB" % (address, length / 1e6, MAX_IN_FLIGHT_BYTES // 10**6),
                      hint="ask fewer targets at once (%s), or each for less" % option("--max-in-flight", "max_in_flight="))
    if room:
        body.ticket = _Ticket(room)
    try:
        while len(body) < length:
            chunk = progress.recv(sock, min(1 << 20, length - len(body)))
            if not chunk:
                raise ConnectError("%s closed the connection after %d of the %d bytes of its answer"
                                   % (address, len(body), length),
                                   hint="the answer was cut short (an agent gives up on a client that takes no "
                                        "byte for 10 s); retry")
            body += chunk
    except BaseException:
        body.clear()  # the error's traceback holds this frame: it must not hold the part that came
        release(HttpResponse(status, headers, body))
        raise
    return HttpResponse(status, headers, body)


def _too_large(address: Address, length: int) -> TooLarge:
    return TooLarge("%s sent an answer of %.0f MB, more than the %d MB the client takes from one target"
                    % (address, length / 1e6, MAX_RESPONSE_BYTES // 10**6),
                    hint="ask for less: for a query, a LIMIT, fewer columns or a lower %s; an agent bounds its "
                         "own answers below this (PROBE_MAX_RESULT_BYTES), so this may be no probe agent"
                         % option("--max-rows", "max_rows="))


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


def checked_head(head: bytes, address: Any) -> Tuple[int, Dict[str, str], int]:
    """An answer's status line and headers, parsed and checked: not TLS, a valid ``Content-Length`` (the agent
    always sends one: without it an answer cut short could pass for a whole one) within ``MAX_RESPONSE_BYTES``.
    Shared by the blocking read and ``probe.client.multiplex``."""
    status, headers = _parse_head(head, address)
    if headers.get("x-probe-tls") == "tls":
        raise ConnectError("the agent at %s speaks TLS: give %s" % (address, option("--cacert", "cacert=")),
                           hint="the CA that signed its certificate (PEM; or $PROBE_CACERT)")
    raw_length = headers.get("content-length", "")
    if not (raw_length.isascii() and raw_length.isdigit() and len(raw_length) <= 12):
        raise ConnectError("%s sent an answer without a valid Content-Length (%r)" % (address, raw_length[:40]))
    length = int(raw_length)
    if length > MAX_RESPONSE_BYTES:
        raise _too_large(address, length)
    return status, headers, length
