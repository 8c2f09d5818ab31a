"""A small, strict HTTP/1.1 server for the agent, on a unix socket or TCP.

Why not ``http.server``: importing it (with ``email`` and friends) costs the target about 6 MB and
30 ms before the first request, and its parser is lenient with input we treat as hostile. This one
reads one request per connection with hard limits (header size, body size, read timeout, concurrent
connections), answers ``Connection: close``, and turns anything malformed into a JSON error. It is
enough for ``curl --unix-socket``, for proxies and for port forwarding. Stdlib only; Python 3.9+.
"""

import json
import os
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Sequence, Tuple

from probe.agent import switch
from probe.errors import BadRequest, Forbidden, ProbeError, TooLarge

__all__ = ["Request", "Response", "Listener", "MAX_BODY_BYTES"]

MAX_HEADER_BYTES = 16 * 1024
MAX_HEADERS = 64
MAX_BODY_BYTES = 1024 * 1024
READ_TIMEOUT_S = 10.0
WRITE_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 32

_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
            405: "Method Not Allowed", 413: "Payload Too Large", 500: "Internal Server Error",
            503: "Service Unavailable", 504: "Gateway Timeout"}


@dataclass
class Request:
    method: str
    path: str
    headers: Dict[str, str]
    body: bytes
    transport: str  # "unix" or "tcp"

    def json(self) -> Dict[str, object]:
        """The body as a JSON object; a clear ``bad_request`` for anything else."""
        if not self.body:
            return {}
        try:
            value = json.loads(self.body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise BadRequest("request body is not valid JSON: %s" % exc) from None
        if not isinstance(value, dict):
            raise BadRequest("request body must be a JSON object")
        return value


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: Dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, value: object, status: int = 200) -> "Response":
        return cls(status, json.dumps(value, default=str).encode("utf-8"))

    @classmethod
    def json_rows(cls, head: Dict[str, object], chunks: "Iterable[Sequence[object]]") -> "Response":
        """``head`` plus a ``rows`` array encoded chunk by chunk.

        The JSON encoder holds the GIL for as long as one call runs; encoding a large result in
        pieces lets the target's threads run between them.
        """
        parts = [json.dumps(chunk, default=str)[1:-1] for chunk in chunks]
        rows = "[" + ",".join(p for p in parts if p) + "]"
        text = json.dumps(head, default=str)
        body = text[:-1] + (", " if head else "") + '"rows": ' + rows + "}"
        return cls(200, body.encode("utf-8"))

    @classmethod
    def error(cls, exc: ProbeError) -> "Response":
        return cls(exc.status, json.dumps(exc.to_envelope(), default=str).encode("utf-8"))


Handler = Callable[[Request], Response]


class Listener:
    """One listening socket, its accept thread, and a thread per connection."""

    def __init__(self, sock: socket.socket, transport: str, handler: Handler, name: str) -> None:
        self._sock = sock
        self.transport = transport
        self._handler = handler
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._reading: Dict[socket.socket, float] = {}  # connections still sending their request
        self._reading_lock = threading.Lock()
        self._queue: "queue.SimpleQueue[socket.socket]" = queue.SimpleQueue()
        self._workers_lock = threading.Lock()
        self._idle = 0  # worker threads waiting for a connection
        self._waiting = 0  # connections handed over and not yet taken by a worker
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name=name, daemon=True)

    @classmethod
    def unix(cls, path: str, handler: Handler) -> "Listener":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if os.path.lexists(path):
                os.unlink(path)  # a stale socket of a dead process with our pid
            old_umask = os.umask(0o177)
            try:
                sock.bind(path)
            finally:
                os.umask(old_umask)
            os.chmod(path, 0o600)
            sock.listen(64)
        except BaseException:
            sock.close()
            raise
        return cls(sock, "unix", handler, "probe-accept-unix")

    @classmethod
    def tcp(cls, host: str, port: int, handler: Handler) -> "Listener":
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
        except BaseException:
            sock.close()
            raise
        return cls(sock, "tcp", handler, "probe-accept-tcp")

    @property
    def address(self) -> object:
        return self._sock.getsockname()

    @property
    def port(self) -> int:
        """The TCP port actually bound (useful when asked for port 0)."""
        return int(self._sock.getsockname()[1])

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop accepting; wakes the accept thread. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def forget(self) -> None:
        """In a forked child: drop our copy of the listening socket without disturbing the parent's."""
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                continue
            except BaseException:
                return
            if not self._slots.acquire(blocking=False):
                # Every slot is taken. Connections that have not finished sending a request (idle or
                # slow clients, perhaps without a token) must not lock out those that have one.
                self._evict_slowest_reader()
                if not self._slots.acquire(timeout=1.0):
                    _reject_busy(conn)
                    continue
            switch.begin()  # from here on every GIL hand-over of this request is short
            try:
                self._dispatch(conn)
            except BaseException:
                switch.end()
                self._slots.release()
                conn.close()

    def _dispatch(self, conn: socket.socket) -> None:
        """Hand the connection to an idle worker thread, starting one if none is idle.

        Workers stay for the next request: a fresh thread per request cost about 0.8 ms of a query
        that should take a few (thread start-up, and DuckDB's per-thread state). There are never more
        workers than connection slots.
        """
        with self._workers_lock:
            self._waiting += 1
            start = self._waiting > self._idle
            if start:
                self._idle += 1  # counted idle until it takes its first connection
        if start:
            threading.Thread(target=self._work, name="probe-request", daemon=True).start()
        self._queue.put(conn)

    def _work(self) -> None:
        me = threading.current_thread()
        while not self._closed:
            me.name = "probe-idle"  # python.threads tells idle workers from those serving a request
            conn = self._queue.get()
            me.name = "probe-request"
            with self._workers_lock:
                self._waiting -= 1
                self._idle -= 1
            try:
                self._serve(conn)
            finally:
                with self._workers_lock:
                    self._idle += 1

    def _evict_slowest_reader(self) -> None:
        with self._reading_lock:
            if not self._reading:
                return
            oldest = min(self._reading, key=self._reading.__getitem__)
            del self._reading[oldest]
        try:
            oldest.shutdown(socket.SHUT_RDWR)  # its thread's recv() returns and the slot is freed
        except OSError:
            pass

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(READ_TIMEOUT_S)
            if self.transport == "tcp":
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            elif not _peer_is_owner(conn):
                _send(conn, Response.error(Forbidden("only the owner of this process may connect")))
                return
            with self._reading_lock:
                self._reading[conn] = time.monotonic()
            try:
                request = _read_request(conn, self.transport)
            except ProbeError as exc:
                _send(conn, Response.error(exc))
                return
            except (OSError, ValueError):
                return  # the client went away, timed out, or was evicted; nothing to answer
            finally:
                with self._reading_lock:
                    self._reading.pop(conn, None)
            response = self._handler(request)
            conn.settimeout(WRITE_TIMEOUT_S)
            _send(conn, response)
        except BaseException:
            pass  # never let a connection's trouble reach the target
        finally:
            try:
                conn.close()
            except OSError:
                pass
            self._slots.release()
            switch.end()


def _peer_is_owner(conn: socket.socket) -> bool:
    """SO_PEERCRED: the connecting process must run as our uid (the file mode already says so)."""
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return False
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid == os.getuid()


def _read_request(conn: socket.socket, transport: str) -> Request:
    buf = b""
    while b"\r\n\r\n" not in buf:
        if len(buf) > MAX_HEADER_BYTES:
            raise TooLarge("request headers larger than %d bytes" % MAX_HEADER_BYTES)
        chunk = conn.recv(8192)
        if not chunk:
            raise ValueError("connection closed before the request was complete")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    if len(head) > MAX_HEADER_BYTES:
        raise TooLarge("request headers larger than %d bytes" % MAX_HEADER_BYTES)
    method, path, headers = _parse_head(head)
    body = _read_body(conn, headers, rest)
    return Request(method, path, headers, body, transport)


def _parse_head(head: bytes) -> Tuple[str, str, Dict[str, str]]:
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
        raise BadRequest("malformed HTTP request") from None
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[1].startswith("/"):
        raise BadRequest("malformed HTTP request line: %r" % lines[0][:100])
    if len(lines) - 1 > MAX_HEADERS:
        raise TooLarge("more than %d request headers" % MAX_HEADERS)
    headers: Dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise BadRequest("malformed HTTP header line: %r" % line[:100])
        headers[name.lower()] = value.strip()
    return parts[0].upper(), parts[1], headers


def _read_body(conn: socket.socket, headers: Dict[str, str], already: bytes) -> bytes:
    if "transfer-encoding" in headers:
        raise BadRequest("chunked request bodies are not supported; send Content-Length")
    raw_length = headers.get("content-length", "0")
    if not raw_length.isdigit():
        raise BadRequest("Content-Length must be a non-negative integer, got %r" % raw_length[:40])
    length = int(raw_length)
    if length > MAX_BODY_BYTES:
        raise TooLarge("request body of %d bytes is larger than the limit of %d" % (length, MAX_BODY_BYTES))
    if headers.get("expect", "").lower() == "100-continue" and len(already) < length:
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    chunks = [already]
    got = len(already)
    while got < length:
        chunk = conn.recv(min(65536, length - got))
        if not chunk:
            raise ValueError("connection closed in the middle of the request body")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)[:length]


def _send(conn: socket.socket, response: Response) -> None:
    reason = _REASONS.get(response.status, "Status")
    lines = ["HTTP/1.1 %d %s" % (response.status, reason),
             "Content-Type: %s" % response.content_type,
             "Content-Length: %d" % len(response.body),
             "Connection: close"]
    lines.extend("%s: %s" % item for item in response.headers.items())
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    try:
        conn.sendall(head + response.body)
    except OSError:
        pass  # the client disconnected mid-response; nothing more to do


def _reject_busy(conn: socket.socket) -> None:
    try:
        conn.settimeout(1.0)
        body = json.dumps({"error": {"code": "busy", "message": "the agent has too many open connections",
                                     "hint": "retry in a moment"}})
        _send(conn, Response(503, body.encode("utf-8")))
    except BaseException:
        pass
    finally:
        try:
            conn.close()
        except OSError:
            pass
