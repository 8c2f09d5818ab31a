"""Who holds a TCP port on this host: the uid of the socket listening on it (``/proc/net/tcp``, ``tcp6``).

An agent whose ``PROBE_PORT`` is taken serves on a free port instead; when another user holds the port,
clients sent there would meet that user's process. Saying whose it is, where the user looks (``probe
list``, ``health``, ``ranks``), turns a silent move into a warning. Stdlib only: runs in the target.
"""

import os
from typing import Optional

__all__ = ["holder_uid", "taken_note", "moved_note"]

_LISTEN = "0A"


def holder_uid(port: int) -> Optional[int]:
    """The uid owning a socket that listens on TCP ``port`` (any address) in this network namespace; None
    where none is seen (or the tables cannot be read)."""
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as handle:
                lines = handle.read(4 << 20).splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 8 or fields[3] != _LISTEN:
                continue
            try:
                if int(fields[1].rpartition(":")[2], 16) == port:
                    return int(fields[7])
            except ValueError:
                continue
    return None


def taken_note(port: int) -> str:
    """``port 9700 taken by uid 65534`` (``by another process of this user`` for our own uid, ``by an
    unknown process`` where the tables do not say)."""
    uid = holder_uid(port)
    if uid is None:
        return "port %d taken by an unknown process" % port
    if uid == os.getuid():
        return "port %d taken by uid %d (this user: another process of ours)" % (port, uid)
    return "port %d taken by uid %d" % (port, uid)


def moved_note(wanted: int, serving: int) -> str:
    """What a host helper says of a rank that serves on ``serving`` instead of the ``wanted`` port."""
    uid = holder_uid(wanted)
    if uid is None:
        return "port %d was taken when it started; serving on %d instead" % (wanted, serving)
    return "%s; serving on %d instead" % (taken_note(wanted), serving)
