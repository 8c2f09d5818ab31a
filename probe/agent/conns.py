"""One accepted connection of a listener (``probe.agent.listener``): who is at the other end, whether it is
still there or has more to send, and how to let it go without closing a descriptor number that is no
longer ours. Stdlib only.
"""

import _socket
import select
import socket
import struct
import time
from typing import Optional, Tuple

from probe._fds import Identity, fd_identity

__all__ = ["_peer_gone", "_peer_creds", "_peer_name", "_has_input", "_linger", "_close"]


def _peer_gone(conn: socket.socket) -> bool:
    """The client closed its end while its request waited: it gave up (the agent could not get the GIL,
    say), so nothing it asked for should run now."""
    timeout = conn.gettimeout()
    try:
        conn.setblocking(False)  # a socket with a timeout would wait for bytes, even with MSG_DONTWAIT
        return _socket.socket.recv(conn, 1, socket.MSG_PEEK) == b""  # raw: TLS sockets take no flags
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True
    finally:
        try:
            conn.settimeout(timeout)
        except OSError:
            pass


def _peer_creds(conn: socket.socket) -> "Optional[Tuple[int, int, int]]":
    """SO_PEERCRED of a unix peer: (pid, uid, gid); None where it cannot be read. The connecting process
    must run as our uid (the file mode already says so)."""
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return None
    return struct.unpack("3i", creds)


def _peer_name(conn: socket.socket, creds: "Optional[Tuple[int, int, int]]") -> str:
    """Who sent a request, for the audit trail: ``uid U pid P`` on the unix socket, ``HOST:PORT`` on TCP."""
    if creds is not None:
        return "uid %d pid %d" % (creds[1], creds[0])
    try:
        host, port = conn.getpeername()[:2]
    except (OSError, ValueError, TypeError):
        return "?"
    name = "[%s]:%d" % (host, port) if ":" in host else "%s:%d" % (host, port)
    subject = _client_subject(conn)
    return "%s (%s)" % (name, subject) if subject else name


def _client_subject(conn: socket.socket) -> str:
    """Under mutual TLS, who the client's certificate says it is (``CN=alice``); "" elsewhere."""
    getpeercert = getattr(conn, "getpeercert", None)
    if getpeercert is None:
        return ""
    try:
        cert = getpeercert() or {}
        names = [value for rdn in cert.get("subject", ()) for key, value in rdn if key == "commonName"]
    except (OSError, ValueError, TypeError, AttributeError):
        return ""
    return "CN=%s" % names[0][:200] if names else ""


def _has_input(conn: socket.socket) -> bool:
    """Bytes (or an end) are waiting to be read on ``conn``; poll, not select: fds may exceed 1024."""
    try:
        poller = select.poll()
        poller.register(conn, select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _linger(conn: socket.socket, seconds: float, limit: int) -> None:
    """After answering a request that was not read whole: stop writing, read and discard what the
    client still sends (bounded in time and bytes), so that its send completes and it reads our answer
    instead of a reset (or EPIPE) from closing with its input unread. ``seconds=0``: only what is there."""
    try:
        conn.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + seconds
        while limit > 0:
            conn.settimeout(max(deadline - time.monotonic(), 0.0))
            chunk = conn.recv(min(65536, limit))
            if not chunk:
                return
            limit -= len(chunk)
    except OSError:  # timed out, nothing more waiting, or the client went away
        pass


def _close(conn: socket.socket, ident: Optional[Identity] = None) -> None:
    """Close ``conn``; given its identity, only if its number still refers to it (else let the number go)."""
    try:
        if ident is not None and fd_identity(conn.fileno()) != ident:
            conn.detach()
        else:
            conn.close()
    except OSError:
        pass
