"""The ranks of this node, remembered so that a rank that died or restarted is still named. Stdlib only.

Two ways in: a rank registers itself (``register``: any launcher; it says its rank once it knows it, and
the port it really serves on), and, in torchrun's launcher, the launcher's children are read from
``/proc`` (their environment says who they are). What a rank registered wins over what ``/proc`` says."""

import os
import socket
import threading
import time
from typing import Any, Collection, Dict, List, NamedTuple, Optional

from probe import _paths, _rank
from probe.reader import proc

__all__ = ["Member", "Members", "node_host"]

_ENV_KEYS = frozenset([n.encode("ascii") for n in _rank.NAMES] + [b"MASTER_ADDR", b"TORCHELASTIC_RESTART_COUNT",
                                                                   b"PROBE_PORT"])
STALE_HEARTBEAT_S = 2.0


class Member(NamedTuple):
    """One rank as its node sees it. ``state``: running, silent (its agent has not run for seconds),
    stopped, starting (no agent socket yet), dead (exited; its parent may not have reaped it)."""

    rank: int
    local_rank: Optional[int]
    world_size: int
    node: Optional[int]
    host: str
    port: Optional[int]
    pid: int
    state: str
    restarts: int
    heartbeat_age: Optional[float]
    note: Optional[str] = None  # its PROBE_PORT + LOCAL_RANK was taken: by whom (``port 9701 taken by uid N``)

    def to_json(self) -> Dict[str, Any]:
        return self._asdict()


def node_host() -> str:
    """How other hosts reach this one: ``$PROBE_HOST``, else the host name."""
    return os.environ.get("PROBE_HOST") or socket.gethostname()


def process_environ(pid: int, keys: Collection[bytes] = _ENV_KEYS) -> Dict[bytes, bytes]:
    """The variables named in ``keys`` of ``pid``'s environment (as it was at its start), read from /proc;
    empty where it cannot be read (gone, another user's)."""
    return proc.environ(pid, keys)


MAX_CANDIDATES = 4096


def _cannot_run(pid: int) -> bool:
    """A live process whose agent has not run for STALE_HEARTBEAT_S, or that is stopped; never a DataLoader
    worker (torch names its process pt_data_worker), which is no rank."""
    letter = proc.state(pid)
    if letter in (None, "Z", "X"):
        return False
    try:
        with open("/proc/%d/comm" % pid, "rb") as handle:
            if handle.read().strip() == b"pt_data_worker":
                return False
    except OSError:
        return False
    if letter in ("T", "t"):
        return True
    try:
        return time.time() - os.stat(_paths.socket_path(pid)).st_mtime > STALE_HEARTBEAT_S
    except OSError:
        return False


def _int(raw: Optional[bytes], default: int = -1) -> int:
    try:
        return int(raw) if raw is not None else default
    except ValueError:
        return default


class Members:
    """The ranks among this process's children; a rank seen once is kept (dead) until replaced."""

    def __init__(self, base_port: int, parent: Optional[int] = None, children: bool = True) -> None:
        self.base_port = base_port
        self.parent = parent if parent is not None else os.getpid()
        self.children = children  # False in a node helper of its own: its ranks are not its children
        self.master_addr: Optional[str] = None
        self.node: Optional[int] = None
        self._known: Dict[int, Dict[str, Any]] = {}  # rank -> what was learnt from /proc or a registration
        self._candidates: Dict[int, Dict[str, Any]] = {}  # pid -> port, local rank: may become a rank
        self._lock = threading.Lock()

    def candidate(self, pid: int, port: Optional[int], local_rank: Optional[int]) -> None:
        """A process of the job that knows no rank yet (a spawn child before init_process_group, Lightning's
        rank 0, mp.spawn's parent): kept so that, should its GIL be taken before it can say its rank, the
        one rank of the job that never registered can be put down to it (see ``_infer``)."""
        with self._lock:
            for dead in [p for p in self._candidates if proc.state(p) in (None, "Z", "X")]:
                del self._candidates[dead]
            if len(self._candidates) < MAX_CANDIDATES and not any(k["pid"] == pid for k in self._known.values()):
                self._candidates[pid] = {"port": port, "local_rank": local_rank}

    def register(self, pid: int, rank: int, local_rank: Optional[int], world_size: Optional[int],
                 node: Optional[int], port: Optional[int], restarts: int, master_addr: Optional[str],
                 source: str) -> None:
        """A rank says who it is (again, when that changed: torch.distributed numbered it). A process is one
        rank at a time; where every rank known is dead, the registering one starts a new job's list."""
        with self._lock:
            if self._known and all(proc.state(k["pid"]) in (None, "Z", "X") for k in self._known.values()):
                self._known.clear()
            for old in [r for r, k in self._known.items() if k["pid"] == pid and r != rank]:
                del self._known[old]
            self._candidates.pop(pid, None)
            self._known[rank] = {"pid": pid, "local_rank": local_rank, "world_size": world_size or 0,
                                 "node": node, "restarts": restarts, "port": port, "source": source}
            if master_addr:
                self.master_addr = master_addr
            if node is not None:
                self.node = node

    def _agents(self) -> List[int]:
        """The processes with an agent socket in the runtime directory (ours: the directory is the user's)."""
        try:
            names = os.listdir(_paths.runtime_dir())
        except OSError:
            return []
        return [pid for pid in map(_paths.pid_from_socket_name, names) if pid is not None and pid != os.getpid()]

    def _same_job(self, env: Dict[bytes, bytes], pid: int) -> bool:
        """Whether the process with environment ``env`` is a rank of this job: its PROBE_PORT is ours, and no
        multiprocessing child (which inherits its parent's variables, a rank's included) or helper."""
        raw = env.get(b"PROBE_PORT", b"").decode("ascii", "replace").strip()
        port = raw.rpartition(":")[2]
        if not (port.isdigit() and int(port) == self.base_port):
            return False
        try:
            with open("/proc/%d/cmdline" % pid, "rb") as handle:
                argv = [a.decode("utf-8", "replace") for a in handle.read(1 << 16).split(b"\0")]
        except OSError:
            return False
        return _rank.mp_role(argv) is None

    def alive(self) -> int:
        """How many of the ranks known are alive now."""
        with self._lock:
            pids = [k["pid"] for k in self._known.values()]
        return sum(1 for pid in pids if proc.state(pid) not in (None, "Z", "X"))

    def node_key(self) -> Optional[int]:
        """This node's number in the job: the one its ranks were given (GROUP_RANK, SLURM_NODEID), else,
        where the launcher numbers no nodes (mpirun), 0 on the node of rank 0 and the lowest rank here on
        the others (unique across nodes, as ranks are). None before any rank is known."""
        if self.node is not None:
            return self.node
        with self._lock:
            ranks = sorted(self._known)
        return ranks[0] if ranks else None

    def scan(self) -> List[Member]:
        """Look for ranks not known yet, then every rank ever seen, in rank order, with its state now.

        In torchrun's launcher they are its children. A node helper of its own also looks at the agents of
        this runtime directory whose ``PROBE_PORT`` is its job's and whose launcher named their rank: a rank
        whose GIL a C call took before it could register is listed all the same."""
        host = node_host()
        with self._lock:
            for pid in (proc.children(self.parent) if self.children else self._agents()):
                if any(k["pid"] == pid for k in self._known.values()):
                    continue
                env = process_environ(pid)
                if not self.children and not self._same_job(env, pid):
                    continue
                who = _rank.from_environ({k.decode("ascii"): v.decode("ascii", "replace") for k, v in env.items()})
                if who.rank is None or who.local_rank is None:
                    continue  # not a rank (some other child of the launcher)
                rank = who.rank
                if rank in self._known and proc.state(self._known[rank]["pid"]) not in (None, "Z", "X"):
                    continue  # a live process registered as this rank
                self.master_addr = self.master_addr or (env.get(b"MASTER_ADDR") or b"").decode("ascii", "replace") or None
                node = who.node if who.node is not None or not self.children else 0
                if node is not None:
                    self.node = node
                self._known[rank] = {"pid": pid, "local_rank": who.local_rank,
                                     "world_size": who.world_size or 0, "node": node,
                                     "restarts": _int(env.get(b"TORCHELASTIC_RESTART_COUNT"), 0),
                                     "port": None, "source": who.source}
            self._infer()
            known = sorted(self._known.items())
        return [self._member(rank, info, host) for rank, info in known]

    def _infer(self) -> None:
        """Where exactly one rank of the job is missing and exactly one process that could be a rank cannot
        run (its agent silent for seconds, or stopped) and never said its rank, that process is that rank
        (``source`` "inferred"): a rank that took its GIL right after ``init_process_group``, before its
        agent could register. Only where this node knows the whole job's other ranks (one world size,
        every other rank here): on several nodes the missing rank may be another node's. Called with the
        lock held."""
        sizes = {k["world_size"] for k in self._known.values() if k["world_size"] > 0}
        if len(sizes) != 1 or not self._candidates:
            return
        world = sizes.pop()
        missing = set(range(world)) - set(self._known)
        if len(missing) != 1:
            return
        silent = [pid for pid in self._candidates if _cannot_run(pid)]
        if len(silent) != 1:
            return
        pid = silent[0]
        info = self._candidates.pop(pid)
        self._known[missing.pop()] = {"pid": pid, "local_rank": info["local_rank"], "world_size": world,
                                      "node": self.node, "restarts": 0, "port": info["port"], "source": "inferred"}

    def solo(self) -> Optional[Member]:
        """Where no rank of the job is known on this node and exactly one process of it offered itself (a
        program run alone under ``PROBE_PORT``: no launcher numbered it, it made no process group), that
        process as rank 0 of one, for the stall watch; None otherwise (several processes that may become
        ranks are a job starting: mp.spawn's parent and children)."""
        with self._lock:
            if self._known or len(self._candidates) != 1:
                return None
            pid, info = next(iter(self._candidates.items()))
            one = {"pid": pid, "local_rank": None, "world_size": 1, "node": None, "restarts": 0, "port": info["port"]}
        return self._member(0, one, node_host())

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
        port = info["port"]
        if port is None and info["local_rank"] is not None:
            port = self.base_port + info["local_rank"]  # found in /proc, not registered: the port it was given
        node = info["node"] if info["node"] is not None else self.node_key()
        note = None
        if port is not None and info["local_rank"] is not None and port != self.base_port + info["local_rank"]:
            from probe.agent.port_holder import moved_note

            note = moved_note(self.base_port + info["local_rank"], port)
        return Member(rank, info["local_rank"], info["world_size"], node, host, port, pid, state,
                      info["restarts"], None if age is None else round(age, 2), note)
