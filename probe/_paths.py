"""Where an agent's files live on this host.

One directory per user, entered only by its owner, holds ``<pid>.sock`` (the unix socket of the agent
in process ``pid``) and ``<pid>.token`` (its TCP token, when it listens on TCP). Both the agent and the
client derive paths from here, so the convention lives in exactly one place. Runs inside the target:
stdlib only, Python 3.9+.
"""

import os
import stat
from typing import Optional

__all__ = ["runtime_dir", "ensure_runtime_dir", "socket_path", "token_path", "pid_from_socket_name"]


def runtime_dir() -> str:
    """The per-user directory, ``$PROBE_RUNTIME_DIR`` or ``$XDG_RUNTIME_DIR/probe`` or ``/tmp/probe-<uid>``."""
    explicit = os.environ.get("PROBE_RUNTIME_DIR")
    if explicit:
        return explicit
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return os.path.join(xdg, "probe")
    return os.path.join(os.environ.get("TMPDIR") or "/tmp", "probe-%d" % os.getuid())


def ensure_runtime_dir() -> str:
    """Create the runtime directory (mode 0700) and check that only we own and can enter it.

    Raises ``PermissionError`` when it exists but belongs to someone else or is open to others: a socket
    placed there could be replaced or reached by another user.
    """
    path = runtime_dir()
    try:
        os.makedirs(path, mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise PermissionError("%s is not a directory" % path)
    if info.st_uid != os.getuid():
        raise PermissionError("%s belongs to uid %d, not to us (uid %d)" % (path, info.st_uid, os.getuid()))
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def socket_path(pid: int) -> str:
    """The unix socket of the agent in process ``pid``."""
    return os.path.join(runtime_dir(), "%d.sock" % pid)


def token_path(pid: int) -> str:
    """The owner-only file that holds the TCP token of the agent in process ``pid``."""
    return os.path.join(runtime_dir(), "%d.token" % pid)


def pid_from_socket_name(name: str) -> Optional[int]:
    """``"4242.sock"`` -> 4242; anything else -> None."""
    stem, dot, ext = name.partition(".")
    if dot and ext == "sock" and stem.isdigit():
        return int(stem)
    return None
