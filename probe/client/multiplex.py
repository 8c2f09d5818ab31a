"""Many HTTP exchanges at once from ONE thread: non-blocking sockets and a selector.

A look through the node helpers at 16,384 ranks talks to 2,048 helpers, twice at a diagnosis's first look
(a hello, then the gather). With a thread a request (``probe.client.fanout``) hundreds of threads take
turns on the interpreter's lock, each waking to ask for it; here one thread waits on every socket at once
and takes each step as its socket is ready: connect, send, read the answer as it comes.

Each exchange with one listener is a *conversation*: a generator that yields the requests it makes, one
at a time (:class:`Exchange`), is sent each whole answer with the socket address it came from, and returns
its result. So the steps of one listener (a hello, its proof checked, then the request) read as they
would with blocking calls, and the token handshake stays ``probe.client.proof``'s.

Kept connections: a request may ask the listener to keep its connection (``Connection: keep-alive``, a
node helper's listener does: ``probe.agent.listener``). Where the answer says it did, the socket waits for
the conversation's next request to the same proven socket address (a gather after its hello), and after
the conversation for the next one's (the next look's gather), for at most ``KEEP_REUSE_S``: fewer
connections for both ends. A request on a kept socket that gets no byte back (the listener closed it
meanwhile) is sent once more on a fresh connection.

What comes back is bounded as ``transport.read_response`` bounds it: the answer whole by its deadline,
its header at most 64 KiB, a valid ``Content-Length`` of at most ``MAX_RESPONSE_BYTES``, a large body only
with room in ``MAX_IN_FLIGHT_BYTES``; and the errors say the same words. Plain TCP only: with TLS the
caller keeps the threads (``usable``).
"""

import errno
import resource
import selectors
import socket
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, Generator, List, NamedTuple, Optional, Sequence, Tuple

import probe.client.transport as transport
from probe.client.fanout import MAX_OPEN, SLOW_AFTER_S, Outcome, unanswered
from probe.client.resolver import Resolver
from probe.client.wording import option
from probe.errors import ConnectError, ConnectionRefused, ProbeError, Timeout

__all__ = ["Exchange", "Conversation", "usable", "run", "close_kept", "KEEP_REUSE_S"]

_HEAD_MAX = 65536
_SWEEP_S = 0.02  # how often every conversation is looked at (deadlines, room for a large answer, the slow)
_RESOLVE_S = 0.005  # how often, while some host name is being looked up, whether it is
KEEP_REUSE_S = 3.0  # a kept socket is used again within this (a listener keeps it 5 s: listener.KEEP_IDLE_S)
_MAX_KEPT = 4096  # kept sockets, at most (and at most a quarter of this process's descriptors)


class Exchange(NamedTuple):
    """One request of a conversation: to ``address`` (at the socket address ``to`` where one was proven,
    else its host resolved), the request's bytes, by when its answer must be in (``time.monotonic()``), and
    the seconds that was from its start (for the words of a timeout)."""

    address: "transport.TcpAddress"
    to: Any
    payload: bytes
    deadline: float
    timeout: float


Conversation = Generator[Exchange, Tuple["transport.HttpResponse", Any], Any]


def usable() -> bool:
    """Whether this process's TCP connections are plain (no TLS): then they can all be waited on here. (A
    TLS setting that cannot be used says so on each request of the threads' path, as before.)"""
    try:
        return transport.tls_context() is None
    except ProbeError:
        return False


class _Talk:
    """One conversation's state: its generator and the exchange under way."""

    __slots__ = ("index", "gen", "ex", "sock", "state", "candidates", "sent", "buf", "status", "headers", "body",
                 "length", "received", "peer", "room", "reused", "whole")

    def __init__(self, index: int, gen: Conversation) -> None:
        self.index, self.gen = index, gen
        self.ex: Optional[Exchange] = None
        self.sock: Optional[socket.socket] = None
        self.state = "connect"
        self.candidates: List[Any] = []
        self.sent = 0
        self.buf = b""
        self.status = 0
        self.headers: Dict[str, str] = {}
        self.body: Any = None
        self.length = 0
        self.received = 0
        self.peer: Any = None
        self.room = 0
        self.reused = False  # the exchange under way went on a kept socket
        self.whole = False  # the answer ended exactly at its Content-Length (nothing after it: reusable)


def run(starts: Sequence[Callable[[], Conversation]], in_flight: int, deadline: float,
        slow_after: float = SLOW_AFTER_S, max_open: int = MAX_OPEN) -> List[Outcome]:
    """Every conversation (``starts[i]()`` makes the i-th), an outcome each, in order, as ``fan_out``:
    at most ``in_flight`` young ones at once, one unanswered after ``slow_after`` s letting another start,
    up to ``max_open``; those unfinished at ``deadline`` s get a ``Timeout`` in ``fan_out``'s words."""
    total = len(starts)
    outcomes: List[Optional[Outcome]] = [None] * total
    began: List[Optional[float]] = [None] * total
    talks: Dict[int, _Talk] = {}
    sel = selectors.DefaultSelector()
    resolver = Resolver()
    resolving: Dict[int, _Talk] = {}  # conversations whose host name is being looked up
    end = time.monotonic() + deadline
    max_open = max(max_open, in_flight)
    nxt = 0
    done = 0

    def finish(talk: _Talk, value: Any, error: Optional[ProbeError]) -> None:
        nonlocal done
        _drop(sel, talk, keep=error is None)
        talks.pop(talk.index, None)
        if error is not None:
            talk.gen.close()
        outcomes[talk.index] = Outcome(value, error, time.monotonic() - (began[talk.index] or 0.0))
        done += 1

    def advance(talk: _Talk, answer: Any) -> None:
        """The conversation's next step, given the answer to its last exchange (None: its first)."""
        try:
            ex = talk.gen.send(answer)
        except StopIteration as stop:
            finish(talk, stop.value, None)
            return
        except ProbeError as exc:
            finish(talk, None, exc)
            return
        except Exception as exc:  # a bug, or something not translated: this conversation's failure only
            finish(talk, None, ProbeError("%s: %s" % (type(exc).__name__, exc)))
            return
        parked = talk.sock if talk.state == "parked" else None
        talk.ex, talk.state, talk.sent, talk.buf, talk.received = ex, "connect", 0, b"", 0
        talk.body, talk.room, talk.reused, talk.whole = None, 0, False, False
        if parked is not None and ex.to is not None and ex.to == talk.peer:
            _resume(sel, talk, parked)  # the same listener: on the socket its last answer came on
            return
        if parked is not None:
            talk.state = "parked"
            _drop(sel, talk, keep=True)
            talk.state = "connect"
        kept = _take_kept(ex.to) if ex.to is not None else None
        if kept is not None:
            talk.peer = ex.to
            _resume(sel, talk, kept)
            return
        if ex.to is None:
            talk.state = "resolve"
            resolving[talk.index] = talk
            connect(talk)
            return
        talk.candidates = [(socket.AF_INET6 if len(ex.to) == 4 else socket.AF_INET, ex.to)]
        try:
            _connect_next(sel, talk)
        except ProbeError as exc:
            finish(talk, None, exc)

    def connect(talk: _Talk) -> None:
        """Connect a conversation whose host is looked up, once it is (``probe.client.resolver``)."""
        try:
            got = resolver.lookup(talk.ex.address.host, talk.ex.address.port, talk.ex.address)  # type: ignore[union-attr]
            if got is None:
                return
            resolving.pop(talk.index, None)
            talk.candidates = list(got)
            _connect_next(sel, talk)
        except ProbeError as exc:
            resolving.pop(talk.index, None)
            finish(talk, None, exc)

    swept, slow, soonest = -1.0, 0, end
    try:
        while done < total:
            now = time.monotonic()
            if now >= end:
                break
            # What looks at every conversation (the slow ones, deadlines, room) once a sweep, not at each
            # wake: thousands of answers a second wake this loop as often, a few sockets each time.
            sweep = now - swept >= _SWEEP_S or now >= soonest
            if sweep:
                swept = now
                slow = sum(1 for i in talks if now - (began[i] or now) > slow_after)
            allowance = min(max(1, in_flight) + slow, max_open)
            while nxt < total and len(talks) < allowance:
                i, nxt = nxt, nxt + 1
                began[i] = time.monotonic()
                talk = talks[i] = _Talk(i, starts[i]())
                advance(talk, None)
            if sweep:
                for talk in list(talks.values()):  # past its own deadline, or waiting for room
                    if talk.ex is None:
                        continue
                    if time.monotonic() >= talk.ex.deadline:
                        finish(talk, None, _late(talk))
                    elif talk.state == "room":
                        _try_room(sel, talk)
                soonest = min([t.ex.deadline for t in talks.values() if t.ex is not None] + [end])
            for talk in list(resolving.values()):
                if talk.index in talks:
                    connect(talk)
                else:
                    resolving.pop(talk.index, None)
            if done >= total:
                break
            wait = max(0.0, min(_RESOLVE_S if resolving else _SWEEP_S, soonest - time.monotonic()))
            for key, _ in sel.select(wait) if talks else ():
                talk = key.data
                if talk.index not in talks:
                    continue
                try:
                    answer = _step(sel, talk)
                except ProbeError as exc:
                    if talk.reused and not talk.received:  # a kept socket the listener had closed: afresh
                        _again(sel, talk, finish)
                    else:
                        finish(talk, None, exc)
                    continue
                if answer is not None:
                    _park(sel, talk)
                    advance(talk, (answer, talk.peer))
            if not talks and nxt >= total:
                break
    finally:
        resolver.close()
        for talk in list(talks.values()):
            _drop(sel, talk)
            talk.gen.close()
        sel.close()
        _prune(time.monotonic())
    return [o if o is not None else unanswered(began[i] is not None, deadline) for i, o in enumerate(outcomes)]


def _connect_next(sel: selectors.BaseSelector, talk: _Talk, error: Optional[int] = None) -> None:
    """Start connecting to the next socket address of the exchange; where none is left, the last error."""
    assert talk.ex is not None
    while talk.candidates:
        family, sockaddr = talk.candidates.pop(0)
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            code = sock.connect_ex(sockaddr)
        except OSError as exc:
            sock.close()
            error = exc.errno or errno.EIO
            continue
        if code not in (0, errno.EINPROGRESS, errno.EAGAIN, errno.EWOULDBLOCK):
            sock.close()
            error = code
            continue
        talk.sock, talk.state = sock, "connect"
        sel.register(sock, selectors.EVENT_WRITE, talk)
        return
    address = talk.ex.address
    if error == errno.ECONNREFUSED:
        raise ConnectionRefused("no agent at %s (connection refused)" % (address,))
    raise ConnectError("cannot connect to %s: %s" % (address, _words(error)))


def _words(code: Optional[int]) -> str:
    import os

    return os.strerror(code) if code else "no address"


def _step(sel: selectors.BaseSelector, talk: _Talk) -> Optional["transport.HttpResponse"]:
    """What a ready socket allows: the connect's end, more of the request sent, more of the answer read;
    the whole answer once it is in (the socket then closed)."""
    sock, ex = talk.sock, talk.ex
    assert sock is not None and ex is not None
    if talk.state == "connect":
        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            _drop(sel, talk)
            _connect_next(sel, talk, code)
            return None
        try:
            talk.peer = sock.getpeername()
        except OSError as exc:
            _drop(sel, talk)
            _connect_next(sel, talk, exc.errno)
            return None
        talk.state = "send"
    if talk.state == "send":
        try:
            while talk.sent < len(ex.payload):
                talk.sent += sock.send(ex.payload[talk.sent:])
        except BlockingIOError:
            return None
        except (BrokenPipeError, ConnectionResetError):
            pass  # the listener answered before it read all of the request (e.g. 413): read that answer
        except OSError as exc:
            raise ConnectError("connection to %s failed: %s" % (ex.address, exc.strerror or exc)) from None
        talk.state = "read"
        sel.modify(sock, selectors.EVENT_READ, talk)
        return None
    if talk.state != "read":
        return None
    try:
        chunk = sock.recv(65536 if talk.body is None else min(1 << 20, max(talk.length - len(talk.body), 1)))
    except BlockingIOError:
        return None
    except OSError as exc:
        _fail_body(talk)
        raise ConnectError("connection to %s failed: %s" % (ex.address, exc.strerror or exc)) from None
    talk.received += len(chunk)
    if talk.body is None:
        return _head(sel, talk, chunk)
    if not chunk:
        got = len(talk.body)
        _fail_body(talk)
        raise ConnectError("%s closed the connection after %d of the %d bytes of its answer" % (ex.address, got, talk.length),
                           hint="the answer was cut short (an agent gives up on a client that takes no byte for 10 s); "
                                "retry")
    talk.body += chunk
    return _whole(talk)


def _head(sel: selectors.BaseSelector, talk: _Talk, chunk: bytes) -> Optional["transport.HttpResponse"]:
    """The answer's header, once it is in: checked as ``transport`` checks it."""
    address = talk.ex.address  # type: ignore[union-attr]
    if not chunk:
        raise ConnectError("%s closed the connection without an answer" % (address,))
    talk.buf += chunk
    end = talk.buf.find(b"\r\n\r\n", max(0, len(talk.buf) - len(chunk) - 3))
    if end < 0:
        if len(talk.buf) > _HEAD_MAX:
            raise ConnectError("%s sent an oversized response header" % (address,))
        return None
    head, rest = talk.buf[:end], talk.buf[end + 4:]
    talk.buf = b""
    status, headers, length = transport.checked_head(head, address)
    talk.status, talk.headers, talk.length = status, headers, length
    talk.whole = len(rest) <= length  # bytes past the answer: the socket is not reused
    talk.body = transport._Body(rest[:length])
    talk.room = length if length - len(talk.body) > transport._FREE_BYTES else 0
    if talk.room:
        talk.state = "room"
        sel.unregister(talk.sock)  # type: ignore[arg-type]
        _try_room(sel, talk)
        return None
    return _whole(talk)


def _try_room(sel: selectors.BaseSelector, talk: _Talk) -> None:
    """A large answer's place in ``MAX_IN_FLIGHT_BYTES``, without waiting: read on once it has one (each
    turn of the loop asks again until the exchange's deadline)."""
    if transport._room.take(talk.room, time.monotonic()):
        talk.body.ticket = transport._Ticket(talk.room)
        talk.state = "read"
        sel.register(talk.sock, selectors.EVENT_READ, talk)  # type: ignore[arg-type]


def _whole(talk: _Talk) -> Optional["transport.HttpResponse"]:
    if len(talk.body) < talk.length:
        return None
    return transport.HttpResponse(talk.status, talk.headers, talk.body)


def _fail_body(talk: _Talk) -> None:
    if talk.body is not None:
        talk.body.clear()
        transport.release(transport.HttpResponse(talk.status, talk.headers, talk.body))
        talk.body = None


def _late(talk: _Talk) -> ProbeError:
    """The timeout of an exchange still under way at its deadline, in ``transport``'s words."""
    ex = talk.ex
    assert ex is not None
    state, received = talk.state, talk.received
    _fail_body(talk)
    if state == "room":
        return Timeout("the answer from %s (%.0f MB) found no room in time: the answers of other targets being "
                       "received filled the client's bound of %d MB" % (ex.address, talk.length / 1e6,
                                                                         transport.MAX_IN_FLIGHT_BYTES // 10**6),
                       hint="ask fewer targets at once (%s), or each for less" % option("--max-in-flight", "max_in_flight="))
    if state == "resolve":
        return Timeout("looking up the host of %s took longer than %.1f s" % (ex.address, ex.timeout),
                       hint="its node's name resolves slowly here (DNS): retry, or start the job with PROBE_HOST=<the node's address> on each node (docs/launchers.md), so that its helper is named by its address")
    if state == "connect":
        return Timeout("connecting to %s timed out after %.1f s" % (ex.address, ex.timeout))
    if state == "send":
        return Timeout("sending to %s timed out after %.1f s" % (ex.address, ex.timeout))
    wait = option("--timeout", "timeout=")
    if received:
        return Timeout("the answer from %s did not arrive whole within %.1f s (%d bytes came)" % (ex.address, ex.timeout, received),
                       hint="%s bounds the whole answer: raise it for a large answer over a slow link" % wait)
    return Timeout("no answer from %s within %.1f s" % (ex.address, ex.timeout),
                   hint="the agent may be busy; retry with a larger %s" % wait)


def _drop(sel: selectors.BaseSelector, talk: _Talk, keep: bool = False) -> None:
    """The exchange's socket forgotten by the selector and closed; ``keep``: one parked after a whole answer
    the listener keeps the connection for is kept for another conversation to the same address instead."""
    sock, talk.sock = talk.sock, None
    if sock is None:
        return
    try:
        sel.unregister(sock)
    except (KeyError, ValueError):
        pass
    if keep and talk.state == "parked" and talk.peer is not None:
        _keep(talk.peer, sock)
    else:
        sock.close()


def _park(sel: selectors.BaseSelector, talk: _Talk) -> None:
    """An exchange's answer is in: its socket waits, unwatched, for the conversation's next request where the
    listener keeps the connection (it said ``keep-alive``, and sent nothing past the answer); else closed."""
    sock = talk.sock
    if sock is None:
        return
    if not (talk.whole and talk.headers.get("connection", "").lower() == "keep-alive"):
        _drop(sel, talk)
        return
    try:
        sel.unregister(sock)
    except (KeyError, ValueError):
        pass
    talk.state = "parked"


def _resume(sel: selectors.BaseSelector, talk: _Talk, sock: socket.socket) -> None:
    """Send the exchange on a kept socket (connected, its peer the exchange's ``to``)."""
    talk.sock, talk.state, talk.reused = sock, "send", True
    sel.register(sock, selectors.EVENT_WRITE, talk)


def _again(sel: selectors.BaseSelector, talk: _Talk, finish: Callable[[_Talk, Any, Optional[ProbeError]], None]) -> None:
    """The exchange once more on a fresh connection to its ``to``: its kept socket was closed by the listener."""
    ex = talk.ex
    assert ex is not None and ex.to is not None
    _drop(sel, talk)
    talk.state, talk.sent, talk.buf, talk.reused = "connect", 0, b"", False
    talk.candidates = [(socket.AF_INET6 if len(ex.to) == 4 else socket.AF_INET, ex.to)]
    try:
        _connect_next(sel, talk)
    except ProbeError as exc:
        finish(talk, None, exc)


# -- sockets kept between conversations (the next look's gather to the same node helper) ------------------

_kept: "OrderedDict[Any, Tuple[socket.socket, float]]" = OrderedDict()  # socket address -> (socket, kept at)
_kept_lock = threading.Lock()


def _keep(peer: Any, sock: socket.socket) -> None:
    with _kept_lock:
        old = _kept.pop(peer, None)
        _kept[peer] = (sock, time.monotonic())
        while len(_kept) > _kept_bound():
            old_peer, (old_sock, _) = _kept.popitem(last=False)
            old_sock.close()
    if old is not None:
        old[0].close()


def _take_kept(peer: Any) -> Optional[socket.socket]:
    """A kept socket to ``peer``, taken, if fresh and still open at the listener's end."""
    with _kept_lock:
        got = _kept.pop(peer, None)
    if got is None:
        return None
    sock, at = got
    if time.monotonic() - at < KEEP_REUSE_S:
        try:
            sock.recv(1, socket.MSG_PEEK)  # non-blocking: nothing to read is what an open, idle one says
        except BlockingIOError:
            return sock
        except OSError:
            pass
    sock.close()  # closed by the listener (or it sent something unasked), or too old to trust
    return None


def close_kept() -> None:
    """Close every kept socket (as this process's exit would): the next run connects afresh."""
    _prune(float("inf"))


def _prune(now: float) -> None:
    """Close the kept sockets too old to be used again."""
    with _kept_lock:
        old = [peer for peer, (_, at) in _kept.items() if now - at >= KEEP_REUSE_S]
        socks = [_kept.pop(peer)[0] for peer in old]
    for sock in socks:
        sock.close()


def _kept_bound() -> int:
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        return 256
    return _MAX_KEPT if soft == resource.RLIM_INFINITY else max(0, min(_MAX_KEPT, soft // 4))
