"""What a target string means: a pid on this host, ``host:port``, or ``unix:PATH``."""

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

    @property
    def is_tcp(self) -> bool:
        return isinstance(self.address, TcpAddress)


def parse_target(text: str) -> Target:
    """``"4242"`` -> the agent of pid 4242; ``"node7:9700"``; ``"[::1]:9700"``; ``"unix:/path/x.sock"``."""
    text = text.strip()
    if not text:
        raise UsageError("empty target", hint="give a pid, HOST:PORT or unix:PATH")
    if text.isdigit():
        pid = int(text)
        return Target(text, UnixAddress(_paths.socket_path(pid)), pid)
    if text.startswith("unix:"):
        path = text[len("unix:"):]
        if not path:
            raise UsageError("unix: target needs a path", hint="e.g. unix:/tmp/probe-1000/4242.sock")
        return Target(text, UnixAddress(path), _paths.pid_from_socket_name(os.path.basename(path)))
    host, sep, port = text.rpartition(":")
    if sep and port.isdigit() and host:
        return Target(text, TcpAddress(host.strip("[]"), int(port)))
    raise UsageError("cannot understand target %r" % text, hint="give a pid, HOST:PORT or unix:PATH")
