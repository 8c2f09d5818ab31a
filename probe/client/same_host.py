"""A rank reached at HOST:PORT that runs on this host, found by its pid: what is read from outside (native
frames) needs the process, and a TCP address alone does not say where it runs."""

from typing import Optional

import probe.client.transport as transport
from probe.client.targets import Target

__all__ = ["same_host_pid"]


def same_host_pid(target: Target, pid: Optional[int]) -> Optional[int]:
    """The pid of a rank reached at HOST:PORT when it runs on this host: the pid its node helper listed,
    where that process here listens on the target's port (so a pid of another host is never read)."""
    address = target.address
    if pid is None or not isinstance(address, transport.TcpAddress):
        return None
    try:
        import psutil

        process = psutil.Process(pid)
        listing = getattr(process, "net_connections", None) or process.connections
        ports = {c.laddr.port for c in listing(kind="inet") if c.status == psutil.CONN_LISTEN and c.laddr}
    except Exception:  # gone, another user's, psutil missing: not known to be this host's
        return None
    return pid if address.port in ports else None
