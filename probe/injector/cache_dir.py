"""probe's cache directory (``$XDG_CACHE_HOME/probe``, ``~/.cache/probe``), made only where no other user
can change it: gdb loads code and symbols from it.

``$HOME`` and ``$XDG_CACHE_HOME`` say where the cache is, not whose it is: root running probe with another
user's ``HOME`` (``sudo`` keeps it on many systems) would make ``/home/alice/.cache/probe`` as root, in a
directory alice controls, and she could swap it for her own between the check and gdb's read. So every
directory on the way must be root's or ours and writable by no one else (a sticky one, as /tmp, may be);
where that is not so, the cache goes to the home directory the password database gives our uid instead
(root's own), checked the same way, or there is none.
"""

import os
import pwd
import stat
from typing import List, Optional, Tuple

__all__ = ["cache_dir", "why_not_ours"]


def cache_dir(name: str = "") -> Tuple[Optional[str], str]:
    """``<cache>/probe/NAME``, made if missing (0700): (the path, "") or (None, why there is none)."""
    reasons: List[str] = []
    for base in _bases():
        why = why_not_ours(base)
        if why:
            reasons.append(why)
            continue
        # Another user's directory on the way sends us to our own home; a directory of ours that is not
        # private (we made it so) is our choice, and then there is no cache.
        path = os.path.join(base, "probe", name) if name else os.path.join(base, "probe")
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as exc:
            return None, "cannot make %s: %s" % (path, exc.strerror or exc)
        why = why_not_ours(path, private=True)
        if why or "\n" in path:
            return None, why or "%r holds a line break" % path
        return path, ""
    return None, "; ".join(dict.fromkeys(reasons)) or "no cache directory"


def _bases() -> List[str]:
    named = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    out = [os.path.abspath(named)]
    try:
        own = os.path.join(pwd.getpwuid(os.getuid()).pw_dir, ".cache")
    except (KeyError, OSError):
        own = ""
    if own and os.path.abspath(own) not in out:
        out.append(os.path.abspath(own))
    return out


def why_not_ours(path: str, private: bool = False) -> str:
    """Why another user could change ``path`` or a directory on the way to it ("" when none can): each
    existing component, and where it is a link the components of what it points to, must be ours or
    root's, and writable by no one else unless sticky. ``private``: the existing ``path`` itself (and each
    directory below the first one we check) must be ours alone."""
    uid = os.getuid()
    for real in (path, os.path.realpath(path)):
        current = "/"
        for part in [p for p in real.split("/") if p]:
            current = os.path.join(current, part)
            try:
                info = os.lstat(current)
            except FileNotFoundError:
                break  # we make the rest, under a directory that is ours or root's
            except OSError as exc:
                return "cannot look at %s: %s" % (current, exc.strerror or exc)
            if info.st_uid not in (0, uid):
                return "%s belongs to uid %d, and gdb would load what it finds under it" % (current, info.st_uid)
            if stat.S_ISLNK(info.st_mode):
                continue  # its target's components are checked as ``realpath``'s
            if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
                return "%s may be changed by other users (mode %04o)" % (current, stat.S_IMODE(info.st_mode))
    if private:
        try:
            info = os.lstat(path)
        except OSError as exc:
            return "cannot look at %s: %s" % (path, exc.strerror or exc)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid or info.st_mode & 0o022:
            return "%s must be a directory that only you can write (gdb loads code from it)" % path
    return ""
