"""What /proc says about a target process: its interpreter, version, owner, tracer and socket; and
whether we may trace another user's process at all (CAP_SYS_PTRACE).

The injector decides everything it can from /proc before it starts gdb, because reading /proc is cheap
and a wrong guess inside gdb is not. Runs in the client's process (Linux only).
"""

import os
import re
from typing import Dict, NamedTuple, Optional, Tuple

from probe import _paths
from probe.injector.elf import python_version_of

__all__ = ["TargetInfo", "read_target", "tracer_pid", "process_state", "running_threads", "target_environ",
           "expected_socket_path", "process_exists", "may_trace_anyone", "CAP_SYS_PTRACE"]

_LIBPYTHON = re.compile(r"/libpython(\d+)\.(\d+)[a-z]*\.so")
_EXE_VERSION = re.compile(r"python(\d+)\.(\d+)")


class TargetInfo(NamedTuple):
    """The facts about one process that decide whether and how to inject (no dataclass: the module is on the path
    of ``probe PID backtrace`` of a process without agent, and dataclasses imports inspect, some 4 ms)."""

    pid: int
    exe: str
    """The executable /proc/PID/exe points at ("" when it cannot be read)."""
    uid: int
    """The real uid that owns the process."""
    libpython: Optional[str]
    """The libpythonX.Y.so mapped into the process; None for a statically linked interpreter."""
    is_python: bool
    version: Optional[Tuple[int, int]]
    """(major, minor) of the interpreter, None when it could not be told."""


def process_exists(pid: int) -> bool:
    return os.path.isdir("/proc/%d" % pid)


def process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat: R running, S sleeping, T stopped, t traced, Z zombie; "" if gone."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as handle:
            stat = handle.read()
    except OSError:
        return ""
    return stat[stat.rfind(b")") + 2:][:1].decode("ascii", "replace")


def running_threads(pid: int) -> "tuple[int, int]":
    """(threads, of which running or runnable) of process ``pid``, from /proc; (0, 0) if unreadable."""
    total = running = 0
    try:
        tasks = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return 0, 0
    for task in tasks:
        total += 1
        try:
            with open("/proc/%d/task/%s/stat" % (pid, task), "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        running += stat[stat.rfind(b")") + 2:][:1] == b"R"
    return total, running


def read_target(pid: int) -> TargetInfo:
    """Read the target's facts; raises FileNotFoundError if it does not exist, PermissionError if hidden."""
    status = _status(pid)
    uid = int(status.get("Uid", "-1").split()[0])
    try:
        exe = os.readlink("/proc/%d/exe" % pid)
    except OSError:
        exe = ""
    libpython = _mapped_libpython(pid)
    is_python = libpython is not None or _exe_embeds_python(pid)
    version = _version(pid, exe, libpython) if is_python else None
    return TargetInfo(pid, exe, uid, libpython, is_python, version)


def tracer_pid(pid: int) -> int:
    """The pid of the process tracing ``pid`` (gdb, strace, py-spy), 0 when none; -1 when gone."""
    try:
        return int(_status(pid).get("TracerPid", "0"))
    except (OSError, ValueError):
        return -1


def target_environ(pid: int) -> Dict[str, str]:
    """The environment the target started with (later changes inside it are invisible); {} if unreadable."""
    try:
        with open("/proc/%d/environ" % pid, "rb") as handle:
            raw = handle.read()
    except OSError:
        return {}
    env: Dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return env


def expected_socket_path(pid: int, uid: int) -> str:
    """Where the agent in ``pid`` will put its socket: ``probe._paths.runtime_dir`` as the target sees it.

    The agent derives the directory from its own environment and uid, which may differ from ours (root
    injecting into a user's process, a different ``XDG_RUNTIME_DIR``), so the rule is applied to the
    target's environment here.
    """
    env = target_environ(pid)
    if env.get("PROBE_RUNTIME_DIR"):
        base = env["PROBE_RUNTIME_DIR"]
    elif env.get("XDG_RUNTIME_DIR") and os.path.isdir(env["XDG_RUNTIME_DIR"]):
        base = os.path.join(env["XDG_RUNTIME_DIR"], "probe")
    else:
        tmp = next((env[k] for k in ("TMPDIR", "TEMP", "TMP") if env.get(k) and os.path.isdir(env[k])), "/tmp")
        base = os.path.join(tmp, "probe-%d" % uid)
    if not env.get("PROBE_RUNTIME_DIR") and uid == os.getuid() and _paths.taken_by_another(base):
        # another user made the default first: the agent uses the oldest private fallback beside it
        fallbacks = _paths.fallback_dirs(base)
        held = [d for d in fallbacks if os.path.lexists(os.path.join(d, "%d.sock" % pid))]
        base = (held or fallbacks or [base])[0]
    return os.path.join(base, "%d.sock" % pid)


def _status(pid: int) -> Dict[str, str]:
    with open("/proc/%d/status" % pid) as handle:
        return dict(line.rstrip("\n").split(":\t", 1) for line in handle if ":\t" in line)


def _mapped_libpython(pid: int) -> Optional[str]:
    try:
        with open("/proc/%d/maps" % pid) as handle:
            for line in handle:
                if _LIBPYTHON.search(line):
                    return line.split(None, 5)[-1].strip()
    except OSError:
        pass
    return None


def _exe_embeds_python(pid: int) -> bool:
    """A statically linked interpreter exports the C API from the executable itself."""
    try:
        with open("/proc/%d/exe" % pid, "rb") as handle:
            return _contains(handle, b"Py_AddPendingCall\0")
    except OSError:
        return False


def _contains(handle: "object", needle: bytes, chunk: int = 1 << 20) -> bool:
    tail = b""
    while True:
        block = handle.read(chunk)  # type: ignore[attr-defined]
        if not block:
            return False
        if needle in tail + block:
            return True
        tail = block[-len(needle):]


def _version(pid: int, exe: str, libpython: Optional[str]) -> Optional[Tuple[int, int]]:
    if libpython:
        match = _LIBPYTHON.search(libpython)
        if match:
            return int(match.group(1)), int(match.group(2))
    match = _EXE_VERSION.search(os.path.basename(exe))
    if match:
        return int(match.group(1)), int(match.group(2))
    return _read_version(pid)


def _read_version(pid: int) -> Optional[Tuple[int, int]]:
    """From the bytes of the target's executable (``/proc/PID/exe`` opens it even when replaced).

    Never by running it: the process may be another user's binary that only calls itself python.
    """
    return python_version_of("/proc/%d/exe" % pid)


CAP_SYS_PTRACE = 19


def may_trace_anyone() -> bool:
    """CAP_SYS_PTRACE in our effective set (root has it): other users' processes are open to us."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_PTRACE & 1)
    except (OSError, ValueError):
        pass
    return False
