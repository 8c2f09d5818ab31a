"""Listening sockets of the agent: accept, admit, and serve each connection on a worker thread.

Every connection costs a slot (at most ``MAX_CONNECTIONS``). When all are taken, a new connection
waits (and those behind it wait in the kernel's listen backlog) until a slot frees, for at most
``BUSY_WAIT_S``; then it is answered 503 ``busy``, never closed without an answer. Meanwhile a
connection that has not sent its whole request within ``GRACE_S`` of being accepted gives up its slot,
so that idle or slow clients (perhaps without a token) cannot lock out those with a request; one that
sent its request in time is never evicted. Unix peers must run as our uid. Stdlib only; Python 3.9+.

Kept connections: a listener made with ``keep_alive`` (a node helper's plain TCP one) keeps a connection
open after its answer where the request asked for it (``Connection: keep-alive``), for the client's next
request (a node's gather right after its hello, then the next look's): at 16k ranks that spares 2,048
nodes two of their three connections a diagnosis. The kept connection holds its slot while it waits (at
most ``KEEP_IDLE_S``), and is evictable meanwhile as a connection that has not sent its request; each
request on it is read, authorized and answered as on a fresh one.

A descriptor number is ours only as long as the program leaves it: a program that closes every
descriptor it does not know (``os.closerange(3, ...)``, as daemons do) and then opens its own gets our
old numbers. So each socket is known by its inode (``fstat``), not its number: the accept thread looks
before every ``accept()`` (after its ``poll()``: a poll in progress keeps our old socket alive), a
worker before it answers, and ``close()`` before it closes. A number that is no longer ours is let go
(``detach``), never closed, and the listener listens again on a fresh socket at the same address.

TLS: where ``PROBE_TLS_CERT`` and ``PROBE_TLS_KEY`` name a certificate and its key, every TCP listener
(an agent's, a host helper's) speaks TLS, and ``PROBE_TLS_CLIENT_CA`` asks each client for a certificate
signed by that CA (mutual TLS). The handshake happens on the connection's worker, within its slot's
grace and ``READ_TIMEOUT_S``, never on the accept thread. A client that speaks the other way (plain
HTTP to a TLS port, a TLS hello to a plain one) is answered a plain HTTP error at once, with the header
``X-Probe-Tls`` saying what the port speaks, so that the client can say what to do.
"""

import _socket
import os
import queue
import select
import socket
import threading
import time
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

if TYPE_CHECKING:
    import ssl

import probe.agent.switch as switch
from probe._fds import fd_identity, keep_stdio_open
from probe._stderr import say as _say
from probe._threads import daemon_thread
from probe.agent.conns import _close, _has_input, _linger, _peer_creds, _peer_gone, _peer_name
from probe.agent.http import Handler, Request, Response, read_request, send
from probe.agent.sockets import _listen_tcp, _listen_unix, server_tls_from_env
from probe.errors import BadRequest, Busy, Forbidden, ProbeError

__all__ = ["Listener", "MAX_CONNECTIONS", "READ_TIMEOUT_S", "GRACE_S", "BUSY_WAIT_S", "HEARTBEAT_S", "name_os_thread",
           "fd_identity", "keep_stdio_open"]

READ_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 32
GRACE_S = 1.0  # a connection may take this long to send its request before it can lose its slot
HEARTBEAT_S = 0.25  # how often the accept thread wakes and touches its socket file (see _beat)
BUSY_WAIT_S = 5.0  # how long a new connection waits for a slot before it is answered 503
LINGER_S = 2.0  # after answering a request not read whole, how long (and how much) of the rest
LINGER_BYTES = 4 * 1024 * 1024  # of its input to read and discard, so that the client reads our answer
_POLL_S = 0.1  # while every slot is taken: how often to look for a connection to evict
_TCP_WAKE_S = 1.0  # how often a TCP accept thread (which has no heartbeat) looks that its socket is still ours
KEEP_IDLE_S = 5.0  # a connection kept open after its answer waits this long for its next request
KEEP_MAX_REQUESTS = 100  # requests on one kept connection; then it is closed after its answer

class Listener:
    """One listening socket, its accept thread, and worker threads (one per open connection, reused)."""

    def __init__(self, sock: socket.socket, transport: str, handler: Handler, name: str,
                 remake: Optional[Callable[[], socket.socket]] = None, tls: "Optional[ssl.SSLContext]" = None) -> None:
        self._sock = sock
        self._tls = tls  # TCP only: each connection is wrapped on its worker
        self._ident = fd_identity(sock.fileno())
        self._remake = remake  # a fresh listening socket at the same address, should the program close ours
        self._checks: List[Callable[[], None]] = []  # called every wake of the accept thread
        self.transport = transport
        self._handler = handler
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._reading: Dict[socket.socket, float] = {}  # admitted, request not yet read: when accepted
        self._reading_lock = threading.Lock()
        self._rejecting = False  # the last connection was answered busy: the next waits only briefly
        self._queue: "queue.SimpleQueue[socket.socket]" = queue.SimpleQueue()
        self._workers_lock = threading.Lock()
        self._idle = 0  # worker threads waiting for a connection
        self._waiting = 0  # connections handed over and not yet taken by a worker
        self._closed = False
        self._heartbeat_path: Optional[str] = None  # set for a unix socket: touched every HEARTBEAT_S
        self._last_beat = 0.0
        self._thread = daemon_thread(self._accept_loop, name)
        self.keep_alive = False  # keep a plain TCP connection open for the next request where it asks

    @classmethod
    def unix(cls, path: str, handler: Handler) -> "Listener":
        listener = cls(_listen_unix(path), "unix", handler, "probe-accept-unix", lambda: _listen_unix(path))
        listener._heartbeat_path = path
        return listener

    @classmethod
    def tcp(cls, host: str, port: int, handler: Handler, keep_alive: bool = False) -> "Listener":
        """``keep_alive``: keep a plain connection open for the client's next request where it asks."""
        tls = server_tls_from_env()  # first: a certificate that cannot be read binds no port
        sock = _listen_tcp(host, port)
        bound = int(sock.getsockname()[1])  # asked for port 0: listen again on the port we were given
        listener = cls(sock, "tcp", handler, "probe-accept-tcp", lambda: _listen_tcp(host, bound), tls)
        listener.keep_alive = keep_alive
        return listener

    @property
    def tls(self) -> bool:
        return self._tls is not None

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
        """Stop accepting; wakes the accept thread. Safe to call twice. A socket whose number the program
        has taken over is let go, not closed (nor shut down)."""
        if self._closed:
            return
        self._closed = True
        if not self._let_go_unless_ours():
            return
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        _close(self._sock)

    def forget(self) -> None:
        """In a forked child: drop our copy of the listening socket without disturbing the parent's."""
        self._closed = True
        if self._let_go_unless_ours():
            _close(self._sock)

    def add_check(self, check: Callable[[], None]) -> None:
        """Call ``check`` on the accept thread every time it wakes (every ``HEARTBEAT_S`` on a unix socket):
        how the agent's other descriptors (the crash record) are looked after. It must not raise."""
        self._checks.append(check)

    def _ours(self) -> bool:
        return self._ident is not None and fd_identity(self._sock.fileno()) == self._ident

    def _let_go_unless_ours(self) -> bool:
        """True while our socket is still at its number; else forget the number (never close it)."""
        if self._ours():
            return True
        try:
            self._sock.detach()
        except OSError:
            pass
        return False

    # -- the accept thread ---------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        name_os_thread("probe-accept")
        wake_ms = int(1000 * (HEARTBEAT_S if self._heartbeat_path else _TCP_WAKE_S))
        poller = self._poller()
        while not self._closed:
            self._beat()
            try:
                # poll, then look, then accept: while poll() waits it holds our old socket open even if the
                # program closed its number; only once it returned does fstat tell whose the number is.
                ready = poller.poll(wake_ms) if poller is not None else []
                for check in self._checks:
                    check()
                if self._closed:
                    return
                if not self._ours():
                    poller = self._listen_again()
                    continue
                if not ready:
                    continue
                conn, _ = self._sock.accept()  # non-blocking: another thread may have taken it
            except (BlockingIOError, InterruptedError, socket.timeout):
                continue
            except OSError:
                if not self._closed:
                    time.sleep(0.05)  # e.g. EMFILE: the target is out of file descriptors; don't spin
                continue
            except Exception:
                time.sleep(0.05)
                continue
            except BaseException:
                return
            try:
                self._admit(conn)
            except Exception:
                pass  # _admit answered or closed the connection; keep accepting

    def _poller(self) -> "Optional[select.poll]":
        try:
            self._sock.setblocking(False)
            poller = select.poll()
            poller.register(self._sock.fileno(), select.POLLIN)
            return poller
        except (OSError, ValueError):
            return None

    def _listen_again(self) -> "Optional[select.poll]":
        """The program closed our socket (and may have put its own at the number): let the number go, and
        listen on a fresh socket at the same address. Where that cannot be, say so once and stop."""
        self._let_go_unless_ours()
        try:
            if self._remake is None:
                raise OSError("no address to listen on again")
            sock = self._remake()
        except BaseException as exc:
            self._closed = True
            _say("probe: the program closed the agent's %s socket in process %d, and the agent cannot listen "
                 "again (%s); it serves no more %s" % (self.transport, os.getpid(), exc, self.transport))
            return None
        self._sock, self._ident = sock, fd_identity(sock.fileno())
        return self._poller()

    def _beat(self) -> None:
        """Touch the socket file at most every ``HEARTBEAT_S``: its mtime tells a client, without asking,
        that this thread still gets the GIL (a client that sees it stale knows at once that the agent
        cannot answer). Called wherever the accept thread runs: its loop, and its wait for a free slot."""
        now = time.monotonic()
        if not self._heartbeat_path or now - self._last_beat < HEARTBEAT_S:
            return
        self._last_beat = now
        try:
            os.utime(self._heartbeat_path)
        except OSError:
            pass

    def _admit(self, conn: socket.socket) -> None:
        """Give ``conn`` a slot and a worker, or answer it 503 busy (after a bounded wait)."""
        try:
            admitted = self._take_slot()
        except BaseException:
            _close(conn)
            raise
        if not admitted:
            _reject_busy(conn)
            return
        with self._reading_lock:
            self._reading[conn] = time.monotonic()
        switch.begin()  # from here on every GIL hand-over of this request is short
        try:
            self._dispatch(conn)
        except BaseException:  # no thread could be started: answer, never drop
            self._untrack(conn)
            _reject_busy(conn)
            self._release()
            raise

    def _take_slot(self) -> bool:
        """A free slot, or one freed within the bounded wait (evicting stale readers meanwhile)."""
        if self._slots.acquire(blocking=False):
            self._rejecting = False
            return True
        deadline = time.monotonic() + (_POLL_S if self._rejecting else BUSY_WAIT_S)
        while True:
            self._beat()
            self._evict_stale_reader()
            remaining = deadline - time.monotonic()
            if self._slots.acquire(timeout=min(_POLL_S, max(remaining, 0.0))):
                self._rejecting = False
                return True
            if remaining <= _POLL_S:
                self._rejecting = True
                return False

    def _evict_stale_reader(self) -> None:
        """Take the slot of the connection longest past ``GRACE_S`` without a whole request.

        Only its reading side is shut: its worker's ``recv()`` returns and the slot is freed, while a
        request that completed just now can still be answered. A connection with input waiting is
        skipped: its worker, not its client, is behind.
        """
        now = time.monotonic()
        with self._reading_lock:
            stale = sorted((t, id(c), c) for c, t in self._reading.items() if now - t > GRACE_S)
            for _, _, conn in stale:
                if _has_input(conn):
                    continue
                del self._reading[conn]
                try:
                    _socket.socket.shutdown(conn, socket.SHUT_RD)  # the raw call: a TLS socket's own drops TLS
                except OSError:
                    pass
                return

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
            try:
                daemon_thread(self._work, "probe-request").start()
            except BaseException:
                with self._workers_lock:
                    self._waiting -= 1
                    self._idle -= 1
                raise
        self._queue.put(conn)

    # -- worker threads ------------------------------------------------------------------------------

    def _work(self) -> None:
        me = threading.current_thread()
        name_os_thread("probe-worker")
        while not self._closed:
            me.name = "probe-idle"  # python.threads tells idle workers from those serving a request
            conn = self._queue.get()
            me.name = "probe-request"
            with self._workers_lock:
                self._waiting -= 1
                self._idle -= 1
            try:
                self._serve(conn)
            except BaseException:
                pass  # never let a connection's trouble end the worker or reach the target
            finally:
                with self._workers_lock:
                    self._idle += 1

    def _serve(self, conn: socket.socket) -> None:
        ident = fd_identity(conn.fileno())
        switching = True  # switch.begin() was called at admission, for this request
        try:
            conn.settimeout(READ_TIMEOUT_S)
            if self.transport == "tcp":
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                tls_conn = self._tls_or_refuse(conn)
                if tls_conn is None:
                    return
                conn = tls_conn  # the plain socket was detached into it: closed below as conn
            creds = None if self.transport == "tcp" else _peer_creds(conn)
            if self.transport != "tcp" and (creds is None or creds[1] != os.getuid()):
                send(conn, Response.error(Forbidden("only the owner of this process may connect")))
                return
            served = 0
            while self._answer(conn, ident, creds, served):
                served += 1
                switch.end()  # waiting for the next request: the target's own switch interval meanwhile
                switching = False
                if not self._next_request(conn):
                    return
                switch.begin()
                switching = True
        finally:
            self._untrack(conn)
            _close(conn, ident)
            self._release(switching)

    def _answer(self, conn: socket.socket, ident: object, creds: object, served: int) -> bool:
        """Read one request on ``conn`` and answer it; True where the connection is kept for the next."""
        try:
            request = read_request(conn, self.transport)
            request.peer = _peer_name(conn, creds)
        except ProbeError as exc:
            send(conn, Response.error(exc))
            _linger(conn, LINGER_S, LINGER_BYTES)  # still evictable meanwhile: it holds a slot
            return False
        except (OSError, ValueError):
            if not self._untrack(conn):  # evicted: say so, in case it was slow rather than idle
                send(conn, Response.error(Busy(
                    "the request was not complete %.0f s after the agent accepted the connection, and "
                    "the agent needed its slot for other clients" % GRACE_S, hint="retry")))
            return False  # otherwise the client went away or timed out; nothing to answer
        self._untrack(conn)  # evicted or not: a whole request is answered
        if _peer_gone(conn):
            return False  # asked long ago, and nobody waits for the answer: run nothing (an eval above all)
        response = self._handler(request)
        keep = self._keeps(request, served)
        on_sent, response.on_sent = response.on_sent, None
        try:
            if fd_identity(conn.fileno()) != ident:  # a snippet that closed descriptors may have taken it
                return False
            return send(conn, response, keep) and keep
        finally:
            del response  # the body goes before the budget hears it is free
            if on_sent is not None:
                on_sent()

    def _keeps(self, request: "Request", served: int) -> bool:
        """Whether the connection stays open after this request's answer: where this listener keeps them,
        over plain TCP, the request asked, and sent nothing past its body."""
        return (self.keep_alive and request.transport == "tcp" and self._tls is None and not self._closed
                and served + 1 < KEEP_MAX_REQUESTS and not request.trailing
                and request.headers.get("connection", "").lower() == "keep-alive")

    def _next_request(self, conn: socket.socket) -> bool:
        """Wait up to ``KEEP_IDLE_S`` for the first byte of a kept connection's next request; False where
        none came (the client closed it, went quiet, or the slot was taken back for another client)."""
        with self._reading_lock:
            self._reading[conn] = time.monotonic()  # evictable while it waits, as one not yet sending
        try:
            conn.settimeout(KEEP_IDLE_S)
            first = _socket.socket.recv(conn, 1, socket.MSG_PEEK)
            conn.settimeout(READ_TIMEOUT_S)
        except OSError:
            return False
        if not first or self._closed:
            return False
        with self._reading_lock:
            if conn not in self._reading:
                return False  # evicted just as the request came: its slot is another's
            self._reading[conn] = time.monotonic()  # a request's grace, from its first byte
        return True

    def _tls_or_refuse(self, conn: socket.socket) -> Optional[socket.socket]:
        """The connection to serve (wrapped in TLS, its handshake done, where this listener speaks TLS), or
        None when it was answered already: a client that speaks plain HTTP to a TLS port or TLS to a plain
        one gets a plain error naming what this port speaks; a failed handshake gets nothing."""
        try:
            first = _socket.socket.recv(conn, 1, socket.MSG_PEEK)  # waits at most READ_TIMEOUT_S
        except OSError:
            return None
        hello = first == b"\x16"  # a TLS record of type handshake: no HTTP method starts so
        if not first or hello == (self._tls is not None):
            if not hello:
                return conn
            return self._handshake(conn)
        speaks = "tls" if self._tls is not None else "plain"
        error = BadRequest("this port speaks TLS: connect with TLS (probe --cacert CA.pem)" if self._tls is not None
                           else "this port speaks plain HTTP, not TLS: connect without --cacert")
        response = Response.error(error)
        response.headers["X-Probe-Tls"] = speaks
        send(conn, response)
        _linger(conn, 0.0, 65536)
        return None

    def _handshake(self, conn: socket.socket) -> Optional[socket.socket]:
        assert self._tls is not None
        try:
            tls = self._tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        except (OSError, ValueError):
            return None
        with self._reading_lock:  # the plain socket is detached now: track (and evict) the wrapped one
            accepted = self._reading.pop(conn, None)
            if accepted is not None:
                self._reading[tls] = accepted
        try:
            tls.settimeout(READ_TIMEOUT_S)
            tls.do_handshake()
        except (OSError, ValueError, AttributeError):
            self._untrack(tls)
            _close(tls)
            return None
        return tls

    def _untrack(self, conn: socket.socket) -> bool:
        """The request phase is over; False when the connection had been evicted (or already untracked)."""
        with self._reading_lock:
            return self._reading.pop(conn, None) is not None

    def _release(self, switching: bool = True) -> None:
        self._slots.release()
        if switching:
            switch.end()


def name_os_thread(name: str) -> None:
    """Give the calling thread an OS-level name (``comm``), so that a reader outside the process, which
    sees no Python thread names, can tell the agent's threads from the program's."""
    try:
        with open("/proc/self/task/%d/comm" % threading.get_native_id(), "w") as handle:
            handle.write(name[:15])
    except (OSError, AttributeError):
        pass


def _reject_busy(conn: socket.socket) -> None:
    try:
        send(conn, Response.error(Busy("every connection slot of the agent is taken by requests in progress",
                                       hint="retry in a moment")))
        _linger(conn, 0.0, 65536)  # on the accept thread: only what already arrived
    except BaseException:
        pass
    finally:
        _close(conn)
