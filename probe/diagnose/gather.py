"""One look at every rank: its evidence gathered through the Source interface, each family's part by that
family's module (the step counter by :mod:`probe.diagnose.progress`, training and its samples by
:mod:`probe.diagnose.training`, memory by :mod:`probe.diagnose.memory`), into a
:class:`probe.diagnose.evidence.RankEvidence`.

For each rank (or the one process), within the fan-out's deadline:

* its stacks, from its agent; where the agent cannot answer, read from outside (a C call holding the
  GIL, a stopped process), or a dead one's last stacks from its crash record, with the state that says
  why (``gil_held``, ``stopped``, ``dead``, ``no_answer``, ``unreachable``);
* only from an agent that answered: its threads' CPU time (``python.threads``), the Flight Recorder's
  last collective of each process group and the trace's steps (one query over ``torch.flight_recorder``
  and ``python.torch_trace``); for a rank that cannot answer, its recorder from the copy its agent kept
  while it ran (:mod:`probe.diagnose.fr_copy`), marked as a copy, with its age.

Only reads: no eval, no collective, no device synchronisation (the tables promise as much). What could
not be had is kept with why (``*_why``), never filled in.
"""

import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from probe.diagnose.evidence import (FR_SQL, STATES, THREADS_SQL, TRACE_SQL, RankEvidence, Sample, agent_frames,
                                    keep_named)
from probe.errors import AgentBlocked, ConnectError, ProbeError, ProcessDead, Timeout, TorchNotLoaded

__all__ = ["collect", "forget", "sample_job", "sample_one"]
# What probe.diagnose.gathered reads from the module it is handed (this one: it cannot import it back).
__gathered__ = (STATES, RankEvidence, keep_named)

MAX_TABLE_ROWS = 2000  # rows of python.paths and python.locks read (their rows, without SQL: no engine involved)


def _may_wait_for_a_lock(ev: "RankEvidence") -> bool:
    from probe.diagnose import lockwaits

    return any(lockwaits.lock_line(key[0][3]) for key in ev.stacks().values() if key)


def _exited(pid: Optional[int]) -> bool:
    """A process that exited and was not reaped yet (a zombie): dead, surely. One that is gone may never
    have been (a mistyped pid): that is said as the error, not as a death."""
    if pid is None:
        return False
    try:
        with open("/proc/%d/stat" % pid, "rb") as handle:
            stat = handle.read()
        return stat[stat.rindex(b")") + 2:][:1] in (b"Z", b"X")
    except (OSError, ValueError):
        return False


def _died_without_a_word(ev: RankEvidence, pid: int) -> bool:
    """A process that is gone and whose agent's crash record holds its header alone: it existed, and died
    with no handler run (SIGKILL, the OOM killer, os._exit; a clean exit removes the record). ``ev.why``
    then says so, as for a rank that died with its stacks."""
    from probe.reader import crash

    record = crash.dead_record(pid)
    if record is None:
        return False
    ev.why = "process %d is dead: %s -- its exit status, or the kernel log (OOM killer), may say more" % (
        pid, record.cause)
    return True


def _from_failure(ev: RankEvidence, client: Any, exc: ProbeError) -> None:
    """What the error says of a rank that did not answer: its state, why, and the stacks that came with it."""
    from probe.client import fallback

    ev.why = exc.message + (" -- %s" % exc.hint if exc.hint else "")
    ev.error = exc
    diagnosis = getattr(exc, "diagnosis", None)
    stacks = fallback.outside_stacks(exc, agentless=True)
    local_pid = client.target.pid if client.target.is_local else None
    if isinstance(exc, ProcessDead) or getattr(exc, "record", None) is not None or (
            diagnosis is not None and diagnosis.state == "dead"):
        ev.state = "dead"
    elif diagnosis is not None and diagnosis.state in ("gil_held", "stopped", "no_answer"):
        ev.state = diagnosis.state
    elif getattr(exc, "agentless_pid", None) is not None:
        ev.state = "no_agent"
    elif isinstance(exc, (Timeout, AgentBlocked)):
        ev.state = "no_answer"
    elif isinstance(exc, ConnectError) and local_pid is not None and (_exited(local_pid) or
                                                                        _died_without_a_word(ev, local_pid)):
        ev.state = "dead"
    else:
        ev.state = "unreachable"
    if stacks is not None:
        ev.frames = fallback.frames_of(stacks)
        ev.source = str(getattr(stacks, "source", "read from outside"))
        from probe.diagnose import library

        facts = getattr(stacks, "facts", None) or {}
        roots = library.from_process(local_pid if ev.state != "dead" else None, facts.get("executable"))
        if roots:  # with this probe's own package: the target's agent is most often this very install
            ev.paths = [["stdlib", root] for root in roots] + [["probe", os.path.dirname(os.path.dirname(
                os.path.abspath(__file__)))]]
        if ev.state == "gil_held":
            holder = diagnosis.holder if diagnosis is not None and diagnosis.holder is not None else None
            if holder is None:
                try:
                    holder = stacks.gil_holder()
                except Exception:  # a reader's stacks without GIL facts: said as unknown
                    holder = None
            if holder is not None:
                ev.holder = "thread %s in %s" % (holder.label().strip(), holder.where())
                ident = holder.thread_id if holder.thread_id is not None else holder.native_id
                ev.holder_id = ident if isinstance(ident, int) else None
    else:
        ev.source = "none"


def _query(client: Any, sql: str) -> List[Dict[str, Any]]:
    rows = client.query_rows(sql, timeout=5.0)
    if client.note:  # answered from stacks read from outside: the agent stopped answering meanwhile
        raise ProbeError("the agent stopped answering: %s" % client.note.splitlines()[0])
    names = [c[0] for c in rows.columns]
    return [dict(zip(names, row)) for row in rows.rows]


_LAYOUTS: Dict[Tuple[str, int], List[List[str]]] = {}
MAX_LAYOUTS = 4096


def _layout(client: Any, host: str, pid: Optional[int]) -> Optional[List[List[str]]]:
    """The interpreter's layout (``python.paths``), read once per process: it does not change while it runs."""
    if pid is not None and (host, pid) in _LAYOUTS:
        return _LAYOUTS[(host, pid)]
    try:
        paths = [[str(r["kind"]), str(r["path"])] for r in _table(client, "python.paths")]
    except ProbeError:  # an older agent: the layout is guessed (probe.diagnose.library)
        return None
    if pid is not None:
        if len(_LAYOUTS) >= MAX_LAYOUTS:
            _LAYOUTS.clear()
        _LAYOUTS[(host, pid)] = paths
    return paths


def _table(client: Any, name: str) -> List[Dict[str, Any]]:
    """A table's rows as the agent makes them (``/v1/rows``: no SQL engine on either side): the
    interpreter's layout (``python.paths``, which frames are a library's), the locks by identity
    (``python.locks``, asked only where some thread's innermost line is a ``with`` or an ``acquire(``)."""
    rows = client.table_rows(name, max_rows=MAX_TABLE_ROWS)
    if client.note:
        raise ProbeError("the agent stopped answering: %s" % client.note.splitlines()[0])
    names = [c[0] for c in rows.columns]
    return [dict(zip(names, row)) for row in rows.rows]


def collect(client: Any, rank: int, host: str, pid: Optional[int] = None, listed_state: Optional[str] = None,
            ahead: bool = False, taken: Optional[List[Any]] = None) -> RankEvidence:
    """One rank's evidence; never raises (what failed is kept, with why). ``ahead``: the straggler's samples
    first, then the look (``probe.diagnose.straggler.ahead``); ``taken``: those samples, taken already
    (``probe.host.prefetch``)."""
    from probe.diagnose import straggler

    start = time.monotonic()
    if taken is None and ahead and client.target.core is None:
        taken = straggler.sample_main(client)
    ev = RankEvidence(rank, host, pid)
    try:
        if client.target.core is not None:
            ev.frames = client.backtrace()
            ev.state, ev.source, ev.why = "dead", str(client.note or "a core file"), "a core file"
        else:
            ev.frames = agent_frames(client)
    except ProbeError as exc:
        _from_failure(ev, client, exc)
    except Exception as exc:  # a reader's or parser's surprise: this rank's evidence is said to be missing
        ev.state, ev.why, ev.source = "unreachable", "%s: %s" % (type(exc).__name__, exc), "none"
    if ev.state == "unreachable" and listed_state == "dead":
        ev.state = "dead"
    if ev.state == "answering":
        ev.paths = _layout(client, host, pid)
        if _may_wait_for_a_lock(ev):
            try:
                ev.locks = _table(client, "python.locks")
            except ProbeError:  # an older agent: holders are found by the expressions' text
                ev.locks = None
        try:
            ev.threads = _query(client, THREADS_SQL)
        except ProbeError as exc:
            ev.threads_why = exc.message
        try:
            ev.fr = _query(client, FR_SQL)
            if not ev.fr:
                ev.fr_why = "it holds no collective (off unless the job starts with TORCH_FR_BUFFER_SIZE=N)"
                from probe.diagnose import fr_copy

                fr_copy.numbers(ev, client)  # its groups' numbers, kept without the recorder: a silent rank's peer
        except TorchNotLoaded:
            ev.fr_why = "torch is not loaded"
        except ProbeError as exc:
            ev.fr_why = exc.message
        if ev.fr_why != "torch is not loaded":
            try:
                rows = _query(client, TRACE_SQL)
                ev.trace = rows[0] if rows and rows[0].get("step") is not None else None
                if ev.trace is None:
                    ev.trace_why = "it holds no step (`trace start` turns it on)"
            except ProbeError as exc:
                ev.trace_why = exc.message
        else:
            ev.trace_why = ev.fr_why
        from probe.diagnose import progress

        progress.collect_steps(ev, _query, client)
    else:
        why = "its agent cannot answer (%s)" % ev.state.replace("_", " ")
        ev.threads_why = ev.fr_why = ev.trace_why = ev.steps_why = why
        if client.target.core is None:
            from probe.diagnose import fr_copy

            fr_copy.attach(ev, client, why)  # the recorder from the copy its agent kept while it ran
    from probe.diagnose import memory, training

    if ev.state == "answering":
        training.gather(client, ev, _query, taken)
    memory.gather(client, ev, _query)
    ev.seconds = time.monotonic() - start
    return ev


def forget(host: str, pid: Optional[int], rank: int) -> None:
    """Drop what the looks of this process kept of one rank (RSS readings, the memory split, the
    parameters read after a NaN): a long-lived reader (the node helper's watch, which records again at the
    next stall) starts each recording afresh, and keeps nothing of ranks long gone."""
    from probe.diagnose import memory, training

    memory.forget((host, pid, rank))
    training.forget((host, pid))
    from probe.diagnose import numerics

    numerics.forget((host, pid))
    if pid is not None:
        _LAYOUTS.pop((host, pid), None)


def sample_job(cluster: Any, deadline: float, only: Optional[Sequence[int]] = None,
               previous: Optional[Sample] = None) -> Sample:
    """Every rank's evidence through the fan-out, within ``deadline`` seconds. ``only``: the ranks to ask
    again (the others keep their evidence from ``previous``: a rank that cannot answer is not read from
    outside a second time)."""
    from probe.diagnose import gathered, straggler

    start = time.monotonic()
    history = _history_of(cluster) if previous is None else None
    chosen = cluster if only is None else cluster.select(only)
    early = set() if previous is None else {r for r, ev in previous.ranks.items() if straggler.ahead(ev)}
    chosen.via = getattr(cluster, "via", "auto")
    saved = chosen.deadline
    chosen.deadline = deadline
    ranks: Dict[int, RankEvidence] = {} if previous is None else dict(previous.ranks)
    compared: Dict[int, Any] = {}  # rank -> (its evidence, its progress since ``previous``), made as it came
    try:
        if chosen.members and gathered.through_helpers(chosen):  # one request a node (probe.diagnose.gathered)
            got, failures = gathered.sample(chosen, None if previous is None else start - previous.at + 1.0,
                                            sys.modules[__name__], early, _compared(previous, compared))
            ranks.update(got)
        else:
            by_client = {id(c): m for m, c in zip(chosen.members, chosen.clients)}
            answers = chosen.map(lambda c: _collect_member(c, by_client[id(c)], early)) if chosen.members else []
            for answer in answers:
                ranks[answer.member.rank] = answer.value
            failures = chosen.failures
    finally:
        chosen.deadline = saved
    by_rank = {m.rank: m for m in chosen.members} if failures else {}
    for failure in failures:
        member = by_rank.get(failure.rank)
        ranks[failure.rank] = RankEvidence(failure.rank, failure.host, member.pid if member else None,
                                           state="dead" if member is not None and member.state == "dead"
                                           else "no_answer", why=failure.reason, source="none",
                                           threads_why="no answer", fr_why="no answer", trace_why="no answer")
    out = Sample(ranks, len(cluster.members), False, start, time.monotonic() - start,
                 history=history if history is not None else previous.history if previous is not None else None)
    if previous is not None:
        out.__dict__["_compared"] = (previous, compared)  # probe.diagnose.rules reads it (progress_before)
    return out


def _compared(previous: Optional[Sample], into: Dict[int, Any]) -> Any:
    """What to do with each helper's evidence as it comes, where there is a look before to compare it with:
    each rank's progress since then (``progress.progress_of``) and its lock waits (kept on its evidence),
    made while the other helpers are still waited for, not after the look (at 16k ranks, 0.4 s)."""
    if previous is None:
        return None
    from probe.diagnose import progress
    from probe.diagnose.lockwaits import lock_waits

    def arrived(evs: List[RankEvidence]) -> None:
        for ev in evs:
            before = previous.ranks.get(ev.rank)
            if before is None:
                continue
            try:
                into[ev.rank] = (ev, progress.progress_of(before, ev))
                lock_waits(before, ev)
            except Exception:  # noqa: BLE001 -- made again, and its error seen, by the rules after the look
                into.pop(ev.rank, None)

    return arrived


def _history_of(cluster: Any) -> Any:
    """Each thread's current run from the node helpers (``cluster.stack_history``), of the ranks a stuck
    verdict names (``probe.diagnose.rules``), asked of their helpers alone once the looks are done: asked of
    every helper (at 16k ranks a request each to 2,048 helpers, a third of a diagnosis's requests), it was
    read for at most a few ranks, and for none on a healthy job. Call the result with the ranks: their rows,
    or None (never raises)."""
    from probe.client.stack_history import current_or_none

    def rows(ranks: Sequence[int]) -> Any:
        known = {m.rank for m in getattr(cluster, "members", ())}
        wanted = [r for r in ranks if r in known]
        if not wanted:
            return None
        try:
            return current_or_none(cluster.select(wanted))  # never raises
        except Exception:  # noqa: BLE001 -- no history: the verdicts say no "since"
            return None

    return rows


def _collect_member(client: Any, member: Any, early: Any = ()) -> RankEvidence:
    return collect(client, member.rank, member.host, member.pid, member.state, member.rank in early)


def sample_one(client: Any, deadline: float, previous: Optional[Sample] = None) -> Sample:
    """The one process's evidence (rank 0 of a job of one), within about ``deadline`` seconds (``previous``:
    the look before, whose stepping has this one take its straggler samples ahead)."""
    from probe.client.fanout import fan_out
    from probe.diagnose import straggler

    start = time.monotonic()
    pid = client.target.pid
    label = "process %d" % pid if pid is not None else client.target.label
    early = previous is not None and straggler.ahead(previous.ranks.get(0))
    outcome = fan_out([client], lambda c: collect(c, 0, label, pid, None, early), 1, deadline)[0]
    if outcome.error is not None:
        ev = RankEvidence(0, label, pid, state="no_answer", why=outcome.error.message, source="none",
                          threads_why="no answer", fr_why="no answer", trace_why="no answer")
    else:
        ev = outcome.value
    if ev.state == "unreachable" and ev.frames is None and ev.error is not None:
        raise ev.error  # no agent, not a Python process, refused: probe's own error, not a diagnosis
    return Sample({0: ev}, 1, True, start, time.monotonic() - start)
