"""gdb's calls into the target on CPUs whose register state gdb does not fully know (AMX).

gdb writes a thread's saved registers back after each call it makes. Where the CPU has state
components newer than gdb (AMX tiles on recent Xeons), the kernel refuses gdb's shorter buffer, the
write fails, and the thread resumes with the call's registers: the target dies (seen with gdb 13.1 on
a kernel with AMX). The fix is a small wrapper around ``ptrace`` that gdb loads with ``LD_PRELOAD``
(``xstate_shim.c``, beside this file); it is built once with the host's C compiler into a directory
only this user can write. Where the CPU has no such state, gdb runs as it is.
"""

import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from typing import Dict, Optional

from probe.errors import InjectError

__all__ = ["needs_fix", "gdb_environment"]

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "xstate_shim.c")
_NEWER_STATE_FLAGS = ("amx_tile", "amx_bf16", "amx_int8", "apx_f")


def needs_fix(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True on x86-64 when the CPU has register state that gdb 13 cannot write back."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        with open(cpuinfo) as handle:
            for line in handle:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return any(flag in flags for flag in _NEWER_STATE_FLAGS)
    except OSError:
        pass
    return False


def gdb_environment() -> Optional[Dict[str, str]]:
    """The environment gdb must run with on this CPU; None where gdb needs nothing.

    Raises ``InjectError`` where the wrapper is needed and cannot be built: injecting without it
    would crash the target.
    """
    if not needs_fix():
        return None
    env = dict(os.environ)
    preload = env.get("LD_PRELOAD", "")
    env["LD_PRELOAD"] = _shim() + (" " + preload if preload else "")
    return env


def _shim() -> str:
    with open(_SOURCE, "rb") as handle:
        source = handle.read()
    directory = _cache_dir()
    path = os.path.join(directory, "xstate-%s.so" % hashlib.sha256(source).hexdigest()[:16])
    if _trusted_file(path):
        return path
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise InjectError("gdb cannot restore a thread's registers on this CPU (it has AMX state that gdb "
                          "does not know), and probe needs a C compiler to build the small fix it gives gdb",
                          hint="install one (`apt-get install gcc`) and retry, or start the agent with PROBE=1")
    fd, temporary = tempfile.mkstemp(prefix=".xstate-", suffix=".so", dir=directory)
    os.close(fd)
    try:
        result = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", temporary, _SOURCE, "-ldl"],
                                capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        if result.returncode != 0:
            raise InjectError("could not build probe's register fix for gdb on this CPU: %s"
                              % (result.stderr.strip().splitlines() or ["compiler failed"])[-1],
                              hint="start the agent with PROBE=1 instead of injecting")
        os.chmod(temporary, 0o700)
        os.replace(temporary, path)
    except subprocess.TimeoutExpired:
        raise InjectError("building probe's register fix for gdb took over 60 s",
                          hint="retry; or start the agent with PROBE=1") from None
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return path


def _cache_dir() -> str:
    """``$XDG_CACHE_HOME/probe`` or ``~/.cache/probe``: ours alone, since gdb loads code from it; where
    another user could change it (root with their HOME), our own home's (``probe.injector.cache_dir``)."""
    from probe.injector.cache_dir import cache_dir

    path, why = cache_dir()
    if path is None:
        raise InjectError("probe has no cache directory that only you can write (gdb loads code from it): %s" % why,
                          hint="set XDG_CACHE_HOME to a private directory of yours")
    return path


def _trusted_file(path: str) -> bool:
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o022
