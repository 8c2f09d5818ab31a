"""Who uses an exposure directory (``<runtime dir>/pkg-*``, see ``bootstrap_line``), so that one no live
process imports from can be removed.

A process that got probe from such a directory keeps importing from it for its whole life (the agent
imports its submodules lazily, through the package's ``__path__``), so the injector records each target
in ``pkg-<hash>.users/<pid namespace>-<pid>-<start ticks>`` before it injects. A directory goes only
when every recorded process is provably gone: same PID namespace as ours, and no process with that pid
and start time (a zombie imports nothing). A directory with no record (made before records existed) or a
process in another PID namespace is never judged. Injectors and the clean-up take one lock, so a
directory is never removed between its record and the injection. Runs in the client only.
"""

import errno
import fcntl
import os
import time
from contextlib import contextmanager
from typing import Iterator, Optional

from probe import _paths

__all__ = ["record_user", "remove_unused", "users_dir", "exposure_lock"]

_LOCK_WAIT_S = 5.0


def users_dir(path: str) -> str:
    return path + ".users"


def _pid_namespace(pid: str = "self") -> str:
    try:
        link = os.readlink("/proc/%s/ns/pid" % pid)
    except OSError:
        return "0"
    return "".join(c for c in link if c.isdigit()) or "0"


@contextmanager
def exposure_lock(directory: str, wait: bool = True) -> Iterator[bool]:
    """The runtime directory's exposure lock (an advisory ``flock``), held for the block; yields whether it
    was taken (``wait=False``: not when another client holds it; ``wait=True``: at most 5 s)."""
    fd = os.open(os.path.join(directory, "pkg.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + (_LOCK_WAIT_S if wait else 0.0)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.01)
        yield True
    finally:
        os.close(fd)


def record_user(path: str, pid: int) -> None:
    """Record process ``pid`` as a user of the exposure directory ``path`` (call with the lock held)."""
    users = users_dir(path)
    os.makedirs(users, mode=0o700, exist_ok=True)
    name = "%s-%d-%d" % (_pid_namespace(), pid, _paths.process_start_ticks(str(pid)))
    os.close(os.open(os.path.join(users, name), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))


def _alive(entry: str, namespace: str) -> bool:
    """Whether the user recorded as ``entry`` may still run: True unless provably gone."""
    parts = entry.split("-")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return True  # not ours to judge
    ns, pid, ticks = parts
    if ns != namespace:
        return True  # another PID namespace: its pids mean nothing here
    from probe.reader import proc

    try:
        same = _paths.process_start_ticks(pid) == int(ticks)
    except (OSError, ValueError):
        return False
    return same and proc.state(int(pid)) not in (None, "Z", "X")


def remove_unused(directory: Optional[str] = None) -> int:
    """Remove the exposure directories of the runtime directory whose recorded users are all gone, and
    the records of gone users; returns how many directories went. Never raises; skips when another
    client holds the lock (an injection is under way)."""
    directory = directory or _paths.runtime_dir()
    if _paths.runtime_dir_problem(directory) or not os.path.isdir(directory):
        return 0
    removed = 0
    try:
        with exposure_lock(directory, wait=False) as locked:
            if not locked:
                return 0
            namespace = _pid_namespace()
            for name in os.listdir(directory):
                if name.startswith("pkg-") and "." not in name and _unused(os.path.join(directory, name), namespace):
                    removed += 1
    except OSError:
        pass
    return removed


def _unused(path: str, namespace: str) -> bool:
    """Prune ``path``'s records of gone users; remove it when none is left. Whether it was removed."""
    users = users_dir(path)
    try:
        entries = os.listdir(users)
    except OSError:
        return False  # no record: made before records existed, or not by the injector; never judged
    live = 0
    for entry in entries:
        if _alive(entry, namespace):
            live += 1
        else:
            _unlink(os.path.join(users, entry))
    if live:
        return False
    try:
        for name in os.listdir(path):  # a link to the package (and perhaps a leftover .tmp link)
            _unlink(os.path.join(path, name))
        os.rmdir(path)
        os.rmdir(users)
    except OSError:
        return False
    return True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
