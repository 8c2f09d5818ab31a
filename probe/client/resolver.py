"""Host names looked up beside the one-thread fan-out (``probe.client.multiplex``), not in its thread.

A job's node helpers name their hosts as the hosts name themselves (``socket.gethostname()``), so a look at
2,048 nodes asks the resolver 2,048 times. In the thread that waits on every socket, each lookup (a
millisecond from a cache, tens from a DNS server, seconds from one that is down) held up every answer
behind it. Here a few daemon threads look names up, each name once, while the fan-out goes on with the
others; an address already numeric needs no lookup and is answered at once.
"""

import queue
import socket
import threading
from typing import Any, Dict, List, Optional, Tuple

from probe.errors import ConnectError

__all__ = ["Resolver", "WORKERS"]

WORKERS = 16
"""Lookups under way at once: a resolver that is slow for one name is seldom fast for the next."""

Key = Tuple[str, int]


class Resolver:
    """Each (host, port) looked up once, by up to ``workers`` daemon threads; :meth:`close` lets them go."""

    def __init__(self, workers: int = WORKERS) -> None:
        self._workers = max(1, workers)
        self._threads = 0
        self._asked: "queue.SimpleQueue[Optional[Key]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._done: Dict[Key, Tuple[Optional[List[Any]], Optional[str]]] = {}
        self._pending: set = set()

    def lookup(self, host: str, port: int, shown: Any) -> Optional[List[Any]]:
        """The socket addresses of ``host`` (``[(family, sockaddr), ...]``), or None while it is being looked
        up (ask again); ``ConnectError`` where it cannot be (``shown``: the address as the error names it)."""
        key = (host, port)
        with self._lock:
            got = self._done.get(key)
            if got is None and key in self._pending:
                return None
        if got is None:
            if _numeric(host):
                got = _getaddrinfo(host, port)
                with self._lock:
                    self._done[key] = got
            else:
                self._ask(key)
                return None
        infos, error = got
        if error is not None:
            raise ConnectError("cannot connect to %s: %s" % (shown, error))
        return infos

    def close(self) -> None:
        """No more lookups: the threads end once their own is done (a lookup cannot be cut short)."""
        with self._lock:
            threads, self._threads = self._threads, 0
        for _ in range(threads):
            self._asked.put(None)

    def _ask(self, key: Key) -> None:
        with self._lock:
            self._pending.add(key)
            start = self._threads < min(self._workers, len(self._pending))
            if start:
                self._threads += 1
        self._asked.put(key)
        if start:
            try:
                threading.Thread(target=self._work, name="probe-resolve", daemon=True).start()
            except RuntimeError:  # no thread to be had: looked up here, as before
                with self._lock:
                    self._threads -= 1
                self._answer(key)

    def _work(self) -> None:
        while True:
            key = self._asked.get()
            if key is None:
                return
            self._answer(key)

    def _answer(self, key: Key) -> None:
        with self._lock:
            if key in self._done:
                return
        got = _getaddrinfo(*key)
        with self._lock:
            self._done[key] = got
            self._pending.discard(key)


def _numeric(host: str) -> bool:
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host.split("%", 1)[0])
            return True
        except (OSError, ValueError):
            continue
    return False


def _getaddrinfo(host: str, port: int) -> Tuple[Optional[List[Any]], Optional[str]]:
    try:
        infos = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        return None, str(getattr(exc, "strerror", None) or exc)
    return [(family, sockaddr) for family, _, _, _, sockaddr in infos], None
