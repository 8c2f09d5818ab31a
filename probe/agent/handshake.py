"""How a TCP client and a listener prove to each other that they hold the same token, without sending it.

A token sent as ``Authorization: Bearer`` goes to whoever holds the port, and a local user can take an
agent's ``PROBE_PORT`` before it does (the agent then moves to a free port). So the token never travels:

1. ``GET /v1/hello`` with ``X-Probe-Nonce: CN`` (16 random bytes, hex). The listener answers a fresh
   nonce ``SN`` of its own, the address it sees itself at on this connection (``127.0.0.1:9700``), and
   for each token it takes, ``HMAC(token, "server", CN, SN, address)`` under that token's scope name.
   A squatter cannot make one. The client checks it against its own token and the address it connected
   to: a relay to the real agent (which sits at another address) is caught here too.
2. The request itself, on a new connection to the same address, with ``Authorization: Probe-HMAC
   scope=S, cn=CN, sn=SN, mac=HMAC(token, "client", CN, SN, address, method, path, sha256(body))``. The
   listener takes ``SN`` back once (single-use, at most ``NONCE_LIFE_S`` old, at most ``MAX_NONCES`` held)
   and checks the MAC with the scope's token and the address it sees on this connection.

What a squatter gets is ``CN``, random. What anyone gets from a hello is proofs tied to their own
``CN``, a fresh ``SN`` and the domain "server", which no request MAC ("client") can reuse. Fields are
length-prefixed, so no two field lists give one message. Stdlib only: runs in the target.
"""

import hashlib
import hmac
import os
import re
import threading
import time
from collections import OrderedDict
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from probe.errors import BadRequest, Unauthorized

__all__ = ["HELLO_PATH", "NONCE_HEADER", "SCHEME", "NONCE_LIFE_S", "MAX_NONCES", "Nonces", "server_proof",
           "client_mac", "address_name", "hello", "verify", "parse_authorization"]

HELLO_PATH = "/v1/hello"
NONCE_HEADER = "X-Probe-Nonce"
SCHEME = "Probe-HMAC"
NONCE_LIFE_S = 120.0  # a request may wait this long in a blocked agent's backlog after its hello
MAX_NONCES = 4096  # outstanding server nonces; past it the oldest is dropped
_NONCE_HEX = 32
_HEX = re.compile(r"[0-9a-f]+")

Field = Union[str, bytes]


def _message(domain: str, fields: Sequence[Field]) -> bytes:
    parts = [b"probe-auth-1", domain.encode("ascii")]
    parts.extend(f if isinstance(f, bytes) else f.encode("utf-8", "surrogateescape") for f in fields)
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)


def server_proof(token: bytes, cn: str, sn: str, address: str) -> str:
    """What only a holder of ``token`` can answer to a hello (hex)."""
    return hmac.new(token, _message("server", (cn, sn, address)), hashlib.sha256).hexdigest()


def client_mac(token: bytes, cn: str, sn: str, address: str, method: str, path: str, body: bytes) -> str:
    """What only a holder of ``token`` can send with one request, tied to that request and that hello (hex)."""
    digest = hashlib.sha256(body or b"").hexdigest()
    return hmac.new(token, _message("client", (cn, sn, address, method.upper(), path, digest)), hashlib.sha256).hexdigest()


def address_name(sockaddr: Any) -> str:
    """``host:port`` (``[v6]:port``) of a socket address; an IPv4-mapped IPv6 address as plain IPv4, so that
    both ends of one connection name it alike."""
    try:
        host, port = str(sockaddr[0]), int(sockaddr[1])
    except (TypeError, ValueError, IndexError):
        return "?"
    if host.lower().startswith("::ffff:") and "." in host:
        host = host[7:]
    host = host.split("%", 1)[0]
    return "[%s]:%d" % (host, port) if ":" in host else "%s:%d" % (host, port)


def _is_nonce(text: str) -> bool:
    return len(text) == _NONCE_HEX and _HEX.fullmatch(text) is not None  # a node helper checks 2 a request


class Nonces:
    """The server nonces handed out and not yet used: each taken back once, within ``NONCE_LIFE_S``."""

    def __init__(self) -> None:
        self._held: "OrderedDict[str, Tuple[str, float]]" = OrderedDict()  # sn -> (cn, expires)
        self._lock = threading.Lock()

    def issue(self, cn: str) -> str:
        sn = os.urandom(_NONCE_HEX // 2).hex()
        now = time.monotonic()
        with self._lock:
            while self._held and (len(self._held) >= MAX_NONCES or next(iter(self._held.values()))[1] < now):
                self._held.popitem(last=False)
            self._held[sn] = (cn, now + NONCE_LIFE_S)
        return sn

    def take(self, sn: str, cn: str) -> bool:
        """True once for a nonce we issued for ``cn`` and that is still fresh; it is gone afterwards."""
        with self._lock:
            held = self._held.pop(sn, None)
        return held is not None and hmac.compare_digest(held[0], cn) and held[1] >= time.monotonic()

    def __len__(self) -> int:
        return len(self._held)


def hello(tokens: Sequence[Tuple[bytes, int, str]], names: Mapping[int, str], nonces: Nonces,
          headers: Mapping[str, str], local: str) -> Dict[str, Any]:
    """The answer to ``GET /v1/hello``: a fresh nonce and a proof for each token (by its scope's name)."""
    cn = headers.get(NONCE_HEADER.lower(), "").strip().lower()
    if not _is_nonce(cn):
        raise BadRequest("a hello needs the header %s: %d hex digits of the client's own random nonce"
                         % (NONCE_HEADER, _NONCE_HEX))
    if not tokens:
        raise Unauthorized("this listener takes no token on TCP", hint="connect on its unix socket, on its host")
    sn = nonces.issue(cn)
    return {"nonce": sn, "address": local, "scheme": SCHEME,
            "proofs": {names[scope]: server_proof(token, cn, sn, local) for token, scope, _ in tokens}}


def parse_authorization(value: str) -> Optional[Dict[str, str]]:
    """``Probe-HMAC scope=S, cn=CN, sn=SN, mac=MAC`` -> its fields; None for another scheme."""
    scheme, _, rest = value.strip().partition(" ")
    if scheme.lower() != SCHEME.lower():
        return None
    fields: Dict[str, str] = {}
    for part in rest.split(","):
        key, sep, val = part.strip().partition("=")
        if sep:
            fields[key.strip().lower()] = val.strip()
    return fields


def verify(tokens: Sequence[Tuple[bytes, int, str]], names: Mapping[int, str], nonces: Nonces,
           fields: Mapping[str, str], local: str, method: str, path: str, body: bytes) -> Tuple[int, str]:
    """(scope, what gave it) of a request whose ``Probe-HMAC`` fields are right; ``Unauthorized`` otherwise."""
    cn, sn, mac, scope_name = (fields.get(k, "") for k in ("cn", "sn", "mac", "scope"))
    hint = "probe does this itself; a client of its own follows the wire protocol (docs/reference.md) (GET /v1/hello first)"
    if not (_is_nonce(cn) and _is_nonce(sn) and len(mac) == 64):
        raise Unauthorized("the %s authorization is malformed (it needs scope, cn, sn and mac)" % SCHEME, hint=hint)
    if not nonces.take(sn, cn):  # taken back even when the MAC turns out wrong: no second guess on one nonce
        raise Unauthorized("the nonce of this request was not issued here, was used already or is older than %.0f s"
                           % NONCE_LIFE_S, hint="retry: each request needs a fresh hello")
    chosen: List[Tuple[bytes, int, str]] = [t for t in tokens if names.get(t[1]) == scope_name]
    expected = client_mac(chosen[0][0], cn, sn, local, method, path, body) if chosen else "0" * 64
    if not chosen or not hmac.compare_digest(expected, mac.lower()):
        raise Unauthorized("the token was refused", hint="check --token / --token-file against the job's token file")
    return chosen[0][1], chosen[0][2]
