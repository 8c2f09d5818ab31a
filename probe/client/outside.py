"""Deciding quickly that a local agent cannot answer, and why; the stacks then come from outside.

An agent is Python code: it answers only when its thread gets the GIL. A C call that never lets go of
the GIL (an extension's loop, a CUDA synchronisation that does not return), a stopped process or a
dying one leave it silent, and a plain socket timeout would make the user wait for nothing. So while
the request is in flight, the client looks at what the kernel and the process's memory already tell:

1. After ``GRACE_S`` without an answer (the client waits that long itself, importing nothing of
   this module on the usual path): a stopped process (state T) cannot answer; an agent whose heartbeat
   (the accept thread touches its socket file every 0.25 s) is stale, while some thread holds the
   GIL, is blocked.
2. A holder running probe's own work (a snippet or a read the agent placed on a program thread: a frame
   of probe's agent, tables or engine code on its stack) is never called blocked: the agent is busy
   for a client, and the client waits for the answer, up to the timeout.
3. A backtrace (``quick``: its stacks can come from outside, and nothing fails if they do) is decided
   once the agent's accept thread is seen waiting for the GIL (the kernel counts its waits: a thread
   that waits for the GIL wakes every switch interval and asks the holder to let go), or once the
   heartbeat is older than ``STALE_TRIGGER_S``: read the stacks from outside (without stopping the
   process) and watch the thread that holds the GIL (:func:`_watch`). A thread running Python hands the
   GIL over when asked and waits to get it back, a voluntary context switch; one held in a C call
   never does. The GIL is called held when the holder made no such switch and the agent did not run,
   either while the agent asked ``AGENT_WAITS`` times in a row and the holder was not kept off the CPU
   meanwhile (it had every chance to let go), the holder seen keeping the GIL for ``HELD_MIN_S`` in
   all, or for ``CONFIRM_S``.
4. Any other request (a query, eval, health: it fails where the agent is called blocked) is given up
   on no sooner than before that quick rule: once ``PATIENT_GRACE_S`` passed, the heartbeat is older
   than ``STALE_TRIGGER_S`` and the holder, watched ``CONFIRM_S``, made no voluntary switch while the
   agent did not beat. A C call that keeps the GIL a few tenths of a second and returns (a collection
   of a big heap on a loaded machine) is waited for, and the agent answers.
5. Otherwise (no holder, or the GIL moves) the agent is only slow: keep waiting, looking again at most
   once a second, up to the timeout.

The request is then abandoned by closing its socket; the agent, when it gets the GIL back, sees that
nobody waits and runs nothing (an eval must not run minutes later).
"""

import os
import select
import socket
import time
from typing import TYPE_CHECKING, Any, Dict, List, NamedTuple, Optional, Tuple

from probe._private_file import replace_private
from probe.reader import proc

if TYPE_CHECKING:  # not imported at run time: this module is on the path of every local request
    from probe.reader.stacks import Stacks, ThreadStack

__all__ = ["Diagnosis", "known_at_once", "await_answer", "GRACE_S", "CONFIRM_S", "STALE_HEARTBEAT_S"]

GRACE_S = 0.05
"""How long an agent may take to answer before the client looks at the process (the kernel's counters
first, which cost nothing; the stacks only once the agent is seen waiting for the GIL)."""
CONFIRM_S = 0.35
"""How long the GIL holder is watched for a hand-over before the GIL is called held, where the quicker
rule cannot tell: longer than the agent's heartbeat (0.25 s), so the agent's accept thread asks for the
GIL at least once meanwhile."""
AGENT_WAITS = 6
"""The agent's accept thread waited for the GIL this many times (each wait lasts the switch interval and
ends with a request that the holder let go) while the holder made no voluntary switch: with
``QUICK_MIN_S`` and ``QUEUED_SHARE``, enough to call the GIL held before ``CONFIRM_S``."""
QUICK_MIN_S = 0.02
"""The shortest watch of the holder after the stacks were read (the watch began before the read, which
takes some 20 ms more)."""
HELD_MIN_S = 0.2
"""How long the holder must be seen keeping the GIL (no voluntary switch since the client's first look at
the kernel's counters) before it is called held: a C call that keeps the GIL for a moment and returns
(a big regex, pickling) is waited for, not reported."""
LOADED_CONFIRM_S = 1.0
"""How long the watch of a request other than a backtrace may last where the holder waited for a CPU more
than ``QUEUED_SHARE`` of it (a machine so loaded that a C call that returns may not get to return)."""
QUEUED_SHARE = 0.4
"""The holder may have waited for a CPU at most this share of the watch (a thread kept off the CPU cannot
let go of the GIL; on a loaded machine the watch then lasts ``CONFIRM_S``)."""
TRIGGER_WAITS = 3
"""The accept thread's waits within one look (``TICK_S``) that mean it is waiting for the GIL now (where
the GIL moves it may still wait that often now and then: that costs one read from outside a second)."""
TICK_S = 0.025
"""How often the kernel's counters are looked at while the client waits for an answer."""
PATIENT_GRACE_S = 0.3
"""How long a request other than a backtrace waits for the agent before the client looks from outside."""
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


def _read(pid: int, stop: bool = True) -> "Optional[Stacks]":
    """The stacks read from outside; ``stop=False`` for a read inside :func:`_watch`, which counts the
    holder's voluntary context switches around it (stopping the process for the read counts as one)."""
    global _last_problem
    from probe.errors import ReaderError
    from probe.reader import live

    if not live.available():
        _last_problem = "no reader installed (pip install py-spy)"
        return None
    try:
        return live.read_live(pid, native=False, stop=stop)
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


def _runs_agent_code(holder: "ThreadStack") -> bool:
    """The GIL holder is a program thread running the agent's own work (a snippet or a read placed on
    the main thread or after a step, a hook of probe's): the agent is busy for a client, not kept from
    running by the program. Such a holder is never called blocked, however long it keeps the GIL (a read
    of a big heap on a loaded machine, a snippet's long C call): its client gets the answer, or its
    timeout."""
    return any(f.frame_type == "python" and any(part in f.file for part in _AGENT_PARTS) for f in holder.frames)


_AGENT_PARTS = tuple(os.sep.join(("", "probe", name, "")) for name in ("agent", "engine", "tables"))


def _gil_held(pid: int, stacks: "Stacks", holder: "ThreadStack", silent_for: Optional[float],
              watched: bool = True) -> Diagnosis:
    """``watched``: the holder was watched and made no voluntary switch (else the heartbeat's age told)."""
    since = " for %.1f s" % silent_for if silent_for is not None and silent_for > 1.5 else ""
    if _importing(holder):
        message = ("process %d cannot answer now: thread %s holds the GIL while importing a module, in %s, so the "
                   "agent has not run%s; it runs again once that step of the import returns"
                   % (pid, holder.label().strip(), holder.where(), since))
        hint = "its stacks are read from outside; retry in a moment (`probe %d backtrace`)" % pid
        return Diagnosis("gil_held", message, hint, stacks, holder, silent_for)
    # What was seen, not what will be: a call that kept the GIL through the watch may return a moment later
    message = ('process %d cannot answer: thread %s holds the GIL in %s%s (a call into C that keeps it), so the '
               'agent has not run%s' % (pid, holder.label().strip(), holder.where(),
                                        " and did not let go while watched" if watched else "", since))
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
        if stacks is not None and holder is not None and not _runs_agent_code(holder):
            return _gil_held(pid, stacks, holder, age, watched=False)
    return None


def _answered(sock: socket.socket, seconds: float) -> bool:
    """Bytes (or the end) arrived on ``sock`` within ``seconds``."""
    try:
        readable, _, _ = select.select([sock], [], [], max(0.0, seconds))
    except (OSError, ValueError):
        return True  # let the read report what is wrong
    return bool(readable)


def await_answer(sock: socket.socket, pid: int, socket_path: str, timeout: float,
                 patience: Optional[float] = None, quick: bool = False) -> Optional[Diagnosis]:
    """Wait for the agent's answer on ``sock``, which the caller already gave ``GRACE_S``: None once it
    is there, else why it will not come.

    ``quick``: the request is a backtrace, whose stacks can as well come from outside: decided by the
    quick rule (the module's docstring, step 3); otherwise the agent is given up on only as step 4 says.
    ``patience`` (seconds) replaces either: wait that long for the agent, then read from outside
    whatever its state.
    """
    start = time.monotonic()
    deadline = start + timeout - GRACE_S
    if patience is not None:
        if _answered(sock, min(patience, timeout)):
            return None
        now = diagnose_now(pid, socket_path, quick)  # waited as asked: now say why, where that can be told
        if now.state in ("gil_held", "stopped"):
            return now
        return _no_answer(pid, socket_path, min(patience, timeout), "--wait" if patience < timeout else "--timeout")
    early = known_at_once(pid, socket_path)  # stopped, or silent for seconds while the GIL is held
    if early is not None:
        return early
    if not quick:
        return _await_patiently(sock, pid, socket_path, start, deadline, timeout)
    agents = _accept_threads(pid)
    waits = proc.switch_counts(pid, agents)
    baseline, since = proc.switch_counts(pid), time.monotonic()  # every thread's, for how long the holder held
    read_at = -1.0
    while time.monotonic() < deadline:
        ended, stopped = _not_running(pid, socket_path)
        if ended:
            return stopped
        age = heartbeat_age(socket_path)
        seen, waits = waits, proc.switch_counts(pid, agents)
        asking = any(count - seen[tid] >= TRIGGER_WAITS for tid, count in waits.items() if tid in seen)
        # An accept thread seen waiting for the GIL, or a stale heartbeat (or none to see), is worth a
        # look, at most once a second. Otherwise the agent's threads get the GIL: the agent is only slow,
        # and nothing is read from outside (no py-spy run per second of a long eval).
        if (asking or age is None or age > STALE_TRIGGER_S) and (read_at < 0 or time.monotonic() - read_at >= 1.0):
            read_at = time.monotonic()
            verdict, stacks, holder = _watch(pid, socket_path, sock, agents, baseline, since, quick=True)
            if verdict == "answered":
                return None
            if verdict == "held" and stacks is not None and holder is not None:
                return _gil_held(pid, stacks, holder, heartbeat_age(socket_path))
            waits = proc.switch_counts(pid, agents)
            baseline, since = proc.switch_counts(pid), time.monotonic()
        if _answered(sock, min(TICK_S, max(0.0, deadline - time.monotonic()))):
            return None
    return _no_answer(pid, socket_path, timeout, "--timeout")


def _await_patiently(sock: socket.socket, pid: int, socket_path: str, start: float, deadline: float,
                     timeout: float) -> Optional[Diagnosis]:
    """The wait of a request that fails where the agent is called blocked (the module's docstring, step
    4): the evidence asked for is that of the rule the quick one replaced, never less."""
    read_at = -1.0
    while time.monotonic() < deadline:
        ended, stopped = _not_running(pid, socket_path)
        if ended:
            return stopped
        age = heartbeat_age(socket_path)
        # A fresh heartbeat means the agent's accept thread still gets the GIL: the agent is only slow,
        # and nothing is read from outside. A stale one (or none to see) is worth a look, at most once a
        # second, once the agent had PATIENT_GRACE_S in all (the client gave it GRACE_S before this).
        waited = time.monotonic() - start + GRACE_S
        if ((age is None or age > STALE_TRIGGER_S) and waited >= PATIENT_GRACE_S
                and (read_at < 0 or time.monotonic() - read_at >= 1.0)):
            read_at = time.monotonic()
            verdict, stacks, holder = _watch(pid, socket_path, sock)
            if verdict == "answered":
                return None
            if verdict == "held" and stacks is not None and holder is not None:
                return _gil_held(pid, stacks, holder, heartbeat_age(socket_path))
        if _answered(sock, min(TICK_S, max(0.0, deadline - time.monotonic()))):
            return None
    return _no_answer(pid, socket_path, timeout, "--timeout")


def _not_running(pid: int, socket_path: str) -> Tuple[bool, Optional[Diagnosis]]:
    """Whether the wait ends because nothing runs in the process: (True, None) where it is dying or gone
    (the read says so, and the client explains it), (True, stopped) where it is stopped; else (False, None)."""
    letter = proc.state(pid)
    if letter in (None, "Z", "X"):
        return True, None
    if letter in ("T", "t"):
        return True, _stopped(pid, letter, heartbeat_age(socket_path))
    return False, None


def _accept_threads(pid: int) -> List[int]:
    """The agent's accept threads (their OS name is ``probe-accept``): each asks for the GIL every 0.25 s."""
    return sorted(tid for tid, name in proc.thread_names(pid).items() if name == "probe-accept")


def _watch(pid: int, socket_path: str, sock: Optional[socket.socket] = None, agents: Optional[List[int]] = None,
           before: Optional[Dict[int, int]] = None, since: Optional[float] = None,
           quick: bool = False) -> "Tuple[str, Optional[Stacks], Optional[ThreadStack]]":
    """Read the stacks from outside and watch the thread that holds the GIL (the rules: the module's
    docstring, steps 2 to 4; ``quick`` for a backtrace). Returns ``held``, ``moving`` (the GIL was handed
    over, the agent ran, no program thread holds it, or the holder runs probe's own work) or ``answered``
    (the answer came on ``sock`` meanwhile), with the stacks and the holder read. ``before``: every
    thread's voluntary switches, counted at ``since``."""
    agents = _accept_threads(pid) if agents is None else agents
    if before is None or since is None:  # every thread's, before the read: the holder is not known yet
        before, since = proc.switch_counts(pid), time.monotonic()
    # The holder must be seen keeping the GIL for HELD_MIN_S. The heartbeat's age proves nothing of the
    # kind: under a C call that keeps the GIL 0.12 s at a time it grew past 0.6 s while the agent's
    # other threads took the GIL between the calls.
    beat = _mtime(socket_path)
    stacks = _read(pid, stop=False)
    holder = _program_holder(stacks)
    if stacks is None or holder is None or holder.native_id not in before:
        return "moving", stacks, holder
    if _runs_agent_code(holder):
        return "moving", stacks, holder  # probe's own work on a program thread: busy for a client, never blocked
    tid = holder.native_id
    if _seen_held_before(pid, socket_path, tid, before[tid], beat) and (
            quick or (heartbeat_age(socket_path) or 0.0) >= STALE_TRIGGER_S + CONFIRM_S):
        return "held", _frozen(stacks), holder  # kept since an earlier look saw it (without quick: for as long as below)
    start = time.monotonic()
    queued_at_start = proc.queued_ns(pid, tid)
    while True:
        if sock is not None:
            if _answered(sock, 0.005):
                return "answered", stacks, holder
        else:
            time.sleep(0.005)
        elapsed = time.monotonic() - start
        now = proc.switch_counts(pid, [tid] + agents)
        if now.get(tid) != before[tid] or _mtime(socket_path) != beat:
            return "moving", stacks, holder  # the holder waited (it let go of the GIL), or the agent ran
        queued = proc.queued_ns(pid, tid)
        kept_off_cpu = (queued is None or queued_at_start is None
                        or queued - queued_at_start > QUEUED_SHARE * elapsed * 1e9)
        if quick:
            asked = max([now[a] - before[a] for a in agents if a in now and a in before] or [0])
            if (elapsed >= QUICK_MIN_S and time.monotonic() - since >= HELD_MIN_S and asked >= AGENT_WAITS
                    and not kept_off_cpu):
                _remember_held(pid, socket_path, tid, before[tid], beat)
                return "held", _frozen(stacks), holder
        elif kept_off_cpu and queued is not None and elapsed < LOADED_CONFIRM_S:
            continue  # a holder waiting for a CPU cannot let go: on a loaded machine, watch it longer
        if elapsed >= CONFIRM_S:  # no quick answer (not a backtrace, no accept thread seen, a loaded CPU)
            again = _program_holder(_read(pid, stop=False))
            if again is None or _runs_agent_code(again):
                return "moving", stacks, holder
            _remember_held(pid, socket_path, tid, before[tid], beat)
            return "held", _frozen(stacks), holder


def _frozen(stacks: "Optional[Stacks]") -> "Optional[Stacks]":
    """Stacks read without stopping the process, of a holder then seen keeping the GIL since before the
    read (no voluntary switch while the agent asked for it): no Python code ran during the read, so no
    stack in it is torn. Said so in their source."""
    if stacks is None or not stacks.may_be_torn:
        return stacks
    from probe.reader.stacks import TORN_WORDS

    source = stacks.source.replace("(%s)" % TORN_WORDS, "(the GIL stayed held in C meanwhile: no Python frame moved)")
    return stacks._replace(source=source, facts=dict(stacks.facts, consistent=True))


def _held_record(socket_path: str) -> Optional[str]:
    """``PID.sock.held`` beside an agent's socket in our runtime directory (ours alone); None for a socket
    elsewhere (a ``unix:PATH`` target), where nothing is kept."""
    from probe import _paths

    if os.path.dirname(socket_path) != _paths.runtime_dir():
        return None
    return socket_path + ".held"


def _remember_held(pid: int, socket_path: str, tid: int, switches: int, beat: Optional[float]) -> None:
    """Keep, beside the agent's socket, what this look saw of a holder that keeps the GIL: the next look
    (another command) that finds the same thread with the same count of voluntary switches, and the
    heartbeat unmoved, knows at once that it has kept the GIL since, and needs no watch of its own."""
    path = _held_record(socket_path)
    ticks = _start_ticks(pid)
    if path is None or ticks is None or beat is None:
        return
    if not replace_private(path, ("%d %d %d %d %r\n" % (pid, ticks, tid, switches, beat)).encode()):
        return
    _forget_gone(os.path.dirname(path))


def _forget_gone(directory: str) -> None:
    """Remove the records of processes that are gone."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        stem = name[:-len(".sock.held")] if name.endswith(".sock.held") else ""
        if stem.isdigit() and not os.path.exists("/proc/%s" % stem):
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass


def _seen_held_before(pid: int, socket_path: str, tid: int, switches: int, beat: Optional[float]) -> bool:
    """An earlier look saw ``tid`` keep the GIL (see :func:`_remember_held`), and since then it has made no
    voluntary switch and the agent has not beaten: it still keeps it. A record that no longer holds is
    removed."""
    path = _held_record(socket_path)
    if path is None:
        return False
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW)) as handle:
            fields = handle.read(256).split()
    except OSError:
        return False
    try:
        same = (len(fields) == 5 and int(fields[0]) == pid and int(fields[1]) == _start_ticks(pid)
                and int(fields[2]) == tid and int(fields[3]) == switches and beat is not None
                and float(fields[4]) == beat)
    except ValueError:
        same = False
    if not same:
        try:
            os.unlink(path)
        except OSError:
            pass
    return same


def _start_ticks(pid: int) -> Optional[int]:
    try:
        with open("/proc/%d/stat" % pid, "rb") as handle:
            stat = handle.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _no_answer(pid: int, socket_path: str, waited: float, option: str) -> Diagnosis:
    """``option``: what limited the wait (``--wait`` or ``--timeout``), to name in the hint."""
    stacks = _read(pid)
    holder = _program_holder(stacks)
    extra = " (thread %s holds the GIL in %s%s)" % (
        holder.label().strip(), holder.where(),
        ", running work that probe placed on it: a snippet or a read" if _runs_agent_code(holder) else ""
    ) if holder else ""
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


def diagnose_now(pid: int, socket_path: str, quick: bool = False) -> Diagnosis:
    """What stops the agent in ``pid`` from answering, decided now without asking it (a host helper
    runs this for a rank that is slow to answer a client elsewhere): stopped, a GIL held in C (the holder
    watched by :func:`_watch`; ``quick`` for a backtrace), or ``running`` when neither. The caller checks
    first that ``pid`` is alive."""
    letter = proc.state(pid)
    if letter in ("T", "t"):
        return _stopped(pid, letter, heartbeat_age(socket_path))
    verdict, stacks, holder = _watch(pid, socket_path, quick=quick)
    if verdict == "held" and stacks is not None and holder is not None:
        return _gil_held(pid, stacks, holder, heartbeat_age(socket_path))
    why = "" if stacks is not None else "; reading it from outside failed: %s" % _last_problem
    return Diagnosis("running", "the agent in process %d can run (no thread keeps the GIL)%s" % (pid, why), "",
                     stacks, holder, heartbeat_age(socket_path))
