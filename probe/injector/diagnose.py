"""Why an injection cannot work, found before trying, each reason with the step that fixes it.

Trying blind costs a gdb start-up and ends in "ptrace: Operation not permitted", which does not say
whether the cause is Yama, another user's process, a container without CAP_SYS_PTRACE or another
debugger. Reading /proc answers each of those exactly.
"""

import os
import shutil
from dataclasses import dataclass
from typing import List, Optional

from probe.errors import InjectError
from probe.injector.target import (CAP_SYS_PTRACE, TargetInfo, may_trace_anyone, process_exists, process_state,
                                   read_target, tracer_pid)

__all__ = ["Problem", "diagnose", "ptrace_problems", "MIN_VERSION", "CAP_SYS_PTRACE"]

MIN_VERSION = (3, 9)
_YAMA = "/proc/sys/kernel/yama/ptrace_scope"


@dataclass(frozen=True)
class Problem:
    """One reason the injection cannot work; ``code`` is stable, ``hint`` is the next step."""

    code: str
    message: str
    hint: str

    def to_error(self) -> InjectError:
        return InjectError(self.message, hint=self.hint)


def diagnose(pid: int, need_gdb: bool = True) -> List[Problem]:
    """Everything that stands in the way of injecting into ``pid``; [] when nothing does.

    Stops at the first problem that makes further checks meaningless (no process, not Python).
    """
    if not process_exists(pid):
        return [Problem("no_such_process", "no process with pid %d" % pid,
                        "check the pid with `probe list` or `ps`")]
    state = process_state(pid)
    if state == "Z":
        return [Problem("exited", "process %d has exited (a zombie its parent has not reaped)" % pid,
                        "nothing runs there any more; look at its parent (`ps -o ppid= -p %d`)" % pid)]
    try:
        info = read_target(pid)
    except FileNotFoundError:
        return [Problem("no_such_process", "process %d exited" % pid, "check the pid with `probe list`")]
    except PermissionError:
        return [Problem("hidden_process", "cannot read /proc/%d (hidepid, or another user's process)" % pid,
                        "run probe as the user who owns the process, or as root")]
    from probe.injector.advice import another_users

    foreign = another_users(pid, "inject")  # its exe and maps are closed to us: it would look like no Python
    if foreign is not None:
        return [Problem("other_user", foreign.message, foreign.hint or "")]
    if not info.is_python:
        name = os.path.basename(info.exe) or _comm(pid)
        return [Problem("not_python", "process %d (%s) is not a Python interpreter" % (pid, name),
                        "give the pid of the python process itself, not of a shell or launcher "
                        "(`probe list` shows the candidates)")]
    problems = _version_problems(info)
    if state == "T":
        problems.append(Problem("stopped", "process %d is stopped (SIGSTOP, or Ctrl-Z in its shell)" % pid,
                                "resume it with `kill -CONT %d` (or `fg` in its shell), then inject" % pid))
    if need_gdb and shutil.which("gdb") is None:
        problems.append(Problem("no_gdb", "gdb is not installed; probe uses it to start the agent",
                                "install it (`apt-get install gdb`, `dnf install gdb`), or start the agent "
                                "in the program itself: `import probe; probe.start()` or PROBE=1"))
    problems.extend(ptrace_problems(info))
    return problems


def _version_problems(info: TargetInfo) -> List[Problem]:
    if info.version is None:
        return [Problem("unknown_version", "cannot tell which Python version process %d runs" % info.pid,
                        "probe needs CPython 3.9 or newer; start the agent in the program: "
                        "`import probe; probe.start()`")]
    if info.version[0] != 3 or info.version < MIN_VERSION:
        return [Problem("old_python", "process %d runs Python %d.%d; probe needs 3.9 or newer" %
                        (info.pid, info.version[0], info.version[1]),
                        "no agent can run in it; its stacks can still be read from outside: `probe %d backtrace` "
                        "(run the program on Python 3.9+ for the rest)" % info.pid)]
    return []


def ptrace_problems(info: TargetInfo) -> List[Problem]:
    """Whether this process may ptrace the target, and if not, exactly why."""
    problems: List[Problem] = []
    privileged = may_trace_anyone()
    tracer = tracer_pid(info.pid)
    if tracer > 0:
        problems.append(Problem("already_traced", "process %d is already traced by pid %d (%s)" %
                                (info.pid, tracer, _comm(tracer)),
                                "detach that debugger or profiler (a process has one tracer at a time), "
                                "then try again"))
    if info.uid != os.getuid() and not privileged:
        problems.append(Problem("other_user", "process %d belongs to uid %d, and probe runs as uid %d" %
                                (info.pid, info.uid, os.getuid()),
                                "run probe as that user (`sudo -u '#%d' probe %d inject`) or as root" %
                                (info.uid, info.pid)))
    scope = _yama_scope()
    if scope == 1 and not privileged:
        problems.append(Problem("yama", "ptrace is restricted to descendants (%s = 1)" % _YAMA,
                                "allow it with `sudo sysctl kernel.yama.ptrace_scope=0`, or run probe as root"))
    elif scope == 2 and not privileged:
        problems.append(Problem("yama", "ptrace needs CAP_SYS_PTRACE (%s = 2)" % _YAMA,
                                "run probe as root (`sudo probe %d inject`)" % info.pid))
    elif scope == 3:
        problems.append(Problem("yama", "ptrace is disabled on this host until reboot (%s = 3)" % _YAMA,
                                "start the agent in the program instead: `import probe; probe.start()` or PROBE=1"))
    if not privileged and _in_container() and (info.uid != os.getuid() or (scope or 0) >= 1):
        problems.append(Problem("no_cap_sys_ptrace", "this container lacks CAP_SYS_PTRACE",
                                "run the container with `--cap-add=SYS_PTRACE` (docker) or "
                                "`securityContext.capabilities.add: [SYS_PTRACE]` (Kubernetes)"))
    return problems


def _yama_scope() -> Optional[int]:
    try:
        with open(_YAMA) as handle:
            return int(handle.read().strip())
    except (OSError, ValueError):
        return None  # no Yama on this kernel: classic ptrace rules


def _in_container() -> bool:
    if os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv"):
        return True
    try:
        with open("/proc/1/cgroup") as handle:
            text = handle.read()
    except OSError:
        return False
    return any(word in text for word in ("docker", "kubepods", "containerd", "lxc"))


def _comm(pid: int) -> str:
    try:
        with open("/proc/%d/comm" % pid) as handle:
            return handle.read().strip()
    except OSError:
        return "?"
