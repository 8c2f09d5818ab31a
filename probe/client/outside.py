"""Deciding quickly that a local agent cannot answer, and why; the stacks then come from outside.

An agent is Python code: it answers only when its thread gets the GIL. A C call that never lets go of
the GIL (an extension's loop, a CUDA synchronisation that does not return), a stopped process or a
dying one leave it silent, and a plain socket timeout would make the user wait for nothing. So while
the request is in flight, the client looks at what the kernel and the process's memory already tell:

1. After ``GRACE_S`` without an answer (the client waits that long itself, importing nothing of
   this module on the usual path): a stopped process (state T) cannot answer; an agent whose heartbeat
   (the accept thread touches its socket file every 0.25 s) is stale, while some thread holds the
   GIL, is blocked.
2. Otherwise, once the heartbeat is older than ``STALE_TRIGGER_S`` (while it is fresh the agent is
   only slow, and nothing is read), read the stacks from outside (py-spy, without stopping the
   process). If a thread other than the agent's holds the GIL, watch it for ``CONFIRM_S``: a thread
   running Python hands the GIL over when another asks for it (the agent's accept thread does, every
   0.25 s, to beat) and waits to get it back, a voluntary context switch; one held in a C call never
   does. Neither a switch nor a beat: the GIL is held.
3. Otherwise (no holder, or the GIL moves) the agent is only slow: keep waiting, looking again every
   second, up to the timeout.

The request is then abandoned by closing its socket; the agent, when it gets the GIL back, sees that
nobody waits and runs nothing (an eval must not run minutes later).
"""

import os
import select
import socket
import time
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

from probe.reader import proc

if TYPE_CHECKING:  # not imported at run time: this module is on the path of every local request
    from probe.reader.stacks import Stacks, ThreadStack

__all__ = ["Diagnosis", "known_at_once", "await_answer", "GRACE_S", "CONFIRM_S", "STALE_HEARTBEAT_S"]

GRACE_S = 0.3
"""How long an agent may take to answer before the client looks at the process from outside."""
CONFIRM_S = 0.35
"""How long the GIL holder is watched for a hand-over before the GIL is called held: longer than the
agent's heartbeat (0.25 s), so the agent's accept thread asks for the GIL at least once meanwhile."""
STALE_TRIGGER_S = 0.45
"""A heartbeat older than this (one beat missed, with margin) makes the client look from outside."""
STALE_HEARTBEAT_S = 2.0
"""A heartbeat older than this means the agent's accept thread has not run (it beats every 0.25 s)."""


class Diagnosis(NamedTuple):
    """Why the agent does not answer. ``state`` is ``gil_held``, ``stopped`` or ``no_answer`` (and, from
    :func:`diagnose_now` only, ``running``: nothing stops it answering)."""

    state: str
    message: str
    hint: str
    stacks: Any = None  # Optional[Stacks]
    holder: Any = None  # Optional[ThreadStack]
    silent_for: Optional[float] = None  # seconds since the agent last ran, when its heartbeat tells


def _mtime(path: str) -> Optional[float]:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def heartbeat_age(socket_path: str) -> Optional[float]:
    try:
        return max(0.0, time.time() - os.stat(socket_path).st_mtime)
    except OSError:
        return None


_last_problem: Optional[str] = None  # why the last read from outside failed, for the final message


def _read(pid: int) -> "Optional[Stacks]":
    global _last_problem
    from probe.errors import ReaderError
    from probe.reader import live

    if not live.available():
        _last_problem = "no reader installed (pip install py-spy)"
        return None
    try:
        return live.read_live(pid, native=False)
    except ReaderError as exc:
        _last_problem = exc.message + (" -- %s" % exc.hint if exc.hint else "")
        return None


def _program_holder(stacks: "Optional[Stacks]") -> "Optional[ThreadStack]":
    holder = stacks.gil_holder() if stacks else None
    return holder if holder is not None and not holder.is_agent else None


def _importing(holder: "ThreadStack") -> bool:
    """The GIL holder is inside an import (compiling or executing a module): a long step that returns, not a
    call that keeps the GIL for good. Start-up of a large program (torch) spends seconds there."""
    return any(f.frame_type == "python" and "importlib._bootstrap" in f.file for f in holder.frames)


def _gil_held(pid: int, stacks: "Stacks", holder: "ThreadStack", silent_for: Optional[float]) -> Diagnosis:
    since = " for %.1f s" % silent_for if silent_for is not None and silent_for > 1.5 else ""
    if _importing(holder):
        message = ("process %d cannot answer now: thread %s holds the GIL while importing a module, in %s, so the "
                   "agent has not run%s; it runs again once that step of the import returns"
                   % (pid, holder.label().strip(), holder.where(), since))
        hint = "its stacks are read from outside; retry in a moment (`probe %d backtrace`)" % pid
        return Diagnosis("gil_held", message, hint, stacks, holder, silent_for)
    message = ('process %d cannot answer: thread %s holds the GIL in %s and does not let go (a call into C '
               'that keeps it), so the agent has not run%s' % (pid, holder.label().strip(), holder.where(), since))
    hint = ("its stacks are read from outside; eval can run only once that call returns "
            "(`probe %d backtrace --native` shows the C frames)" % pid)
    return Diagnosis("gil_held", message, hint, stacks, holder, silent_for)


def _stopped(pid: int, letter: str, silent_for: Optional[float]) -> Diagnosis:
    stacks = _read(pid)
    how = proc.STATE_WORDS.get(letter, "stopped")
    return Diagnosis("stopped", "process %d is %s: nothing in it runs, its agent included" % (pid, how),
                     "`kill -CONT %d` resumes it; its stacks are read from outside" % pid
                     if letter == "T" else "its stacks are read from outside", stacks, None, silent_for)


def known_at_once(pid: int, socket_path: str) -> Optional[Diagnosis]:
    """What the kernel and the heartbeat tell at once: a stopped process, or an agent silent for seconds
    while the GIL is held."""
    letter = proc.state(pid)
    age = heartbeat_age(socket_path)
    if letter in ("T", "t"):
        return _stopped(pid, letter, age)
    if age is not None and age > STALE_HEARTBEAT_S and letter not in (None, "Z", "X"):
        stacks = _read(pid)
        holder = _program_holder(stacks)
        if stacks is not None and holder is not None:
            return _gil_held(pid, stacks, holder, age)
    return None


def _answered(sock: socket.socket, seconds: float) -> bool:
    """Bytes (or the end) arrived on ``sock`` within ``seconds``."""
    try:
        readable, _, _ = select.select([sock], [], [], max(0.0, seconds))
    except (OSError, ValueError):
        return True  # let the read report what is wrong
    return bool(readable)


def await_answer(sock: socket.socket, pid: int, socket_path: str, timeout: float,
                 patience: Optional[float] = None) -> Optional[Diagnosis]:
    """Wait for the agent's answer on ``sock``, which the caller already gave ``GRACE_S``: None once it
    is there, else why it will not come.

    ``patience`` (seconds) replaces the quick decision: wait that long for the agent, then read from
    outside whatever its state.
    """
    start = time.monotonic()
    deadline = start + timeout - GRACE_S
    if patience is not None:
        if _answered(sock, min(patience, timeout)):
            return None
        now = diagnose_now(pid, socket_path)  # waited as asked: now say why, where that can be told
        if now.state in ("gil_held", "stopped"):
            return now
        return _no_answer(pid, socket_path, min(patience, timeout), "--wait" if patience < timeout else "--timeout")
    early = known_at_once(pid, socket_path)  # stopped, or silent for seconds while the GIL is held
    if early is not None:
        return early
    read_at = 0.0
    while time.monotonic() < deadline:
        letter = proc.state(pid)
        if letter in (None, "Z", "X"):
            return None  # dying or gone: the read says so, and the client explains it
        if letter in ("T", "t"):
            return _stopped(pid, letter, heartbeat_age(socket_path))
        age = heartbeat_age(socket_path)
        # A fresh heartbeat means the agent's accept thread still gets the GIL: the agent is only slow,
        # and nothing is read from outside (no py-spy run per second of a long eval). A stale one (or
        # none to see) is worth a look, at most once a second.
        if (age is None or age > STALE_TRIGGER_S) and time.monotonic() - read_at >= 1.0:
            read_at = time.monotonic()
            stacks = _read(pid)
            holder = _program_holder(stacks)
            if stacks is not None and holder is not None and holder.native_id is not None:
                switches_before = proc.voluntary_switches(pid, holder.native_id)
                beat_before = _mtime(socket_path)
                if _answered(sock, CONFIRM_S):
                    return None
                switches_after = proc.voluntary_switches(pid, holder.native_id)
                # Progress is either signal: the holder handed the GIL over (it waited to get it back),
                # or the agent's accept thread, which asks for the GIL every 0.25 s, got it and beat.
                stuck = (switches_before is not None and switches_before == switches_after
                         and _mtime(socket_path) == beat_before)
                if stuck and _program_holder(_read(pid)) is not None:
                    return _gil_held(pid, stacks, holder, heartbeat_age(socket_path))
        if _answered(sock, min(0.1, max(0.0, deadline - time.monotonic()))):
            return None
    return _no_answer(pid, socket_path, timeout, "--timeout")


def _no_answer(pid: int, socket_path: str, waited: float, option: str) -> Diagnosis:
    """``option``: what limited the wait (``--wait`` or ``--timeout``), to name in the hint."""
    stacks = _read(pid)
    holder = _program_holder(stacks)
    extra = " (thread %s holds the GIL in %s)" % (holder.label().strip(), holder.where()) if holder else ""
    hint = ("its stacks are read from outside; give it longer with %s SECONDS" % option if stacks is not None else
            "give it longer with %s SECONDS; reading it from outside failed: %s" % (option, _last_problem))
    return Diagnosis("no_answer", "the agent in process %d did not answer within %.1f s%s" % (pid, waited, extra),
                     hint, stacks, holder, heartbeat_age(socket_path))


def queue_full(pid: int, socket_path: str, waited: float, option: str) -> Diagnosis:
    """The agent took no connection for ``waited`` seconds: its backlog stayed full, and what it is doing
    was not found to stop it (or was not looked at, with ``--wait``)."""
    stacks = _read(pid)
    holder = _program_holder(stacks)
    age = heartbeat_age(socket_path)
    extra = " (thread %s holds the GIL in %s)" % (holder.label().strip(), holder.where()) if holder else ""
    last = "; it last ran %.0f s ago" % age if age is not None and age >= 1 else ""
    hint = ("its stacks are read from outside; retry later, or give it longer with %s SECONDS" % option
            if stacks is not None else "retry later, or give it longer with %s SECONDS; reading it from outside "
            "failed: %s" % (option, _last_problem))
    return Diagnosis("no_answer", "the agent in process %d accepted no connection within %.1f s: its queue of "
                     "waiting connections is full%s%s" % (pid, waited, extra, last), hint, stacks, holder, age)


def diagnose_now(pid: int, socket_path: str) -> Diagnosis:
    """What stops the agent in ``pid`` from answering, decided now without asking it (a host helper
    runs this for a rank that is slow to answer a client elsewhere): stopped, a GIL held in C (watched
    for ``CONFIRM_S``), or ``running`` when neither. The caller checks first that ``pid`` is alive."""
    letter = proc.state(pid)
    if letter in ("T", "t"):
        return _stopped(pid, letter, heartbeat_age(socket_path))
    stacks = _read(pid)
    holder = _program_holder(stacks)
    if stacks is not None and holder is not None and holder.native_id is not None:
        switches_before = proc.voluntary_switches(pid, holder.native_id)
        beat_before = _mtime(socket_path)
        time.sleep(CONFIRM_S)
        stuck = (switches_before is not None and switches_before == proc.voluntary_switches(pid, holder.native_id)
                 and _mtime(socket_path) == beat_before)
        if stuck and _program_holder(_read(pid)) is not None:
            return _gil_held(pid, stacks, holder, heartbeat_age(socket_path))
    why = "" if stacks is not None else "; reading it from outside failed: %s" % _last_problem
    return Diagnosis("running", "the agent in process %d can run (no thread keeps the GIL)%s" % (pid, why), "",
                     stacks, holder, heartbeat_age(socket_path))
