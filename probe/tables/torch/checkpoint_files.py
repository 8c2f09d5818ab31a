"""Where a checkpoint lands, and how it gets there without harming a file it was not meant for.

The path comes from whoever holds the control scope, who need not be the job's user: written naively, a
checkpoint to ``~/.bashrc``, to a link planted at PATH in a shared directory, or through a directory link
another user made, would replace a file the job's user owns. So:

* the directory is opened one component at a time (``probe._paths.open_parent_dir``): a symbolic link on
  the way is followed only when it is the user's own or root's; everything after uses that descriptor;
* a symbolic link at PATH is never written through nor replaced;
* an existing PATH is replaced only when the request asks (``--overwrite``), and only when it is a regular
  file of the user's that is a checkpoint already (torch.save's zip or pickle, or the JSON probe writes);
  hf's directory is the ranks' of one save when they made it (its ``.probe-save-ID`` marker), else it
  too needs ``--overwrite``;
* without ``--overwrite`` the new file takes its name with ``link(2)``, which fails where anything took
  the name meanwhile (a race lost is a clear error, never a file replaced).

The data goes to a temporary file beside PATH (owner-only), fsynced, then takes the name: a reader sees
the old file or the whole new one, never a part.
"""

import errno
import os
import re
import secrets
import stat
from typing import Any, Callable, Tuple

from probe import _paths
from probe.errors import BadRequest

__all__ = ["check_target", "make_directory", "write_file_atomically"]

_CHECKPOINT_MAGIC = (b"PK\x03\x04", b"\x80")  # torch.save's zip; a pickle (protocol 2 and later)


def check_target(target: str, overwrite: bool, directory: bool = False) -> None:
    """Refuse, before anything is built, a ``target`` that would be written through a link or would
    replace a file without ``overwrite`` (``directory``: the target is a directory probe fills, as hf's)."""
    fd, name = _open_dir(target)
    try:
        _check_name(fd, name, target, overwrite, directory)
    finally:
        os.close(fd)


def make_directory(target: str, overwrite: bool, save_id: str = "") -> bool:
    """The directory ``target`` (0700) for a checkpoint of several files (hf's), and whether the files in it
    may be replaced (each still only if a checkpoint). Made here with the marker ``.probe-save-SAVE_ID`` in
    it, under a temporary name and renamed into place, so that the ranks of one save (one ``save_id``, which
    the client gives them all) find it theirs whichever made it; an existing directory without that marker
    is used only with ``overwrite``."""
    marker = ".probe-save-%s" % save_id if save_id else ""
    fd, name = _open_dir(target)
    try:
        _check_name(fd, name, target, overwrite, True)
        try:
            os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            if _make_marked(fd, name, marker):
                return True
            _check_name(fd, name, target, overwrite, True)  # made meanwhile: the same rules
        if marker and _has(fd, name, marker):
            return True  # another rank of this save made it
        if not overwrite:
            raise BadRequest("%s exists already: probe replaces nothing unless asked" % target,
                             hint="give a new path, or --overwrite to replace a checkpoint there")
        return True
    finally:
        os.close(fd)


def _make_marked(fd: int, name: str, marker: str) -> bool:
    """Make ``name`` with ``marker`` in it, atomically; False where something took the name first."""
    tmp = ".%s.probe-%d-%s.tmp" % (name, os.getpid(), secrets.token_hex(4))
    os.mkdir(tmp, 0o700, dir_fd=fd)
    inner = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    try:
        if marker:
            os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600, dir_fd=inner))
        try:
            os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
            return True
        except OSError as exc:  # a directory that is not empty (or anything else) there already
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR, errno.EPERM):
                raise
            if marker:
                _unlink(marker, inner)
            os.rmdir(tmp, dir_fd=fd)
            return False
    finally:
        os.close(inner)


def _has(fd: int, name: str, entry: str) -> bool:
    try:
        inner = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    except OSError:
        return False
    try:
        os.stat(entry, dir_fd=inner, follow_symlinks=False)
        return True
    except OSError:
        return False
    finally:
        os.close(inner)


def write_file_atomically(write: Callable[[int], Any], target: str, overwrite: bool) -> Any:
    """``write(fd)`` into a temporary file beside ``target``, fsync, then give it ``target``'s name: a
    replace only with ``overwrite`` (and only of a checkpoint of ours), else a link that fails where the
    name is taken. Returns what ``write`` returned."""
    dir_fd, name = _open_dir(target)
    try:
        _check_name(dir_fd, name, target, overwrite, False)
        _remove_leftovers(dir_fd, name)
        tmp = ".%s.probe-%d-%s.tmp" % (name, os.getpid(), secrets.token_hex(4))
        # Owner-only, whatever the umask: a checkpoint holds the weights, and probe writes it on the user's behalf.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            result = write(fd)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink(tmp, dir_fd)
            raise
        os.close(fd)
        try:
            _take_name(dir_fd, tmp, name, target, overwrite)
        finally:
            _unlink(tmp, dir_fd)
        _fsync_dir(dir_fd)
        return result
    finally:
        os.close(dir_fd)


def _open_dir(target: str) -> Tuple[int, str]:
    """An ``O_PATH`` descriptor of ``target``'s directory (no link of another user followed), and its name."""
    directory = os.path.dirname(target)
    try:
        fd, name = _paths.open_parent_dir(target)
    except FileNotFoundError:
        raise BadRequest("the directory %s does not exist (in the target's file system)" % directory) from None
    except PermissionError as exc:
        raise BadRequest("cannot save to %s: %s" % (target, exc.strerror or exc),
                         hint="give a path whose directories are the job user's own") from None
    except OSError as exc:
        raise BadRequest("cannot save to %s: %s" % (target, exc.strerror or exc)) from None
    return fd, name


def _check_name(dir_fd: int, name: str, target: str, overwrite: bool, directory: bool) -> None:
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        raise BadRequest("%s is a symbolic link: probe writes a checkpoint neither through one nor over one" % target,
                         hint="give the path of the file itself, or a new one")
    if directory:  # whether files in it may be replaced is make_directory's to say
        if not stat.S_ISDIR(info.st_mode):
            raise BadRequest("%s is a file; --format hf writes a directory" % target)
        if info.st_uid != os.getuid():
            raise BadRequest("%s belongs to uid %d, not to the job's user: probe writes nothing in it"
                             % (target, info.st_uid))
        return
    if not overwrite:
        raise BadRequest("%s exists already: probe replaces nothing unless asked" % target,
                         hint="give a new path, or --overwrite to replace a checkpoint there")
    if info.st_uid != os.getuid():
        raise BadRequest("%s belongs to uid %d, not to the job's user: probe does not replace it"
                         % (target, info.st_uid))
    if not stat.S_ISREG(info.st_mode) or not _is_checkpoint(dir_fd, name):
        raise BadRequest("%s is not a checkpoint: --overwrite replaces only a file torch.save (or probe) wrote"
                         % target, hint="give another path")


def _is_checkpoint(dir_fd: int, name: str) -> bool:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        head = os.read(fd, 4)
    except OSError:
        return False
    finally:
        os.close(fd)
    return head.startswith(_CHECKPOINT_MAGIC) or (name.endswith(".json") and head.lstrip()[:1] == b"{")


def _take_name(dir_fd: int, tmp: str, name: str, target: str, overwrite: bool) -> None:
    if overwrite:
        _check_name(dir_fd, name, target, True, False)  # still what was checked: a link now is refused
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)  # replaces the name, never follows it
        return
    try:
        os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except FileExistsError:
        raise BadRequest("%s appeared while the checkpoint was written: probe replaces nothing unless asked"
                         % target, hint="give a new path, or --overwrite") from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
            raise
        # no hard links here (some network and FUSE file systems): claim the name first, then replace it
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def _remove_leftovers(dir_fd: int, name: str) -> None:
    """Temporary files of earlier checkpoints to ``name`` whose process is gone (it crashed mid-write)."""
    pattern = re.compile(r"^\.%s\.probe-(\d+)-[0-9a-f]{8}\.tmp$" % re.escape(name))
    try:
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)  # O_PATH cannot be listed
    except OSError:
        return
    try:
        names = os.listdir(fd)
    except OSError:
        names = []
    finally:
        os.close(fd)
    for entry in names:
        match = pattern.match(entry)
        if match and not os.path.exists("/proc/%s" % match.group(1)):
            _unlink(entry, dir_fd)


def _unlink(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def _fsync_dir(dir_fd: int) -> None:
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
