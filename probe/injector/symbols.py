"""Which files gdb reads the target's libpython and libc symbols from: copies that hold no debug information.

gdb needs three things from a library: the names of its functions (the ELF symbol table, static functions
included), how to unwind through them (``.eh_frame``, which the library itself carries) and the addresses
of the functions it calls. Its DWARF debug information (libpython's own, libc's separate file from
libc6-dbg) gives none of these, yet reading it was most of what gdb did before attaching (~125 ms of CPU
here, with gdb's index cache, against ~35 ms for the symbol tables alone; looking up the called
functions expanded whole compilation units), and ``bt`` with the target stopped expanded ceval.c's
(4-10 ms of the pause).

So each library is copied once with ``objcopy --strip-debug`` (symbol table and unwind tables kept) into
``$XDG_CACHE_HOME/probe/gdb-symbols``, a directory of ours alone (gdb trusts what it reads there), named
by the file's build id, size and mtime; a separate debug file (``/usr/lib/debug/.build-id/xx/yyyy.debug``)
is copied the same way under ``debug/.build-id/`` there, which becomes gdb's ``debug-file-directory``.
A copy that no injection used for 30 days is removed when a new one is made. The executable is read
the same way before attaching, and gdb's sysroot is an empty directory of ours: as it attached, gdb
opened every library the process maps (hundreds in a torch process), symbols or not.

What changes in gdb's backtraces: functions the compiler inlined have no frame of their own (``pysleep``
appears as ``time_sleep``, its caller); ``threads`` reads both forms. Where a copy cannot be made (no
objcopy, no build id, a cache directory that is not ours alone, ``PROBE_GDB_SYMBOLS=full``), gdb reads
the libraries themselves with their debug information, as before.
"""

import os
import shutil
import subprocess
import tempfile
import time
from typing import List, Optional, Sequence, Tuple

from probe.injector.elf import build_id, has_debug_info

__all__ = ["SymbolFiles", "symbol_files", "private_cache_dir", "SYSTEM_DEBUG_DIR"]

SYSTEM_DEBUG_DIR = "/usr/lib/debug"
_KEPT_UNUSED_S = 30 * 86400  # a copy no injection used for this long goes (a Python upgraded away)


class SymbolFiles:
    """The files gdb loads (path, load address) and the commands that set it up for them."""

    def __init__(self, libraries: Sequence[Tuple[str, int]], commands: Sequence[str], lean: bool) -> None:
        self.libraries = list(libraries)
        self.commands = list(commands)
        self.lean = lean
        """True: copies without debug information; False: the libraries themselves, DWARF and all."""


def private_cache_dir(name: str) -> Optional[str]:
    """``$XDG_CACHE_HOME/probe/NAME`` (``~/.cache/probe/NAME``), made if missing: a directory of ours alone
    that no other user can change on the way (``probe.injector.cache_dir``), None where there is none (gdb
    trusts what it finds there as it reads a library)."""
    from probe.injector.cache_dir import cache_dir

    return cache_dir(name)[0]


def symbol_files(libraries: Sequence[Tuple[str, int]], timeout: float, executable: str = "") -> SymbolFiles:
    """Lean copies of ``libraries`` (and of ``executable``, which gdb then reads before attaching) when
    every one can be had within ``timeout`` seconds, else the libraries themselves (with gdb's index
    cache of their debug information, where it can be kept) and the executable read as gdb attaches."""
    lean = None if os.environ.get("PROBE_GDB_SYMBOLS") == "full" else _lean(libraries, timeout, executable)
    if lean is not None:
        return lean
    cache = private_cache_dir("gdb-index")
    commands = ["set index-cache directory %s" % cache, "set index-cache enabled on"] if cache else []
    return SymbolFiles(libraries, commands, lean=False)


def _lean(libraries: Sequence[Tuple[str, int]], timeout: float, executable: str) -> Optional[SymbolFiles]:
    objcopy = shutil.which("objcopy")
    cache = private_cache_dir("gdb-symbols")
    if objcopy is None or cache is None:
        return None
    try:
        return _copies(objcopy, cache, libraries, timeout, executable)
    except OSError:  # a library replaced or deleted since the target mapped it
        return None


def _copies(objcopy: str, cache: str, libraries: Sequence[Tuple[str, int]], timeout: float,
            executable: str) -> Optional[SymbolFiles]:
    debug_dir = os.path.join(cache, "debug")
    found: List[Tuple[str, int]] = []
    for path, base in list(libraries) + ([(executable, -1)] if executable else []):
        ident = build_id(path)
        if ident is None or len(ident) < 4:
            return None
        copy = _stripped(objcopy, path, os.path.join(cache, _name(ident, path, ".so")), timeout)
        if copy is None:
            return None
        separate = os.path.join(SYSTEM_DEBUG_DIR, ".build-id", ident[:2], ident[2:] + ".debug")
        if os.path.isfile(separate):
            where = os.path.join(debug_dir, ".build-id", ident[:2], ident[2:] + ".debug")
            if _stripped(objcopy, separate, where, timeout, always=True) is None:
                return None
        found.append((copy, base))
    # No library file is to be found under gdb's sysroot: as it attaches, gdb no longer opens each of the
    # hundreds a torch process maps (it did, symbols or not: ~25 ms of the pause); the executable, read
    # here beforehand, tells it the entry point its calls return to.
    empty = os.path.join(cache, "no-sysroot")
    _make_dirs(empty)
    commands = ["set debug-file-directory %s" % debug_dir, "set sysroot %s" % empty, "set exec-file-mismatch off"]
    if executable:
        commands.append("file %s" % found.pop()[0])
    return SymbolFiles(found, commands, lean=True)


def _name(ident: str, path: str, suffix: str) -> str:
    info = os.stat(path)
    return "%s-%d-%d%s" % (ident, info.st_size, info.st_mtime_ns, suffix)


def _stripped(objcopy: str, source: str, target: str, timeout: float, always: bool = False) -> Optional[str]:
    """``target``: ``source`` without debug information, made once; ``source`` itself where it has none
    (unless ``always``); None when no copy can be made."""
    if os.path.isfile(target):
        _used(target)
        return target
    if not always and not has_debug_info(source):
        return source  # nothing to strip: gdb reads it as fast as a copy
    directory = os.path.dirname(target)
    try:
        _make_dirs(directory)
        fd, scratch = tempfile.mkstemp(prefix=".probe-", dir=directory)
        os.close(fd)
    except OSError:
        return None
    try:
        done = subprocess.run([objcopy, "--strip-debug", source, scratch], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=max(timeout, 0.1))
        if done.returncode != 0 or build_id(scratch) != build_id(source):
            return None
        os.replace(scratch, target)  # whole or not at all, for an injection beside this one
        _prune(os.path.dirname(target))
        return target
    except (OSError, subprocess.SubprocessError):
        return None
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)



def _make_dirs(path: str) -> None:
    """``path`` and the directories above it that are missing, each ours alone."""
    if not os.path.isdir(path):
        _make_dirs(os.path.dirname(path))
        os.makedirs(path, mode=0o700, exist_ok=True)


def _used(path: str) -> None:
    """Mark a copy as used (its mtime, at most once a day)."""
    try:
        if os.stat(path).st_mtime < time.time() - 86400:
            os.utime(path)
    except OSError:
        pass


def _prune(directory: str) -> None:
    """Remove the copies in ``directory`` that no injection used for 30 days."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if name.endswith((".so", ".debug")):
            path = os.path.join(directory, name)
            try:
                if os.lstat(path).st_mtime < time.time() - _KEPT_UNUSED_S:
                    os.unlink(path)
            except OSError:
                pass
