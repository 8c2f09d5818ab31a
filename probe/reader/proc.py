"""What the kernel tells about a process without asking it anything: its state, its threads' names and
context switches, and whether ptrace (which outside reading needs) is allowed. Stdlib only."""

import os
from typing import Collection, Dict, List, Optional, Tuple

__all__ = ["state", "comm", "thread_names", "voluntary_switches", "switch_counts", "queued_ns", "ptrace_denied_reason",
           "children", "environ", "STATE_WORDS"]

STATE_WORDS = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "T": "stopped (SIGSTOP)",
               "t": "stopped by a debugger", "Z": "a zombie (exited, not reaped)", "X": "dead", "I": "idle"}


def _stat_fields(path: str) -> Optional[list]:
    try:
        with open(path, "rb") as handle:
            stat = handle.read()
    except OSError:
        return None
    try:
        return stat[stat.rindex(b")") + 2:].decode("ascii", "replace").split()
    except ValueError:
        return None


def state(pid: int) -> Optional[str]:
    """The process's state letter (R, S, D, T, t, Z, ...), or None when there is no such process."""
    fields = _stat_fields("/proc/%d/stat" % pid)
    return fields[0] if fields else None


def comm(pid: int) -> Optional[str]:
    try:
        with open("/proc/%d/comm" % pid, "rb") as handle:
            return handle.read().decode("utf-8", "replace").strip()
    except OSError:
        return None


def thread_names(pid: int) -> Dict[int, str]:
    """OS thread id -> its OS-level name (the agent names its own threads ``probe-*``)."""
    out: Dict[int, str] = {}
    try:
        tids = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return out
    for tid in tids:
        try:
            with open("/proc/%d/task/%s/comm" % (pid, tid), "rb") as handle:
                out[int(tid)] = handle.read().decode("utf-8", "replace").strip()
        except (OSError, ValueError):
            continue
    return out


def voluntary_switches(pid: int, tid: int) -> Optional[int]:
    """How many times thread ``tid`` gave up the CPU by waiting. A thread that holds the GIL and hands
    it over when asked (Python code running) waits each time it wants it back; one held in a C call
    never does, so an unchanged count while the agent asks for the GIL means it is not handed over."""
    try:
        with open("/proc/%d/task/%d/status" % (pid, tid), "rb") as handle:
            for line in handle:
                if line.startswith(b"voluntary_ctxt_switches:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def switch_counts(pid: int, tids: Optional[List[int]] = None) -> Dict[int, int]:
    """Voluntary context switches of every thread of ``pid`` (or of ``tids``): thread id -> count. A thread
    missing from the answer has gone (or its status could not be read)."""
    out: Dict[int, int] = {}
    if tids is None:
        try:
            tids = [int(t) for t in os.listdir("/proc/%d/task" % pid)]
        except (OSError, ValueError):
            return out
    for tid in tids:
        count = voluntary_switches(pid, tid)
        if count is not None:
            out[tid] = count
    return out


def queued_ns(pid: int, tid: int) -> Optional[int]:
    """Nanoseconds thread ``tid`` has spent runnable but waiting for a CPU (schedstat's second field);
    None where the kernel does not keep it. A thread that waited for a CPU could not run meanwhile."""
    try:
        with open("/proc/%d/task/%d/schedstat" % (pid, tid), "rb") as handle:
            return int(handle.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None


def ptrace_denied_reason(pid: int) -> Tuple[str, str]:
    """Why ptrace of ``pid`` is likely refused, and what to do (for the reader's error message)."""
    try:
        owner = os.stat("/proc/%d" % pid).st_uid
    except OSError:
        owner = None
    if owner is not None and owner != os.getuid() and os.getuid() != 0:
        return ("it belongs to uid %d" % owner, "run probe as that user, or as root")
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as handle:
            scope = int(handle.read().strip() or 0)
    except (OSError, ValueError):
        scope = 0
    if scope == 1:
        return ("Yama's ptrace_scope is 1, which lets only a process's ancestors read it",
                "run probe with sudo, or `echo 0 | sudo tee /proc/sys/kernel/yama/ptrace_scope`")
    if scope >= 2:
        return ("Yama's ptrace_scope is %d" % scope, "run probe as root (ptrace_scope 2) or not at all (3)")
    if state(pid) == "t":
        return ("another debugger is attached to it", "detach that debugger first")
    return ("the kernel refused ptrace (a container without CAP_SYS_PTRACE?)",
            "run probe with sudo, or give its container CAP_SYS_PTRACE")


def children(pid: int) -> List[int]:
    """Direct children of ``pid``: /proc/PID/task/*/children (every thread's), else a scan of every
    /proc/N/stat where the kernel lacks that file; empty where ``pid`` is gone."""
    found: List[int] = []
    try:
        for tid in os.listdir("/proc/%d/task" % pid):
            with open("/proc/%d/task/%s/children" % (pid, tid), "rb") as handle:
                found.extend(int(p) for p in handle.read().split())
        return sorted(found)
    except FileNotFoundError:
        if not os.path.exists("/proc/%d" % pid):
            return []
    except (OSError, ValueError):
        pass
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _stat_fields("/proc/%s/stat" % name)
            if fields and len(fields) > 1 and fields[1] == str(pid):
                found.append(int(name))
    return sorted(found)


def environ(pid: int, names: Collection[bytes] = (), prefixes: Tuple[bytes, ...] = ()) -> Dict[bytes, bytes]:
    """The variables of ``pid``'s environment as it was at its start (/proc/PID/environ, the first MiB) that are
    named in ``names`` or begin with one of ``prefixes``; empty where it cannot be read (gone, another user's)."""
    try:
        with open("/proc/%d/environ" % pid, "rb") as handle:
            raw = handle.read(1 << 20)
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep and (name in names or (prefixes and name.startswith(prefixes))):
            out[name] = value
    return out
