"""The token of an agent of ours on this host that is reached at HOST:PORT, and the sockets of this
host's agents in the runtime directory: what the client needs before its first request, below it."""

import os
import socket
import stat
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from probe import _paths
from probe.client.transport import TcpAddress
from probe.errors import ProbeError

__all__ = ["local_token", "local_token_and_file", "read_own_secret", "agent_sockets"]


def agent_sockets() -> List[Tuple[str, int]]:
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


# -- the token of an agent of ours on this host, reached at HOST:PORT ------------------------------


def local_token(address: TcpAddress, ask: Callable[[int, float], Dict[str, Any]],
                timeout: float = 2.0) -> Optional[str]:
    """The token of the agent at ``address`` when that is an agent of ours on this host (a rank's port, one
    started with PROBE_LISTEN): from the token file the agent names when asked over its unix socket, read
    only when that file is ours alone. None when anything is not so: ``address`` is not this host's (a
    token is never sent elsewhere), someone else listens there, or the file is not one we trust."""
    return local_token_and_file(address, ask, timeout)[0]


def local_token_and_file(address: TcpAddress, ask: Callable[[int, float], Dict[str, Any]],
                         timeout: float = 2.0) -> Tuple[Optional[str], Optional[str]]:
    """(:func:`local_token`, the token file the agent named over its unix socket, read or not): where the
    file was not read, the client can say which file it left alone, as the agent (to any TCP caller) does not.
    ``ask(pid, timeout)``: the health of the agent in process ``pid`` over its unix socket (the client's
    own call, passed in: this module sits below the client)."""
    listeners = _our_listeners(address)
    if not listeners:
        return None, None
    pids = [pid for pid in _agent_pids() if _holds_socket(pid, listeners)]
    if len(pids) != 1:  # none, or a forked child holds the listening socket too: its agent is elsewhere
        return None, None
    try:
        path = ask(pids[0], timeout).get("token_file")
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
    return [pid for _, pid in agent_sockets()]


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
