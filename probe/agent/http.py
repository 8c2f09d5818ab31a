"""The agent's HTTP/1.1: one request read from a socket with hard limits, one response written.

Why not ``http.server``: importing it (with ``email`` and friends) costs the target about 6 MB and
30 ms before the first request, and its parser is lenient with input we treat as hostile. This reads
one request per connection with hard limits (header size, body size; the listener sets the read
timeout), answers ``Connection: close`` (or ``keep-alive`` where the listener keeps the connection for
the next request: ``probe.agent.listener``), and turns anything malformed into a JSON error. It is enough
for ``curl --unix-socket``, for proxies and for port forwarding. Stdlib only; Python 3.9+.
"""

import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple, Union

from probe.agent.handshake import address_name
from probe.errors import BadRequest, ProbeError, TooLarge

__all__ = ["Request", "Response", "Handler", "read_request", "send", "MAX_BODY_BYTES", "MAX_HEADER_BYTES"]

MAX_HEADER_BYTES = 16 * 1024
MAX_HEADERS = 64
MAX_BODY_BYTES = 1024 * 1024
MAX_LENGTH_DIGITS = 12  # Content-Length: more digits than this is never a body we accept
# Writing a response: give up on a client that takes no byte for SEND_STALL_S, or that needs longer in
# all than SEND_BASE_S plus a second per SEND_MIN_RATE bytes. Module globals, read at each call.
SEND_STALL_S = 10.0
SEND_BASE_S = 30.0
SEND_MIN_RATE = 100_000

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
    peer: str = ""  # who sent it: "uid U pid P" (unix, SO_PEERCRED) or "HOST:PORT" (TCP); for the audit trail
    local: str = ""  # TCP: the address this end has on the connection, which the handshake binds to
    grant: Any = None  # the scope its credentials proved (probe.agent.scopes.Grant), once checked: a proof is single-use
    trailing: bool = False  # bytes came after its body (a next request sent before this one's answer)

    def json(self) -> Dict[str, object]:
        """The body as a JSON object; a clear ``bad_request`` for anything else.

        NaN, Infinity and numbers too large for a float are refused here: routes would otherwise fail
        on them later (``int(inf)``) with an internal error.
        """
        if not self.body:
            return {}
        try:
            value = json.loads(self.body.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite)
        except (UnicodeDecodeError, ValueError) as exc:
            raise BadRequest("request body is not valid JSON: %s" % exc) from None
        except RecursionError:
            raise BadRequest("request body is JSON nested too deeply") from None
        if not isinstance(value, dict):
            raise BadRequest("request body must be a JSON object")
        return value


def _no_constant(name: str) -> object:
    raise ValueError("%s is not a JSON number" % name)


def _finite(text: str) -> float:
    value = float(text)
    if value - value != 0.0:  # inf - inf is nan
        raise ValueError("number %s is out of range" % text[:40])
    return value


@dataclass
class Response:
    status: int
    body: Union[bytes, bytearray]  # a large JSON answer is built in one bytearray, never copied
    content_type: str = "application/json"
    headers: Dict[str, str] = field(default_factory=dict)
    on_sent: Optional[Callable[[], None]] = None
    """Called once the body was sent (or given up on) and dropped: gives back the memory it held."""

    @classmethod
    def json(cls, value: object, status: int = 200) -> "Response":
        return cls(status, json.dumps(value, default=str).encode("utf-8"))

    @classmethod
    def error(cls, exc: ProbeError) -> "Response":
        return cls(exc.status, json.dumps(exc.to_envelope(), default=str).encode("utf-8"))


Handler = Callable[[Request], Response]


def read_request(conn: socket.socket, transport: str) -> Request:
    """One request; ``ProbeError`` for bad input (to be answered), ``ValueError``/``OSError`` when the
    client goes away or stays silent past the socket's timeout."""
    buf = b""
    while True:
        chunk = conn.recv(8192)
        if not chunk:
            raise ValueError("connection closed before the request was complete")
        seen = len(buf)
        buf += chunk
        end = buf.find(b"\r\n\r\n", max(seen - 3, 0))
        if _bare_lf(buf, seen, end if end >= 0 else len(buf)):
            # Refused at once rather than waited on: every HTTP client sends CRLF, and a second line
            # grammar is where parsers in front of us and we could disagree about a request's end.
            raise BadRequest("a line of the request head ends in a bare LF; end every line with CRLF (\\r\\n)")
        if end >= 0:
            break
        if len(buf) > MAX_HEADER_BYTES:
            raise TooLarge("request headers larger than %d bytes" % MAX_HEADER_BYTES)
    head, rest = buf[:end], buf[end + 4:]
    if len(head) > MAX_HEADER_BYTES:
        raise TooLarge("request headers larger than %d bytes" % MAX_HEADER_BYTES)
    method, path, headers = _parse_head(head)
    body = _read_body(conn, headers, rest)
    local = address_name(conn.getsockname()) if transport == "tcp" else ""
    return Request(method, path, headers, body, transport, local=local, trailing=len(rest) > len(body))


def _bare_lf(buf: bytes, start: int, stop: int) -> bool:
    """Is there a LF without a CR before it in ``buf[start:stop]``?"""
    at = buf.find(b"\n", start, stop)
    while at >= 0:
        if at == 0 or buf[at - 1] != 13:
            return True
        at = buf.find(b"\n", at + 1, stop)
    return False


def _parse_head(head: bytes) -> Tuple[str, str, Dict[str, str]]:
    text = head.decode("latin-1")  # decodes every byte
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[1].startswith("/"):
        raise BadRequest("malformed HTTP request line: %r" % lines[0][:100])
    if len(lines) - 1 > MAX_HEADERS:
        raise TooLarge("more than %d request headers" % MAX_HEADERS)
    headers: Dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or "\r" in line:
            raise BadRequest("malformed HTTP header line: %r" % line[:100])
        name = name.lower()
        if name == "content-length" and name in headers:
            raise BadRequest("more than one Content-Length header")
        headers[name] = value.strip()
    return parts[0].upper(), parts[1], headers


def _read_body(conn: socket.socket, headers: Dict[str, str], already: bytes) -> bytes:
    if "transfer-encoding" in headers:
        raise BadRequest("chunked request bodies are not supported; send Content-Length")
    raw_length = headers.get("content-length", "0")
    # ASCII digits only ('²'.isdigit() is true) and few of them (int() refuses over 4300 digits).
    if not (0 < len(raw_length) <= MAX_LENGTH_DIGITS and raw_length.isascii() and raw_length.isdigit()):
        raise BadRequest("Content-Length must be a non-negative integer of at most %d digits, got %r"
                         % (MAX_LENGTH_DIGITS, raw_length[:40]))
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


def send(conn: socket.socket, response: Response, keep_alive: bool = False) -> bool:
    """Write the whole response; False when the client went away or stopped reading. ``keep_alive``: the
    connection stays open for the client's next request (``Connection: keep-alive``; the listener decides).

    The deadline follows progress rather than being one total: a slow reader that keeps taking bytes
    gets its whole answer (up to a cap that grows with the size), one that takes nothing for
    ``SEND_STALL_S`` is given up on. Content-Length always comes first, so a client can tell an
    answer cut short from a whole one.
    """
    reason = _REASONS.get(response.status, "Status")
    lines = ["HTTP/1.1 %d %s" % (response.status, reason),
             "Content-Type: %s" % response.content_type,
             "Content-Length: %d" % len(response.body),
             "Connection: keep-alive" if keep_alive else "Connection: close"]
    lines.extend("%s: %s" % item for item in response.headers.items())
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    body = response.body
    deadline = time.monotonic() + SEND_BASE_S + len(body) / SEND_MIN_RATE
    try:
        if len(body) < 65536:
            _send_all(conn, head + body, deadline)  # one segment for the common small answer
        else:
            _send_all(conn, head, deadline)  # no copy of a large body
            _send_all(conn, body, deadline)
    except OSError:  # the client went away, or stalled (socket.timeout is an OSError)
        return False
    return True


def _send_all(conn: socket.socket, data: Union[bytes, bytearray], deadline: float) -> None:
    view = memoryview(data)
    while view:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise socket.timeout("the client took longer than the answer's deadline")
        conn.settimeout(min(SEND_STALL_S, remaining))  # each send: at most this long without progress
        sent = conn.send(view)
        view = view[sent:]
