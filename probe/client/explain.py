"""Why no agent answered a process of this host, and what to do next: the errors a failed connect turns into.

A connect that fails says little ("no such file", "connection refused"); the process says more: gone,
a zombie, dead with a crash record (its last stacks attached), not Python, another user's, or running
no agent, with the step that works for it (``probe.injector.advice``). Its stacks, read from outside
once here, travel on the error, for backtrace and SQL to use.
"""

import os
import time
from typing import Any, Optional

from probe import _paths
from probe.client.targets import Target
from probe.errors import ProbeError, ProcessDead

__all__ = ["explain", "dead_with_record", "process_state"]


def explain(target: Target, exc: ProbeError) -> ProbeError:
    """Turn 'no agent at unix:/tmp/...' into what happened to process PID, and what to do about it."""
    from probe.errors import ConnectError

    if not isinstance(exc, ConnectError) or target.pid is None:
        return exc
    pid = target.pid
    path = getattr(target.address, "path", None) or _paths.socket_path(pid)
    # transport raises ConnectError from the OSError of the failed step (kept as __context__); a
    # ConnectError without one, or from a reset or broken pipe, means the connection was made and
    # then dropped: the agent was answering.
    cause = exc.__context__
    answering = cause is None or isinstance(cause, (ConnectionResetError, BrokenPipeError))
    state = process_state(pid, wait=0.5 if answering else 0.0)
    if state in ("gone", "zombie"):
        dead = dead_with_record(pid, answering)
        if dead is not None and dead.record.has_stacks:  # type: ignore[attr-defined]
            if state == "zombie":
                dead.message += _zombie_note(pid)
            return dead
    if answering and state in ("gone", "zombie"):
        return ConnectError("process %d died while answering (it exited or was killed)%s"
                            % (pid, _zombie_note(pid) if state == "zombie" else ""),
                            hint="its exit status, or the kernel log (OOM killer), may say why")
    if os.path.dirname(path) == _paths.runtime_dir():
        problem = _paths.runtime_dir_problem()
        if problem:
            return ConnectError(problem[0] + "; no agent uses it", hint=problem[1])
    socket_state = _paths.socket_state(path)
    refused = socket_state == "refused"
    if state == "zombie":
        return ConnectError("process %d has exited%s" % (pid, _zombie_note(pid)),
                            hint="nothing runs there to answer; its parent must reap it (wait for it)")
    if state == "gone":
        if refused:
            return ConnectError("process %d is gone (it exited or was killed) and left its agent's socket %s%s"
                                % (pid, path, "; no handler could run (SIGTERM, SIGKILL, the OOM killer, os._exit)"
                                   if dead is not None else ""), hint="`probe list` removes such leftovers")
        return ConnectError("no process with pid %d (it exited, was killed, or never was)" % pid,
                            hint="check the pid with `probe list` or ps")
    from probe.injector.advice import another_users

    foreign = another_users(pid)  # its /proc files and its agent's directory are closed to us
    if foreign is not None:
        return foreign
    if refused:
        return _agentless_advice(pid, path, "no agent listens in process %d: its socket %s refuses connections "
                                 "(its agent stopped, or an earlier process with this pid died and left it)"
                                 % (pid, path))
    if answering or socket_state != "missing":
        return exc  # what transport said is all there is to say (permission denied, a dropped answer)
    not_python = _not_python(pid)
    if not_python:
        return ConnectError("process %d (%s) is not a Python interpreter, so no agent can run in it" % (pid, not_python),
                            hint="give the pid of the Python process itself (`probe list` shows them)")
    from probe.reader import agentless  # not on the path of an agent's answer

    return _agentless_advice(pid, path, agentless.MESSAGE % pid)


def _agentless(exc: ProbeError, pid: int) -> ProbeError:
    """Mark an error about a live local process that runs no agent: its stacks can still be read from outside."""
    exc.agentless_pid = pid  # type: ignore[attr-defined]
    return exc


def _agentless_advice(pid: int, path: str, message: str) -> ProbeError:
    """The error for a live local Python process of ours with no agent at ``path``: ``message``, with the
    next step that works for this process (see ``probe.injector.advice``): an old Python gets none (its
    stacks are read from outside), torchrun's launcher its job's ``ranks`` command, an agent in another
    runtime directory its socket, a C call that keeps the GIL the news that no agent can start before
    it returns, ``PROBE=1`` under an interpreter without probe that fact; else PROBE=1 or inject."""
    from probe.errors import ConnectError, ReaderError
    from probe.injector import advice

    inject = "`probe %d inject`" % pid
    outside = "its stacks are read from outside: `probe %d backtrace` (SQL over python.backtrace works too)" % pid
    version = advice.old_python(pid)
    if version is not None:
        return _agentless(ConnectError("%s, and none can run there: it runs Python %d.%d, and probe's agent needs "
                                       "%d.%d or newer" % ((message,) + version + advice.MIN_VERSION), hint=outside), pid)
    launcher = advice.launcher_advice(pid)
    if launcher is not None:
        return _agentless(ConnectError(launcher[0], hint=launcher[1]), pid)
    elsewhere = advice.agent_elsewhere(pid, path)
    if elsewhere is not None:
        return _agentless(ConnectError("%s at %s: its own environment (another PROBE_RUNTIME_DIR or XDG_RUNTIME_DIR) "
                                       "puts its agent's socket at %s" % ("no agent in process %d" % pid, path, elsewhere),
                                       hint="`%s`" % advice.command_line(pid, target="unix:" + elsewhere)), pid)
    from probe.reader import live

    try:
        stacks = live.read_live(pid) if live.available() else None
    except ReaderError:
        stacks = None
    holder = advice.gil_kept_in_c(pid, stacks)
    requested = advice.probe_requested(pid)
    pending = _queued_start(pid, path)
    if pending is not None:
        exc = ConnectError("%s yet: the start that `probe %d inject` queued %s ago has not run (%s)"
                           % (message, pid, _ago(pending.since), pending.why),
                           hint="the agent starts by itself once it can, and `probe %d health` answers then; meanwhile %s" % (pid, outside))
    elif holder is not None:
        exc = ConnectError("%s, and none can start now: thread %s holds the GIL in %s inside a call into C that does "
                           "not let go; an agent needs the GIL to start, so injecting one cannot work until that call "
                           "returns" % (message, holder.label().strip(), holder.where()),
                           hint="%s; `probe %d backtrace --native` shows the C frames" % (outside, pid))
    elif requested is not None and advice.forked_from(pid) is not None:
        parent = advice.forked_from(pid)
        exc = ConnectError("%s: it was forked from process %s, which runs an agent, and an agent does not follow a "
                           "fork (%s in its environment is its parent's)" % (message, parent, requested),
                           hint="%s starts one in it (a DataLoader worker is also listed by its parent: `probe %s "
                                "query \"SELECT * FROM python.workers\"`)" % (inject, parent))
    elif requested is not None:
        installed, exe = advice.autostart_installed(pid)
        if installed is False:
            exc = ConnectError("%s: %s is set in its environment, but probe is not installed for its interpreter "
                               "%s, so nothing started an agent" % (message, requested, exe),
                               hint="%s starts one now; for %s to work, install probe for that interpreter: %s"
                                    % (inject, requested, advice.install_hint(exe)))
        else:
            exc = ConnectError("%s, although %s is set in its environment (started with python -S or -I, or the "
                               "agent failed: its stderr says why in a line that starts with 'probe:')"
                               % (message, requested), hint="%s starts one now" % inject)
    else:
        from probe.reader import agentless  # probe.cli.quick says the same of the plain case

        exc = ConnectError(message, hint=agentless.HINT % pid)
    exc = _agentless(exc, pid)
    exc.outside = stacks  # type: ignore[attr-defined]  # read once: backtrace and SQL use them
    return exc


def _queued_start(pid: int, path: str) -> Optional[Any]:
    """The note ``probe PID inject`` left when the start it queued had not run (``probe.injector.queued``)."""
    from probe.injector import queued

    return queued.read(pid, path)


def _ago(since: float) -> str:
    seconds = max(0.0, time.time() - since)
    return "%.0f s" % seconds if seconds < 120 else "%.0f min" % (seconds / 60)


def dead_with_record(pid: int, answering: bool = False) -> Optional[ProcessDead]:
    """A dead process whose agent left a crash record: how it died, with the record attached."""
    from probe.reader import crash

    record = crash.dead_record(pid)
    if record is None:
        return None
    when = ", at %s" % time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.died_at)) if record.died_at else ""
    hint = ("its last stacks: `probe %d backtrace` (SQL over python.backtrace works too)" % pid if record.has_stacks
            else "it left no stacks; its exit status, or the kernel log (OOM killer), may say more")
    what = "died while answering" if answering else "is dead"
    exc = ProcessDead("process %d %s: %s%s" % (pid, what, record.cause, when), hint=hint)
    exc.record = record  # type: ignore[attr-defined]
    return exc


def process_state(pid: int, wait: float = 0.0) -> str:
    """``"gone"``, ``"zombie"`` (exited, not reaped by its parent) or ``"alive"``, from /proc/PID/stat.

    With ``wait``, an alive process is looked at again for up to that many seconds: a process that is
    dying closes its sockets a moment before /proc shows it exited.
    """
    deadline = time.monotonic() + wait
    while True:
        try:
            with open("/proc/%d/stat" % pid, "rb") as handle:
                stat = handle.read()
            # "PID (COMM) STATE PPID ...": COMM may hold spaces and parentheses; STATE follows the last ')'.
            state = "zombie" if stat[stat.rindex(b")") + 2:][:1] in (b"Z", b"X") else "alive"
        except (OSError, ValueError):
            state = "gone"
        if state != "alive" or time.monotonic() >= deadline:
            return state
        time.sleep(0.02)


def _not_python(pid: int) -> str:
    """The name of process ``pid`` when it is certainly no Python interpreter, else "" (also when unsure)."""
    try:
        from probe.injector.target import read_target

        info = read_target(pid)
    except Exception:  # unreadable, gone, no injector: say nothing rather than something wrong
        return ""
    if info.is_python:
        return ""
    try:
        with open("/proc/%d/comm" % pid) as handle:
            return handle.read().strip() or os.path.basename(info.exe)
    except OSError:
        return os.path.basename(info.exe) or "?"


def _zombie_note(pid: int) -> str:
    """", and its parent (pid P, NAME) has not reaped it" for a zombie; "" when /proc does not say."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as handle:
            stat = handle.read()
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        with open("/proc/%d/comm" % ppid, "rb") as handle:
            name = handle.read().decode("utf-8", "replace").strip()
    except (OSError, ValueError, IndexError):
        return ", and its parent has not reaped it"
    return ", and its parent (pid %d, %s) has not reaped it" % (ppid, name)


