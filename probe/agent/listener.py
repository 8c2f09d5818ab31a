"""Listening sockets of the agent: accept, admit, and serve each connection on a worker thread.

Every connection costs a slot (at most ``MAX_CONNECTIONS``); when all are taken, the oldest connection
that has not finished sending its request is closed, so that idle or slow clients cannot lock out
those with a request. Unix peers must run as our uid. Stdlib only; Python 3.9+.
"""

import json
import os
import queue
import socket
import struct
import threading
import time
from typing import Dict

from probe.agent import switch
from probe.agent.http import Handler, Response, read_request, send
from probe.errors import Forbidden, ProbeError

__all__ = ["Listener", "MAX_CONNECTIONS", "READ_TIMEOUT_S"]

READ_TIMEOUT_S = 10.0
WRITE_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 32


class Listener:
    """One listening socket, its accept thread, and worker threads (one per open connection, reused)."""

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
            # No umask change: it is process-wide, and the target's threads may be creating files. The
            # directory is the owner's alone (0700), so nobody can reach the socket before the chmod.
            sock.bind(path)
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
                send(conn, Response.error(Forbidden("only the owner of this process may connect")))
                return
            with self._reading_lock:
                self._reading[conn] = time.monotonic()
            try:
                request = read_request(conn, self.transport)
            except ProbeError as exc:
                send(conn, Response.error(exc))
                return
            except (OSError, ValueError):
                return  # the client went away, timed out, or was evicted; nothing to answer
            finally:
                with self._reading_lock:
                    self._reading.pop(conn, None)
            response = self._handler(request)
            conn.settimeout(WRITE_TIMEOUT_S)
            send(conn, response)
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




def _reject_busy(conn: socket.socket) -> None:
    try:
        conn.settimeout(1.0)
        body = json.dumps({"error": {"code": "busy", "message": "the agent has too many open connections",
                                     "hint": "retry in a moment"}})
        send(conn, Response(503, body.encode("utf-8")))
    except BaseException:
        pass
    finally:
        try:
            conn.close()
        except OSError:
            pass
