"""What a target string means: a pid on this host, ``host:port``, ``unix:PATH``, or ``core:PATH`` (a core
file, read from outside: there is no agent to ask). ``slurm:JOBID`` names a whole job: only commands across
ranks take it (``probe.client.slurm``). ``snapshot:PATH``: a job's ranks as recorded (``probe.snapshot.target``)."""

import os
from typing import NamedTuple, Optional

from probe import _paths
from probe.client.transport import Address, TcpAddress, UnixAddress
from probe.errors import UsageError

__all__ = ["Target", "parse_target"]


class Target(NamedTuple):
    label: str  # as the user wrote it; shown in the ``target`` column
    address: Address
    pid: Optional[int] = None
    core: Optional[str] = None  # the path of a core file: no agent, stacks only
    snapshot: Optional[str] = None  # the path of a snapshot (or of torch's Flight Recorder dumps): a record

    @property
    def is_tcp(self) -> bool:
        return isinstance(self.address, TcpAddress)

    @property
    def is_local(self) -> bool:
        """A process on this host, reached by its unix socket: it can also be read from outside."""
        return isinstance(self.address, UnixAddress) and self.pid is not None


def parse_target(text: str) -> Target:
    """``"4242"`` -> the agent of pid 4242; ``"node7:9700"``; ``"[::1]:9700"``; ``"unix:/path/x.sock"``."""
    text = text.strip()
    if not text:
        raise UsageError("empty target", hint="give a pid, HOST:PORT, unix:PATH, core:PATH or snapshot:PATH")
    if text.isdigit():
        pid = int(text)
        return Target(text, UnixAddress(_paths.find_socket_path(pid)), pid)
    if text.startswith("core:"):
        path = text[len("core:"):]
        if not path:
            raise UsageError("core: target needs a path", hint="e.g. core:./core.1234")
        return Target(text, UnixAddress(os.devnull), None, os.path.abspath(path))
    if text.startswith("snapshot:"):
        path = text[len("snapshot:"):]
        if not path:
            raise UsageError("snapshot: target needs a path", hint="e.g. snapshot:DIR/<id> (`probe snapshots DIR` "
                                                                   "lists them), or torch's Flight Recorder dumps")
        return Target(text, UnixAddress(os.devnull), None, None, path)
    if text.startswith("slurm:"):
        raise UsageError("%s names every rank of a Slurm job, not one process" % text,
                         hint="probe %s ranks, probe %s --all-ranks COMMAND, or --ranks N COMMAND" % (text, text))
    if text.startswith("unix:"):
        path = text[len("unix:"):]
        if not path:
            raise UsageError("unix: target needs a path", hint="e.g. unix:/tmp/probe-1000/4242.sock")
        return Target(text, UnixAddress(path), _paths.pid_from_socket_name(os.path.basename(path)))
    host, sep, port = text.rpartition(":")
    if sep and port.isdigit() and host:
        return Target(text, TcpAddress(host.strip("[]"), int(port)))
    raise UsageError("cannot understand target %r" % text, hint="give a pid, HOST:PORT, unix:PATH, core:PATH or snapshot:PATH")
