"""Agents running on this host, found by their sockets in the runtime directory."""

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from probe import _paths
from probe.client.client import Client
from probe.client.targets import parse_target
from probe.errors import ProbeError

__all__ = ["LocalAgent", "local_agents"]


@dataclass(frozen=True)
class LocalAgent:
    pid: int
    socket: str
    health: Optional[Dict[str, Any]]  # None when the socket did not answer
    error: Optional[str] = None

    @property
    def alive(self) -> bool:
        return self.health is not None


def local_agents(timeout: float = 1.0) -> List[LocalAgent]:
    """Every agent socket of this user, with the agent's health (or why it did not answer)."""
    directory = _paths.runtime_dir()
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in sorted(names, key=lambda n: (len(n), n)):
        pid = _paths.pid_from_socket_name(name)
        if pid is None:
            continue
        path = os.path.join(directory, name)
        if not os.path.exists("/proc/%d" % pid):
            _remove_stale(pid, path)  # its process died without running its exit hooks (SIGTERM, SIGKILL)
            continue
        client = Client(parse_target("unix:" + path), timeout=timeout)
        try:
            found.append(LocalAgent(pid, path, client.health()))
        except ProbeError as exc:
            found.append(LocalAgent(pid, path, None, exc.message))
    return found


def _remove_stale(pid: int, path: str) -> None:
    for stale in (path, _paths.token_path(pid)):
        try:
            os.unlink(stale)
        except OSError:
            pass
