"""Agents running on this host, found by their sockets in the runtime directory; and the token of one
of them that is reached at HOST:PORT."""

import os
import socket
import stat
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Set, Tuple

from probe import _paths
from probe.client.client import Client
from probe.client.targets import parse_target
from probe.client.transport import TcpAddress
from probe.errors import AgentBlocked, ProbeError, UsageError

__all__ = ["LocalAgent", "local_agents", "remove_stale_files", "local_token", "local_token_and_file",
           "read_own_secret"]


class LocalAgent(NamedTuple):  # no dataclass: dataclasses imports inspect, ~5 ms of a command's start-up
    pid: int
    socket: str
    health: Optional[Dict[str, Any]]  # None when the socket did not answer
    error: Optional[str] = None
    blocked: bool = False  # the process runs, but its agent cannot answer (GIL held, stopped)

    @property
    def alive(self) -> bool:
        return self.health is not None


def local_agents(timeout: float = 1.0) -> List[LocalAgent]:
    """Every agent socket of this user, with the agent's health (or why it did not answer).

    A socket file that provably belongs to no live agent (nobody listens on it) is removed, with its
    token file. A pid missing from /proc proves nothing: an agent in another PID namespace that shares
    the runtime directory has a pid we cannot see. Raises :class:`UsageError` when the runtime
    directory is not ours alone.
    """
    directory = _paths.runtime_dir()
    problem = _paths.runtime_dir_problem(directory)
    if problem and not (directory == _paths.default_runtime_dir() and _paths.taken_by_another(directory)):
        raise UsageError(*problem)  # (a default another user took holds none of ours: an agent makes a fallback)
    found: List[LocalAgent] = []
    for path, pid in _sockets():
        client = Client(parse_target("unix:" + path), timeout=timeout)
        try:
            found.append(LocalAgent(pid, path, client.health(fallback=False)))
        except AgentBlocked as exc:
            found.append(LocalAgent(pid, path, None, _short_reason(exc), blocked=True))
        except ProbeError as exc:
            if _paths.is_stale_socket(path):
                _remove_stale(pid, path)  # its process died without running its exit hooks (SIGKILL, os._exit)
                continue
            found.append(LocalAgent(pid, path, None, exc.message))
    return found


def _sockets() -> List[Tuple[str, int]]:
    """(path, pid) of every agent socket in the runtime directory and its private fallbacks
    (``probe._paths.agent_dirs``), by pid."""
    out: List[Tuple[str, int]] = []
    for directory in _paths.agent_dirs():
        if directory != _paths.runtime_dir() and _paths.runtime_dir_problem(directory):
            continue
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in sorted(names, key=lambda n: (len(n), n)):
            pid = _paths.pid_from_socket_name(name)
            if pid is not None:
                out.append((os.path.join(directory, name), pid))
    return out


def remove_stale_files(keep: Iterable[int] = ()) -> int:
    """Remove the files of agents (and host helpers) that provably died without their exit hooks (SIGTERM,
    SIGKILL, os._exit): a socket not touched for 2 s that refuses connections, and its token file. A
    live agent touches its socket every 0.25 s, so it is never even connected to; one whose GIL a C call
    holds still accepts, and keeps its files. ``keep``: pids whose files stay (the command's own targets,
    so that their error can say what became of them). Returns how many sockets went; never raises."""
    directory = _paths.runtime_dir()
    if _paths.runtime_dir_problem(directory):
        return 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    kept = set(keep)
    removed = 0
    for name in names:
        helper = name.startswith("host-")
        pid = _paths.pid_from_socket_name(name[5:] if helper else name)
        if pid is None or pid in kept:
            continue
        path = os.path.join(directory, name)
        if _paths.is_stale_socket(path):
            _remove_stale(pid, path, with_token=not helper)
            removed += 1
    return removed


def _short_reason(exc: AgentBlocked) -> str:
    """A few words for a table cell: "GIL held in f (x.py:3)", "stopped (SIGSTOP)", "no answer in 1.0 s"."""
    diagnosis = getattr(exc, "diagnosis", None)
    if diagnosis is None:
        return exc.message
    if diagnosis.state == "gil_held" and diagnosis.holder is not None:
        return "GIL held in %s" % diagnosis.holder.where()
    if diagnosis.state == "stopped":
        return "stopped"
    return "agent silent"


def _remove_stale(pid: int, path: str, with_token: bool = True) -> None:
    directory = os.path.dirname(path)  # the runtime directory, or the fallback the agent used
    extra = (os.path.join(directory, "%d.token" % pid), os.path.join(directory, "progress-%d.bin" % pid))
    for stale in (path,) + extra if with_token else (path,):
        try:
            os.unlink(stale)
        except OSError:
            pass


# -- the token of an agent of ours on this host, reached at HOST:PORT ------------------------------


def local_token(address: TcpAddress, timeout: float = 2.0) -> Optional[str]:
    """The token of the agent at ``address`` when that is an agent of ours on this host (a rank's port, one
    started with PROBE_LISTEN): from the token file the agent names when asked over its unix socket, read
    only when that file is ours alone. None when anything is not so: ``address`` is not this host's (a
    token is never sent elsewhere), someone else listens there, or the file is not one we trust."""
    return local_token_and_file(address, timeout)[0]


def local_token_and_file(address: TcpAddress, timeout: float = 2.0) -> Tuple[Optional[str], Optional[str]]:
    """(:func:`local_token`, the token file the agent named over its unix socket, read or not): where the
    file was not read, the client can say which file it left alone, as the agent (to any TCP caller) does not."""
    listeners = _our_listeners(address)
    if not listeners:
        return None, None
    pids = [pid for pid in _agent_pids() if _holds_socket(pid, listeners)]
    if len(pids) != 1:  # none, or a forked child holds the listening socket too: its agent is elsewhere
        return None, None
    try:
        path = Client(parse_target(str(pids[0])), timeout=timeout).health(fallback=False).get("token_file")
    except ProbeError:
        return None, None
    if not isinstance(path, str):
        return None, None
    return read_own_secret(path), path


def read_own_secret(path: str) -> Optional[str]:
    """The text of ``path`` when it is a regular file of ours that no one else may read or write (not a
    symbolic link), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            return None
        return os.read(fd, 4096).decode("utf-8", "replace").strip() or None
    except OSError:
        return None
    finally:
        os.close(fd)


def _our_listeners(address: TcpAddress) -> Set[int]:
    """The inodes of our sockets that listen where a connection to ``address`` goes, when every address
    of its name is this host's and every socket that could take the connection is ours; else none."""
    listening, uid = _listening(address.port), os.getuid()
    if not any(owner == uid for _, owner, _ in listening):
        return set()  # the usual case for another host's address: decided without asking DNS
    try:
        resolved = {_plain(str(info[4][0])) for info in socket.getaddrinfo(address.host, address.port,
                                                                            type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return set()
    found: Set[int] = set()
    for ip in resolved:
        if not _is_local(ip):
            return set()
        takers = [(owner, inode) for bound, owner, inode in listening if bound == ip or bound in ("0.0.0.0", "::")]
        if any(owner != uid for owner, _ in takers):
            return set()
        found.update(inode for _, inode in takers)  # none: that address refuses, the next is tried
    return found


def _listening(port: int) -> List["tuple[str, int, int]"]:
    """(address, uid, inode) of every TCP socket listening on ``port`` here (IPv4-mapped IPv6 as IPv4)."""
    out = []
    for name, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            with open(name) as handle:
                lines = handle.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != "0A":  # 0A: LISTEN
                continue
            where, _, hex_port = fields[1].rpartition(":")
            try:
                if int(hex_port, 16) != port:
                    continue
                raw = b"".join(bytes.fromhex(where[i:i + 8])[::-1] for i in range(0, len(where), 8))
                out.append((_plain(socket.inet_ntop(family, raw)), int(fields[7]), int(fields[9])))
            except (ValueError, OSError):
                continue
    return out


def _plain(ip: str) -> str:
    ip = ip.split("%", 1)[0]
    return ip[len("::ffff:"):] if ip.startswith("::ffff:") and "." in ip else ip


def _is_local(ip: str) -> bool:
    """Whether ``ip`` is an address of this host: the kernel routes a datagram to it from itself."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as udp:
            udp.connect((ip, 9))  # no packet is sent: this only picks a route and a source address
            return _plain(udp.getsockname()[0]) == ip
    except OSError:
        return False


def _agent_pids() -> List[int]:
    return [pid for _, pid in _sockets()]


def _holds_socket(pid: int, inodes: Set[int]) -> bool:
    wanted = {"socket:[%d]" % inode for inode in inodes}
    fd_dir = "/proc/%d/fd" % pid
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return False
    for name in names:
        try:
            if os.readlink(os.path.join(fd_dir, name)) in wanted:
                return True
        except OSError:
            continue
    return False
