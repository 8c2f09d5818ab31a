"""Where an agent's files live on this host, and how they are opened without trusting what is there.

One directory per user, entered only by its owner, holds ``<pid>.sock`` (the unix socket of the agent
in process ``pid``) and ``<pid>.token`` (its TCP token, when it listens on TCP). Both the agent and the
client derive paths from here, so the convention lives in exactly one place. A directory we did not
make for ourselves is never changed (no chmod): it is refused, with the fix. Where the default name
(``/tmp/probe-<uid>``, which anyone may make first in a shared /tmp) is another user's, a link or not a
directory, a private directory beside it (``/tmp/probe-<uid>-<time>-<random>``, 0700) is used instead, and
the client looks there too; a ``PROBE_RUNTIME_DIR`` the user named is never replaced. Runs inside the target:
stdlib only, Python 3.9+.
"""

from __future__ import annotations

import errno
import os
import stat
import time

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing, socket and the errors load where needed: ``probe PID backtrace`` imports this (probe.cli.quick)
    from typing import Dict, Iterable, List, Optional, Tuple

__all__ = ["runtime_dir", "default_runtime_dir", "taken_by_another", "fallback_dirs", "runtime_dir_fallback",
           "runtime_dir_note", "agent_dirs", "find_socket_path", "runtime_dir_problem", "ensure_runtime_dir",
           "socket_path", "token_path",
           "pid_from_socket_name", "process_start_ticks", "crash_record_path", "socket_state", "is_stale_socket",
           "remove_stale_files",
           "open_parent_dir", "job_token_path", "helper_socket_path", "node_socket_path", "node_lock_path",
           "node_log_path", "progress_path"]

STALE_AFTER_S = 2.0
"""A socket file younger than this is never taken for stale: an agent binds its socket before it listens."""


def runtime_dir() -> str:
    """The per-user directory, ``$PROBE_RUNTIME_DIR`` or ``$XDG_RUNTIME_DIR/probe`` or ``/tmp/probe-<uid>``;
    where that default is taken by someone else, the private fallback beside it (:func:`runtime_dir_fallback`)."""
    explicit = os.environ.get("PROBE_RUNTIME_DIR")
    if explicit:
        return explicit
    default = default_runtime_dir()
    chosen = _chosen.get(default)
    if chosen and _private(chosen):
        return chosen  # for this process's life, even once the default is free again: its files are there
    if not taken_by_another(default):
        return default
    found = fallback_dirs(default)
    if found:
        _chosen[default] = found[0]
        return found[0]
    return default  # none yet: ensure_runtime_dir makes one


def default_runtime_dir() -> str:
    """``$XDG_RUNTIME_DIR/probe`` or ``$TMPDIR/probe-<uid>`` (``/tmp``): the name everyone can compute."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return os.path.join(xdg, "probe")
    return os.path.join(os.environ.get("TMPDIR") or "/tmp", "probe-%d" % os.getuid())


# A default directory another user took -> the private one this process uses instead.
_chosen: Dict[str, str] = {}


def taken_by_another(path: str) -> bool:
    """Whether the default directory is someone else's doing: a link, not a directory, or another user's
    directory (in a shared /tmp anyone may make ``/tmp/probe-<uid>`` first). Ours with a loose mode is not:
    that is the user's own, and the error says to chmod it."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid()


def _private(path: str) -> bool:
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not stat.S_IMODE(info.st_mode) & 0o077


def fallback_dirs(default: Optional[str] = None) -> List[str]:
    """The private fallbacks of the default directory, oldest first: ``<default>-<time>-<random>`` beside it,
    real directories of ours that no one else may enter (a name alone proves nothing: anyone may make one)."""
    default = default or default_runtime_dir()
    parent, prefix = os.path.split(default)
    try:
        names = sorted(n for n in os.listdir(parent or ".") if n.startswith(prefix + "-"))
    except OSError:
        return []
    return [os.path.join(parent, n) for n in names if _private(os.path.join(parent, n))]


def runtime_dir_fallback() -> Optional[Tuple[str, str]]:
    """(the fallback in use, why) where the default runtime directory is taken by someone else; else None."""
    if os.environ.get("PROBE_RUNTIME_DIR"):
        return None
    default = default_runtime_dir()
    path = runtime_dir()
    if path == default:
        return None
    problem = runtime_dir_problem(default)
    return path, (problem[0] if problem else "the probe runtime directory %s was not usable" % default)


def runtime_dir_note() -> Optional[str]:
    """Why the runtime directory is not the default one (another user took it), for ``health``; or None."""
    fallback = runtime_dir_fallback()
    return None if fallback is None else "%s; the agent uses %s instead" % (fallback[1], fallback[0])


def agent_dirs() -> List[str]:
    """Every directory where an agent of ours may have its socket: the runtime directory, and with the
    default one (no ``PROBE_RUNTIME_DIR``) every private fallback of it (a process that started while
    another user held the default one, before or after it was freed)."""
    first = runtime_dir()
    if os.environ.get("PROBE_RUNTIME_DIR"):
        return [first]
    return [first] + [d for d in fallback_dirs() if d != first]


def find_socket_path(pid: int) -> str:
    """The socket of the agent in process ``pid``: in the runtime directory, or in a fallback that holds
    it (:func:`agent_dirs`); the runtime directory's name when none does."""
    for directory in agent_dirs():
        path = os.path.join(directory, "%d.sock" % pid)
        if os.path.lexists(path):
            return path
    return socket_path(pid)


_ELSEWHERE = "set PROBE_RUNTIME_DIR to a directory of your own"


def runtime_dir_problem(path: Optional[str] = None) -> Optional[Tuple[str, str]]:
    """Why ``path`` (default: the runtime directory) must not hold our files, as (message, fix); None if it may.

    A missing directory is no problem (the agent creates it). It must be a real directory (not a
    symbolic link), owned by us, that no other user can enter: otherwise a socket or token placed there
    could be replaced or reached by someone else.
    """
    path = path or runtime_dir()
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return ("cannot look at the probe runtime directory %s: %s" % (path, exc.strerror or exc),
                _ELSEWHERE)
    uid = os.getuid()
    if stat.S_ISLNK(info.st_mode):
        return ("the probe runtime directory %s is a symbolic link, which probe never follows" % path,
                "point PROBE_RUNTIME_DIR at the directory itself (not a link to it)")
    if not stat.S_ISDIR(info.st_mode):
        return ("the probe runtime directory %s is not a directory" % path, _ELSEWHERE)
    if info.st_uid != uid:
        return ("the probe runtime directory %s belongs to uid %d, not to this user (uid %d)"
                % (path, info.st_uid, uid), _ELSEWHERE)
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        return ("the probe runtime directory %s is open to other users (mode %04o); probe does not change "
                "the mode of a directory it did not create" % (path, mode),
                "`chmod 700 %s` if it is yours alone; otherwise %s (not a shared one such as /tmp)" % (path, _ELSEWHERE))
    return None


def ensure_runtime_dir() -> str:
    """Create the runtime directory (mode 0700) if it is missing, and check that only we own and enter it.

    Raises :class:`UsageError` (message and fix) when it cannot be created, or exists and is not a
    directory of ours closed to others; its mode is never changed.
    """
    from probe.errors import UsageError

    path = runtime_dir()
    if not os.environ.get("PROBE_RUNTIME_DIR") and taken_by_another(path):
        path = _make_fallback(path)
    try:
        os.makedirs(path, mode=0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise UsageError("cannot create the probe runtime directory %s: %s" % (path, exc.strerror or exc),
                         hint="create it (mode 0700), or " + _ELSEWHERE) from None
    problem = runtime_dir_problem(path)
    if problem:
        raise UsageError(*problem)
    return path


def _make_fallback(default: str) -> str:
    """A new private fallback beside ``default`` (mode 0700, a name no one can take first); of those made at
    once by several processes (the ranks of a job), each keeps the oldest, so they meet in one."""
    name = "%s-%016x-%s" % (default, time.time_ns(), os.urandom(4).hex())
    try:
        os.mkdir(name, 0o700)
    except OSError as exc:
        from probe.errors import UsageError

        raise UsageError("the probe runtime directory %s is taken by someone else, and no private one could be made "
                         "beside it: %s" % (default, exc.strerror or exc), hint=_ELSEWHERE) from None
    found = fallback_dirs(default)
    chosen = found[0] if found else name
    if chosen != name:
        try:
            os.rmdir(name)
        except OSError:
            pass
    _chosen[default] = chosen
    return chosen


def socket_path(pid: int) -> str:
    """The unix socket of the agent in process ``pid``."""
    return os.path.join(runtime_dir(), "%d.sock" % pid)


def token_path(pid: int) -> str:
    """The owner-only file that holds the TCP token of the agent in process ``pid``."""
    return os.path.join(runtime_dir(), "%d.token" % pid)


def process_start_ticks(pid: str = "self") -> int:
    """A process's start time in clock ticks after boot (/proc/PID/stat field 22): with the pid, a name
    that no later process can share. Raises OSError (no such process) or ValueError."""
    with open("/proc/%s/stat" % pid, "rb") as handle:
        stat = handle.read()
    try:
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except IndexError:
        raise ValueError("unexpected /proc/%s/stat" % pid) from None


def crash_record_path(pid: int, ticks: int) -> str:
    """The file where the agent of process ``pid`` (started at ``ticks``) leaves its last stacks."""
    return os.path.join(runtime_dir(), "%d-%d.crash" % (pid, ticks))


def progress_path(pid: int) -> str:
    """The small file where the agent of process ``pid`` keeps its optimizer step count and the time of its
    last step (``probe.tables.torch.steps``), for its node's helper to read without its GIL."""
    return os.path.join(runtime_dir(), "progress-%d.bin" % pid)


def job_token_path(port: int) -> str:
    """The token every rank of a job on this host shares (and its host helper): one per ``PROBE_PORT``."""
    return os.path.join(runtime_dir(), "job-%d.token" % port)


def helper_socket_path(pid: int) -> str:
    """The unix socket of the host helper in process ``pid`` (torchrun's launcher, or a node helper)."""
    return os.path.join(runtime_dir(), "host-%d.sock" % pid)


def node_socket_path(port: int) -> str:
    """Where the ranks of the job with ``PROBE_PORT`` = ``port`` find their node's helper, whichever
    process it runs in: one name per job and node (and user, as the directory is), known in advance."""
    return os.path.join(runtime_dir(), "node-%d.sock" % port)


def node_lock_path(port: int) -> str:
    """Held (``flock``) by the node helper that serves ``node_socket_path(port)``: one helper per job."""
    return os.path.join(runtime_dir(), "node-%d.lock" % port)


def node_log_path(port: int) -> str:
    """What a node helper process has to say (it holds none of the job's output streams)."""
    return os.path.join(runtime_dir(), "node-%d.log" % port)


def pid_from_socket_name(name: str) -> Optional[int]:
    """``"4242.sock"`` -> 4242; anything else -> None."""
    stem, dot, ext = name.partition(".")
    if dot and ext == "sock" and stem.isdigit():
        return int(stem)
    return None


def socket_state(path: str, timeout: float = 1.0) -> str:
    """What is at ``path``: ``"missing"``, ``"listening"`` (a connect succeeded), ``"refused"`` (a socket
    file nobody listens on: ECONNREFUSED), ``"not_socket"``, or ``"unknown"`` (anything else, such as a
    connect that timed out because every slot of the listener is taken)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    except OSError:
        return "unknown"
    if not stat.S_ISSOCK(info.st_mode):
        return "not_socket"
    if _listed_as_listening(path):
        return "listening"  # told without connecting: an agent that cannot run would keep that connection queued
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        return "listening"
    except ConnectionRefusedError:
        return "refused"
    except FileNotFoundError:
        return "missing"
    except OSError:
        return "unknown"
    finally:
        sock.close()


_LISTENING_FLAG = 0x10000  # __SO_ACCEPTCON in /proc/net/unix's Flags column: the socket listens


def _listed_as_listening(path: str) -> bool:
    """Whether this network namespace's /proc/net/unix shows a listening socket bound at ``path``.

    A connect is the other way to tell, but the connection it makes waits in the listener's backlog until
    the listener accepts it, and an agent whose GIL a C call holds accepts nothing: each look would leave
    one more there, until the backlog is full and every connect blocks. False where the table cannot be
    read or does not list it (a listener in another network namespace): the caller then connects."""
    try:
        with open("/proc/net/unix", "rb") as table:
            data = table.read(64 * 1024 * 1024)
    except OSError:
        return False
    wanted = os.fsencode(path)
    at = data.find(b" " + wanted + b"\n")
    while at >= 0:
        line_start = data.rfind(b"\n", 0, at) + 1
        fields = data[line_start:at].split()
        try:
            if len(fields) >= 6 and int(fields[3], 16) & _LISTENING_FLAG:
                return True
        except ValueError:
            pass
        at = data.find(b" " + wanted + b"\n", at + 1)
    return False


def is_stale_socket(path: str) -> bool:
    """Whether ``path`` provably belongs to no live agent: a socket file, not brand new, that refuses
    connections. A missing ``/proc/PID`` is no proof: the agent may live in another PID namespace."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISSOCK(info.st_mode) or time.time() - info.st_mtime < STALE_AFTER_S:
        return False
    return socket_state(path) == "refused"


def remove_stale_files(keep: Iterable[int] = ()) -> int:
    """Remove the files of agents (and host helpers) that provably died without their exit hooks (SIGTERM,
    SIGKILL, os._exit): a socket not touched for 2 s that refuses connections, and its token file. A
    live agent touches its socket every 0.25 s, so it is never even connected to; one whose GIL a C call
    holds still accepts, and keeps its files. ``keep``: pids whose files stay (the command's own targets,
    so that their error can say what became of them). Returns how many sockets went; never raises."""
    directory = runtime_dir()
    if runtime_dir_problem(directory):
        return 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    kept = set(keep)
    removed = 0
    for name in names:
        helper = name.startswith("host-")
        pid = pid_from_socket_name(name[5:] if helper else name)
        if pid is None or pid in kept:
            continue
        path = os.path.join(directory, name)
        if is_stale_socket(path):
            _remove_stale(pid, path, with_token=not helper)
            removed += 1
    return removed


def _remove_stale(pid: int, path: str, with_token: bool = True) -> None:
    directory = os.path.dirname(path)  # the runtime directory, or the fallback the agent used
    extra = (os.path.join(directory, "%d.token" % pid), os.path.join(directory, "progress-%d.bin" % pid),
             os.path.join(directory, "fr-%d.json" % pid))
    for stale in (path,) + extra if with_token else (path,):
        try:
            os.unlink(stale)
        except OSError:
            pass


_MAX_LINKS = 40


def open_parent_dir(path: str) -> Tuple[int, str]:
    """An ``O_PATH`` descriptor of ``path``'s directory and its last component, for ``*at`` calls.

    Walks the path one component at a time. A symbolic link on the way is followed only when it belongs
    to us or to root: a link that another user planted (say in a world-writable directory) is refused
    with ``PermissionError``. The last component is left to the caller, who opens it with
    ``O_NOFOLLOW``. The caller closes the descriptor.
    """
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    if not name or name in (".", ".."):
        raise IsADirectoryError(errno.EISDIR, "not a file name", path)
    base_flags = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC
    trusted = (0, os.getuid())
    fd = os.open("/", base_flags)
    try:
        pending = [p for p in parent.split("/") if p]
        links = 0
        while pending:
            part = pending.pop(0)
            if part == ".":
                continue
            try:
                nxt = os.open(part, base_flags | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                info = os.stat(part, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISLNK(info.st_mode):
                    raise
                if info.st_uid not in trusted:
                    raise PermissionError(errno.EPERM, "a symbolic link on the way belongs to uid %d (not to "
                                          "this user or root), so probe does not follow it" % info.st_uid,
                                          part) from None
                links += 1
                if links > _MAX_LINKS:
                    raise OSError(errno.ELOOP, "too many symbolic links", path) from None
                target = os.readlink(part, dir_fd=fd)
                if target.startswith("/"):
                    os.close(fd)
                    fd = -1
                    fd = os.open("/", base_flags)
                pending[:0] = [p for p in target.split("/") if p]
                continue
            os.close(fd)
            fd = nxt
        return fd, name
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
