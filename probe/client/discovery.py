"""Agents running on this host, found by their sockets in the runtime directory, and the files dead ones
left there (the token of one reached at HOST:PORT: ``probe.client.local_token``)."""

from typing import Any, Dict, List, NamedTuple, Optional

from probe import _paths
from probe._paths import _remove_stale, remove_stale_files  # noqa: F401 (re-exported)
from probe.client.client import Client
from probe.client.targets import parse_target
from probe.client.local_token import agent_sockets as _sockets
from probe.errors import AgentBlocked, ProbeError, UsageError

__all__ = ["LocalAgent", "local_agents", "remove_stale_files"]


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
