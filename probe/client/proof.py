"""The client's half of the token handshake (``probe.agent.handshake``): the listener proves first.

Every request that carries a token over TCP comes here (``transport.send_request(..., token=)``): a hello
with a random nonce, the listener's proof checked against our token and the address we reached, and only
then the request, with a MAC that holds neither the token nor anything that works for another request.
A listener that cannot prove it holds the token (another user's process on the job's port, a relay to
the real agent, an agent of another job) gets nothing more, and the user is told in words (exit 4).

``PROBE_FORWARDED=1``: the connection is forwarded on purpose (NAT, a proxy, a port forward to another
port number), so the listener sees itself at another address than the one dialled; its proof is then
taken for the address it names. Without it such a proof is refused: it is what a relay looks like.
"""

import hmac
import json
import os
import re
import threading
import time
from collections import OrderedDict
from typing import Any, Dict, Optional, Tuple

from probe.agent.handshake import HELLO_PATH, NONCE_HEADER, SCHEME, address_name, client_mac, server_proof
from probe.errors import ProbeError, Unauthorized

__all__ = ["authorization", "proven_by", "hello_steps", "Unproven", "NEXT_HEADER", "ask_next", "keep_next", "reused"]


class Unproven(Unauthorized):
    """The listener did not prove that it holds the token: nothing derived from it was sent there."""


def authorization(address: Any, token: str, method: str, path: str, body: Optional[bytes], timeout: float,
                  queue_wait: Optional[float] = None, wire: Any = None) -> Tuple[Any, str]:
    """(the socket address the request must go to, its ``Authorization`` value), after the listener at
    ``address`` proved it holds ``token``; :class:`Unproven` where it could not. ``queue_wait`` bounds the
    hello's connect and answer (a rank that cannot run is then asked about instead, see ``helped``).
    ``wire``: the module ``probe.client.transport``, which calls this and passes itself (imported here
    it would make a circle)."""
    transport = wire

    key = token.strip().encode("utf-8")
    kept = _take_kept(address, key) if path in _KEPT_FOR else None
    _local.reused = kept is not None
    if kept is not None:  # a nonce its last answer handed out (keep_next): proven then, for this address
        return _with_kept(kept, key, method, path, body)
    cn = os.urandom(16).hex()
    wait = timeout if queue_wait is None else min(queue_wait, timeout)
    deadline = time.monotonic() + wait
    sock = transport.send_request(address, "GET", HELLO_PATH, None, {NONCE_HEADER: cn}, timeout, queue_wait)
    try:
        peer = sock.getpeername()
    except OSError:
        sock.close()
        raise
    answer = transport.read_response(sock, address, wait, deadline)
    return proven_by(address, key, cn, answer, peer, method, path, body)


def proven_by(address: Any, key: bytes, cn: str, answer: Any, peer: Any, method: str, path: str,
              body: Optional[bytes]) -> Tuple[Any, str]:
    """What :func:`authorization` makes of the hello's ``answer`` (to client nonce ``cn``, from the socket
    address ``peer``): (``peer``, the ``Authorization`` value); :class:`Unproven` where the proof fails.
    Releases ``answer``. Also the second half of :func:`hello_steps`, where many hellos share one thread."""
    try:
        sn, claimed, proofs = _parse(answer, address)
    finally:
        _release(answer)
    here = address_name(peer)
    scope = _match(key, cn, sn, here, proofs)
    if scope is None:
        scope = _match(key, cn, sn, claimed, proofs)
        if scope is None:
            raise _unproven(address, "its proof does not match the token given: either the token is refused there "
                                     "(not one of this job's), or another process holds the port",
                            "check --token-file against the job's token; on that host `probe list` says who holds the port")
        if not _same_place(claimed, here) and os.environ.get("PROBE_FORWARDED") != "1":
            raise _unproven(address, "it proved it for %s, not for this connection (to %s): something relays the "
                                     "connection (another user's listener on the port, or a forward)" % (claimed, here),
                            "connect to the agent's own address (`probe list` on its host); if you forward the port "
                            "yourself, set PROBE_FORWARDED=1")
        here = claimed
    _remember(_proven, _place(address, key), (here, peer))
    mac = client_mac(key, cn, sn, here, method, path, body or b"")
    return peer, "%s scope=%s, cn=%s, sn=%s, mac=%s" % (SCHEME, scope, cn, sn, mac)


def _with_kept(kept: Tuple[str, str, str, str, Any], key: bytes, method: str, path: str,
               body: Optional[bytes]) -> Tuple[Any, str]:
    cn, sn, scope, here, peer = kept
    return peer, "%s scope=%s, cn=%s, sn=%s, mac=%s" % (SCHEME, scope, cn, sn,
                                                       client_mac(key, cn, sn, here, method, path, body or b""))


def _release(answer: Any) -> None:
    """``probe.client.transport.release`` (imported here it would make a circle)."""
    ticket = getattr(answer.body, "ticket", None)
    if ticket is not None:
        ticket.give()


def hello_steps(address: Any, token: str, method: str, path: str, body: Optional[bytes]) -> Any:
    """:func:`authorization` as steps, for a caller that drives many at once from one thread
    (``probe.client.multiplex``): a generator that yields the hello to send, ``(GET path, headers)``, or
    nothing where a kept nonce stands in for it, is sent ``(answer, peer)``, and returns (the socket address
    the request must go to, its ``Authorization`` value, whether a kept nonce was used). The same checks,
    the same words of a refusal."""
    key = token.strip().encode("utf-8")
    kept = _take_kept(address, key) if path in _KEPT_FOR else None
    if kept is not None:
        peer, value = _with_kept(kept, key, method, path, body)
        return peer, value, True
    cn = os.urandom(16).hex()
    answer, peer = yield (HELLO_PATH, {NONCE_HEADER: cn})
    peer, value = proven_by(address, key, cn, answer, peer, method, path, body)
    return peer, value, False


# -- the next nonce: a gather's answer hands out what the next gather's hello would ------------------------

NEXT_HEADER = "X-Probe-Next-Nonce"  # as probe.host.gather.NEXT_HEADER (the client imports nothing of the host)
KEEP_S = 60.0  # a kept nonce is used within this (the listener keeps its nonces 120 s: NONCE_LIFE_S)
MAX_KEPT = 8192  # listeners with a kept nonce (2,048 nodes at 16k ranks); past it the oldest goes
_MAX_NEXT_CHARS = 4096
_KEPT_FOR = ("/v1/gather",)  # the one request that retries, with a hello, a kept nonce the listener refuses
_kept: "OrderedDict[Any, Tuple[str, str, str, str, Any, float]]" = OrderedDict()
_proven: "OrderedDict[Any, Tuple[str, Any]]" = OrderedDict()  # (address, token) -> (its proven address, peer)
_kept_lock = threading.Lock()
_local = threading.local()
_HEX = re.compile(r"[0-9a-f]+")


def ask_next() -> Dict[str, str]:
    """The header that asks a gather's answer for the next nonce: a fresh client nonce of our own."""
    return {NEXT_HEADER: os.urandom(16).hex()}


def keep_next(address: Any, token: str, asked: Dict[str, str], answer: Any) -> None:
    """Keep the next nonce that ``answer`` (to a request sent with ``asked``, from :func:`ask_next`) hands out,
    where its proof matches our token for the address this listener proved itself at (its hello's); else
    keep nothing: the next request begins with a hello, as without it. Never raises."""
    try:
        cn = asked[NEXT_HEADER]
        key = token.strip().encode("utf-8")
        value = answer.headers.get(NEXT_HEADER.lower())
        proven = _proven.get(_place(address, key))
        if not value or proven is None or len(value) > _MAX_NEXT_CHARS:
            return
        raw = json.loads(value)
        sn, _, proofs = _fields(raw)
        here, peer = proven
        scope = _match(key, cn, sn, here, proofs)
        if scope is not None:
            _remember(_kept, _place(address, key), (cn, sn, scope, here, peer, time.monotonic() + KEEP_S))
    except Exception:  # noqa: BLE001 -- hostile or odd: no kept nonce, a hello next time
        return


def reused() -> bool:
    """Whether this thread's last request went with a kept nonce instead of a hello (a refusal of it, the
    listener restarted meanwhile, is then retried with a hello)."""
    return bool(getattr(_local, "reused", False))


def _place(address: Any, key: bytes) -> Tuple[str, int, bytes]:
    return (str(getattr(address, "host", "")), int(getattr(address, "port", 0) or 0), key)


def _remember(store: "OrderedDict[Any, Any]", place: Any, value: Any) -> None:
    with _kept_lock:
        store.pop(place, None)
        store[place] = value
        while len(store) > MAX_KEPT:
            store.popitem(last=False)


def _take_kept(address: Any, key: bytes) -> Optional[Tuple[str, str, str, str, Any]]:
    """A kept nonce for this listener and token, taken (single-use), if fresh."""
    with _kept_lock:
        got = _kept.pop(_place(address, key), None)
    if got is None or got[5] < time.monotonic():
        return None
    return got[:5]


def _fields(raw: Any) -> Tuple[str, str, Dict[str, str]]:
    """A hello's nonce, claimed address and proofs, checked; ValueError otherwise."""
    if not (isinstance(raw, dict) and isinstance(raw.get("nonce"), str) and isinstance(raw.get("address"), str)
            and isinstance(raw.get("proofs"), dict) and len(raw["proofs"]) <= 8
            and all(isinstance(k, str) and isinstance(v, str) for k, v in raw["proofs"].items())):
        raise ValueError("not a probe hello")
    nonce = raw["nonce"]
    if not (len(nonce) == 32 and _HEX.fullmatch(nonce)):
        raise ValueError("the nonce is not 32 hex digits")
    return nonce, raw["address"][:300], raw["proofs"]


def _parse(answer: Any, address: Any) -> Tuple[str, str, Dict[str, str]]:
    """The hello's nonce, the address the listener names, and its proofs; :class:`Unproven` otherwise."""
    try:
        raw = json.loads(bytes(answer.body).decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raw = None
    if answer.status != 200:
        said = ""
        if isinstance(raw, dict) and isinstance(raw.get("error"), dict):
            said = ": it says %s" % str(raw["error"].get("message"))[:300]
            if raw["error"].get("code") in ("busy", "timeout"):  # every slot taken: wait, as for any request
                from probe.errors import error_from_code

                raise error_from_code(str(raw["error"]["code"]), str(raw["error"].get("message"))[:300],
                                      str(raw["error"].get("hint") or "")[:300] or None)
        raise _unproven(address, "it does not answer GET %s (HTTP %d%s)" % (HELLO_PATH, answer.status, said),
                        "is it a probe agent or host helper of this version? Upgrade probe where the job runs")
    if not (isinstance(raw, dict) and isinstance(raw.get("nonce"), str) and isinstance(raw.get("address"), str)
            and isinstance(raw.get("proofs"), dict) and len(raw["proofs"]) <= 8
            and all(isinstance(k, str) and isinstance(v, str) for k, v in raw["proofs"].items())):
        raise _unproven(address, "its answer to GET %s is not a probe hello" % HELLO_PATH,
                        "is it a probe agent or host helper? `probe list` on its host says who holds the port")
    nonce = raw["nonce"]
    if not (len(nonce) == 32 and _HEX.fullmatch(nonce)):
        raise _unproven(address, "the nonce of its hello is not 32 hex digits", "is it a probe agent of this version?")
    return nonce, raw["address"][:300], raw["proofs"]


def _match(key: bytes, cn: str, sn: str, address: str, proofs: Dict[str, str]) -> Optional[str]:
    """The scope whose proof matches ours for ``address``; None where none does. Every proof is compared."""
    expected = server_proof(key, cn, sn, address)
    found = None
    for scope, proof in proofs.items():
        if proof.isascii() and hmac.compare_digest(expected, proof[:64].lower()) and scope in ("read", "control", "eval"):
            found = scope
    return found


def _same_place(claimed: str, here: str) -> bool:
    """The same port on loopback at both ends (``127.0.0.1`` and ``::1``, as an SSH tunnel to ``localhost``
    may give): one place. A relay of a squatter that made the agent move is on another port."""
    host_a, _, port_a = claimed.rpartition(":")
    host_b, _, port_b = here.rpartition(":")
    return port_a == port_b and all(_loopback(h.strip("[]")) for h in (host_a, host_b))


def _loopback(host: str) -> bool:
    return host == "::1" or host.startswith("127.")


def _unproven(address: Any, why: str, hint: str) -> ProbeError:
    return Unproven("the listener at %s could not prove it holds the job's token: %s; nothing of the token was "
                    "sent to it" % (address, why), hint=hint)
