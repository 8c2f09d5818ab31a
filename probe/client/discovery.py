"""Agents running on this host, found by their sockets in the runtime directory, and the files dead ones
left there (the token of one reached at HOST:PORT: ``probe.client.local_token``)."""

import os
from typing import Any, Dict, Iterable, List, NamedTuple, Optional

from probe import _paths
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
    extra = (os.path.join(directory, "%d.token" % pid), os.path.join(directory, "progress-%d.bin" % pid),
             os.path.join(directory, "fr-%d.json" % pid))
    for stale in (path,) + extra if with_token else (path,):
        try:
            os.unlink(stale)
        except OSError:
            pass
