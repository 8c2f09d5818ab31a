"""The agent's token files: read one the user names (``PROBE_TOKEN_FILE``, and the read and control
tokens' files), or make it there, safely where ranks of one job share it, never through a link, never
over another file. Used by the agent, its scopes and the node helper. Stdlib only.
"""

import errno
import os
import secrets
import stat
from typing import Optional

from probe import _paths
from probe.errors import UsageError

__all__ = ["token_from_file", "write_new"]

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def write_new(path: str, token: str, dir_fd: Optional[int] = None) -> None:
    """Create ``path`` (never an existing file, never through a link), owner-only, holding ``token``."""
    fd = os.open(path, _CREATE, 0o600, dir_fd=dir_fd)
    try:
        os.write(fd, (token + "\n").encode("utf-8"))
    finally:
        os.close(fd)


def token_from_file(path: str, shared: bool = False) -> str:
    """The token in the explicit token file ``path``; made and written there (0600) when it is missing.

    The file is read only when it is a regular file (no symbolic link, anywhere on the path, unless it
    belongs to us or root) of our own that nobody else can read or write; otherwise ``UsageError`` with
    the fix. Ranks of one job may share it: one creates it (complete, in one step), the others read it.
    ``shared``: others may read the file (never write it): a read or control token meant to be handed out.
    """
    try:
        dir_fd, name = _paths.open_parent_dir(path)
    except OSError as exc:
        raise UsageError("cannot use the token file %s: %s" % (path, exc.strerror or exc),
                         hint="set PROBE_TOKEN_FILE to a path of your own") from None
    try:
        for _ in range(2):
            try:
                return _read_token_at(path, dir_fd, name, shared)
            except FileNotFoundError:
                pass
            token = secrets.token_urlsafe(32)
            if _create_token_at(path, dir_fd, name, token):
                return token
            # Another process (a rank of the same job) created it meanwhile, or a dangling link is there.
        raise UsageError("the token file %s exists but cannot be opened as a file (a dangling symbolic link?)"
                         % path, hint="remove it, or set PROBE_TOKEN_FILE to another path")
    finally:
        os.close(dir_fd)


def _read_token_at(path: str, dir_fd: int, name: str, shared: bool = False) -> str:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UsageError("the token file %s is a symbolic link, which probe does not follow" % path,
                             hint="set PROBE_TOKEN_FILE to the file itself") from None
        raise UsageError("cannot read the token file %s: %s" % (path, exc.strerror or exc),
                         hint="make it a file of your own, readable by you (chmod 600 %s)" % path) from None
    try:
        info = os.fstat(fd)
        uid = os.getuid()
        if not stat.S_ISREG(info.st_mode):
            raise UsageError("the token file %s is not a regular file" % path,
                             hint="set PROBE_TOKEN_FILE to a regular file that holds the token")
        if info.st_uid != uid:
            raise UsageError("the token file %s belongs to uid %d, not to this process's user (uid %d)"
                             % (path, info.st_uid, uid), hint="use a token file of your own (mode 600)")
        if stat.S_IMODE(info.st_mode) & (0o022 if shared else 0o077):
            raise UsageError("the token file %s is open to other users (mode %04o)"
                             % (path, stat.S_IMODE(info.st_mode)), hint="chmod 600 %s" % path)
        token = os.read(fd, 4096).decode("utf-8", "replace").strip()
    finally:
        os.close(fd)
    if not token:
        raise UsageError("the token file %s is empty" % path,
                         hint="write the token into it, or remove it and the agent makes one")
    return token


def _create_token_at(path: str, dir_fd: int, name: str, token: str) -> bool:
    """Write ``token`` to a new file at ``name``; False if something is there already.

    The token goes into a private temporary file first, which is then hard-linked into place: a rank
    that reads the file never sees it half written, and an existing file or link is never replaced.
    """
    tmp = ".%s.%d.%s.tmp" % (name, os.getpid(), secrets.token_hex(4))
    try:
        write_new(tmp, token, dir_fd)
    except OSError as exc:
        raise UsageError("cannot create the token file %s: %s" % (path, exc.strerror or exc),
                         hint="create it yourself (mode 600), or set PROBE_TOKEN_FILE to a path of your own") from None
    try:
        os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return True
    except FileExistsError:
        return False
    except OSError:
        # No hard links here (some network file systems): create the file directly, never over another.
        try:
            write_new(name, token, dir_fd)
            return True
        except FileExistsError:
            return False
        except OSError as exc:
            raise UsageError("cannot create the token file %s: %s" % (path, exc.strerror or exc),
                             hint="create it yourself (mode 600)") from None
    finally:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
