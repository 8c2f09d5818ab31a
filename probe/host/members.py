"""The ranks of this node: the launcher's children, read from ``/proc`` (their environment says who
they are), remembered so that a rank that died or restarted is still named. Stdlib only."""

import os
import socket
import threading
import time
from typing import Any, Dict, List, NamedTuple, Optional

from probe import _paths, _rank
from probe.reader import proc

__all__ = ["Member", "Members", "node_host"]

_ENV_KEYS = frozenset([n.encode("ascii") for n in _rank.NAMES] + [b"MASTER_ADDR", b"TORCHELASTIC_RESTART_COUNT"])
STALE_HEARTBEAT_S = 2.0


class Member(NamedTuple):
    """One rank as its node sees it. ``state``: running, silent (its agent has not run for seconds),
    stopped, starting (no agent socket yet), dead (exited; its parent may not have reaped it)."""

    rank: int
    local_rank: int
    world_size: int
    node: int
    host: str
    port: int
    pid: int
    state: str
    restarts: int
    heartbeat_age: Optional[float]

    def to_json(self) -> Dict[str, Any]:
        return self._asdict()


def node_host() -> str:
    """How other hosts reach this one: ``$PROBE_HOST``, else the host name."""
    return os.environ.get("PROBE_HOST") or socket.gethostname()


def _environ(pid: int) -> Dict[bytes, bytes]:
    try:
        with open("/proc/%d/environ" % pid, "rb") as handle:
            raw = handle.read(1 << 20)
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep and name in _ENV_KEYS:
            out[name] = value
    return out


def _children(pid: int) -> List[int]:
    """Direct children of ``pid``: /proc/PID/task/*/children, else a scan of every /proc/N/stat."""
    found: List[int] = []
    try:
        for tid in os.listdir("/proc/%d/task" % pid):
            with open("/proc/%d/task/%s/children" % (pid, tid), "rb") as handle:
                found.extend(int(p) for p in handle.read().split())
        return found
    except (OSError, ValueError):
        pass
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open("/proc/%s/stat" % name, "rb") as handle:
                    stat = handle.read()
                if int(stat[stat.rindex(b")") + 2:].split()[1]) == pid:
                    found.append(int(name))
            except (OSError, ValueError, IndexError):
                continue
    return found


def _int(raw: Optional[bytes], default: int = -1) -> int:
    try:
        return int(raw) if raw is not None else default
    except ValueError:
        return default


class Members:
    """The ranks among this process's children; a rank seen once is kept (dead) until replaced."""

    def __init__(self, base_port: int, parent: Optional[int] = None) -> None:
        self.base_port = base_port
        self.parent = parent if parent is not None else os.getpid()
        self.master_addr: Optional[str] = None
        self.node: Optional[int] = None
        self._known: Dict[int, Dict[str, Any]] = {}  # rank -> what was learnt from /proc
        self._lock = threading.Lock()

    def scan(self) -> List[Member]:
        """Look at the children now; every rank ever seen, in rank order, with its state now."""
        host = node_host()
        with self._lock:
            for pid in _children(self.parent):
                if any(k["pid"] == pid for k in self._known.values()):
                    continue
                env = _environ(pid)
                who = _rank.from_environ({k.decode("ascii"): v.decode("ascii", "replace") for k, v in env.items()})
                if who.rank is None or who.local_rank is None:
                    continue  # not a rank (some other child of the launcher)
                rank = who.rank
                self.master_addr = (env.get(b"MASTER_ADDR") or b"").decode("ascii", "replace") or None
                self.node = who.node or 0
                self._known[rank] = {"pid": pid, "local_rank": who.local_rank,
                                     "world_size": who.world_size or 0, "node": self.node,
                                     "restarts": _int(env.get(b"TORCHELASTIC_RESTART_COUNT"), 0)}
            known = sorted(self._known.items())
        return [self._member(rank, info, host) for rank, info in known]

    def world_size(self) -> Optional[int]:
        """The world size this node's ranks were started with; None before any is seen, or when they
        disagree (an elastic restart with another size)."""
        if not self._known:
            self.scan()
        with self._lock:
            sizes = {k["world_size"] for k in self._known.values() if k["world_size"] > 0}
        return sizes.pop() if len(sizes) == 1 else None

    def pid_of(self, pid: int) -> bool:
        """Whether ``pid`` is (or was) one of our ranks: the only processes the helper reads."""
        with self._lock:
            return any(k["pid"] == pid for k in self._known.values())

    def _member(self, rank: int, info: Dict[str, Any], host: str) -> Member:
        pid = info["pid"]
        letter = proc.state(pid)
        age: Optional[float] = None
        if letter in (None, "Z", "X"):
            state = "dead"
        elif letter in ("T", "t"):
            state = "stopped"
        else:
            try:
                age = max(0.0, time.time() - os.stat(_paths.socket_path(pid)).st_mtime)
                state = "silent" if age > STALE_HEARTBEAT_S else "running"
            except OSError:
                state = "starting"
        return Member(rank, info["local_rank"], info["world_size"], info["node"], host,
                      self.base_port + info["local_rank"], pid, state, info["restarts"],
                      None if age is None else round(age, 2))
