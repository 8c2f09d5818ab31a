"""The judge of ``probe diagnose``: which families of rules run over the evidence of two samples a moment
apart, in what order, and how their verdicts are put together.

Each rule names the ranks it blames (culprits) apart from those that only wait for them (victims), the
place (function, file:line, thread), and the evidence it rests on; no rule speaks without evidence. The
rules live in their family's module, each with the evidence it reads; this module imports them, never the
reverse (what they share is :mod:`probe.diagnose.verdict`). In order of weight:

1. a dead rank (how it ended; its last stacks where its crash record kept them);
2. a rank that cannot answer: a C call holds its GIL (where), or it is stopped; one that gave no answer
   (:mod:`probe.diagnose.silent`);
3. a collective hang or a mismatched collective (:mod:`probe.diagnose.collectives`): from the Flight
   Recorder, the ranks whose last collective of a group is before the one the others issued and still wait
   in; without it, from the stacks, the ranks outside the collective the others stayed in;
4. a stall: no step for long on every rank, by the trace or the step counter; a rank whose counter stopped
   while others advance (:mod:`probe.diagnose.progress`);
5. a lock wait: a thread that stayed at ``with X:`` / ``X.acquire(`` over the window, gaining no CPU, its
   holder by the lock's identity (:mod:`probe.diagnose.lockwaits`);
6. a straggler: a rank whose own compute per step is well above the others', or whose main thread is
   mostly outside the collectives the others wait in (:mod:`probe.diagnose.straggler`); not the ranks that
   wait for it;
7. a data loader stall, NaN/Inf (:mod:`probe.diagnose.training`, :mod:`probe.diagnose.numerics`), memory
   growth (:mod:`probe.diagnose.memory`);
8. otherwise healthy: steps advancing (trace, Flight Recorder, the step counter), or, without any, the main
   threads running and "no optimizer step counted ...: progress unknown".
"""

from typing import Any, Callable, Dict, List, Sequence

from probe.diagnose import collectives, memory, progress as steps, silent as cannot, straggler as sampled, training
from probe.diagnose.evidence import Sample
from probe.diagnose.lockwaits import lock_verdict, lock_waits
from probe.diagnose.unknown import unavailable as _unavailable, with_how
from probe.diagnose.verdict import HANG_FLOOR_S, STATUSES, Commands, Evidence, Report, Verdict, ranks_word

__all__ = ["judge", "needs_longer_look"]


def needs_longer_look(first: Sample, last: Sample) -> bool:
    """Whether some rank that answers showed no sign of life between the samples: then look longer before
    calling anything stuck."""
    progress = _progress(first, last)
    last.__dict__["_progress_of"] = (first, progress)  # the judge's of these two looks, if they settle it
    for rank, b in last.ranks.items():
        a = first.ranks.get(rank)
        if a is None or b.state != "answering":
            continue
        moved = progress[rank]
        if not moved.get("stepped") and not moved.get("ran"):
            return True
        if lock_waits(a, b):
            return True
    return memory.rising(first, last)


def _progress(first: Sample, last: Sample) -> Dict[int, Dict[str, Any]]:
    """What changed in each rank between the two looks (``progress.progress_of``; made already, as the
    evidence came, where ``last`` was gathered after ``first``: ``probe.diagnose.gather.sample_job``)."""
    kept = last.__dict__.get("_compared")
    made: Dict[int, Any] = kept[1] if kept is not None and kept[0] is first else {}
    out = {}
    for r, ev in last.ranks.items():
        got = made.get(r)
        out[r] = got[1] if got is not None and got[0] is ev else steps.progress_of(first.ranks.get(r, ev), ev)
    return out


def judge(first: Sample, last: Sample, command: Commands) -> Report:
    """The verdicts on a job (or a process) from two samples ``last.at - first.at`` seconds apart."""
    window = max(0.0, last.at - first.at)
    single = last.single
    ranks = last.ranks
    pid_of = {r: ev.pid for r, ev in ranks.items()}

    def who(rs: Sequence[int]) -> str:
        return ranks_word(rs, single, pid_of.get(rs[0]) if rs else None)

    kept = last.__dict__.pop("_progress_of", None)  # needs_longer_look's, of the same two looks: made once
    progress = kept[1] if kept is not None and kept[0] is first else _progress(first, last)
    verdicts: List[Verdict] = []
    answering = sorted(r for r, ev in ranks.items() if ev.state == "answering")
    silent = sorted(r for r, ev in ranks.items() if ev.state != "answering" and ev.state != "no_agent")

    # Ranks waiting inside a collective, by stacks, stuck over the whole window (victims of whoever is missing).
    in_collective = collectives.waiting_in(first, last, answering, progress)

    # 1-2. Ranks that cannot answer, dead first. Who waits for them is the same for each (once: at 16k ranks
    # with hundreds silent, asked for each it took minutes).
    waiting = cannot.waiting(in_collective, first, last, progress) if silent else {}
    for state in ("dead", "gil_held", "stopped", "no_answer", "unreachable"):
        group = [r for r in silent if ranks[r].state == state]
        if state == "dead":  # ranks die of one rank's death (the launcher's SIGTERM, a lost peer): that one first
            group.sort(key=lambda r: cannot.died_of_another(ranks[r]))
            first_deaths = [r for r in group if not cannot.died_of_another(ranks[r])]
        for r in group:
            verdict = cannot.cannot_answer(ranks[r], who([r]), waiting, ranks, who, command, single, last.recorded)
            if state == "dead" and first_deaths and cannot.died_of_another(ranks[r]):
                verdict.summary += ("; most likely of the death of %s (its launcher's SIGTERM to the others, or a "
                                    "collective's lost peer)" % who(first_deaths))
            verdicts.append(verdict)

    # 3. Collective hang: Flight Recorder first, else stacks; only where every rank answers (otherwise the
    # ranks that cannot answer are the reason, and their verdicts name the waiting ones).
    if not silent and len(answering) >= 2:
        hang = collectives.hang(first, last, answering, in_collective, window, who, command)
        if hang is not None:
            verdicts.append(hang)

    # One process of a job, waiting in a collective: the rank to blame is elsewhere, and only the job says which.
    if single and in_collective and window >= HANG_FLOOR_S:
        verdicts.append(collectives.waits_alone(ranks[0], in_collective[0], window, command))

    # 4. A stall: no step on any rank for long, by the trace.
    if not verdicts:
        stall = steps.trace_stalled(last, answering, progress, who, command)
        if stall is not None:
            verdicts.append(stall)

    # 4b. By the step counter, trace or not: a rank that stopped stepping while others advance; no step for long.
    verdicts += steps.stopped(first, last, answering, progress, window, who, command)
    if not verdicts:
        verdicts += steps.stalled(last, answering, progress, window, who, command)

    # 5. Lock waits.
    for r in answering:
        a = first.ranks.get(r)
        if a is None or window < HANG_FLOOR_S:
            continue
        waits = lock_waits(a, ranks[r])
        if waits and r not in in_collective:
            verdicts.append(lock_verdict(ranks[r], waits, window, who, command, live=not last.recorded))

    # 6. Straggler (only when nothing is stuck: a stuck job's steps say nothing of its speed).
    if not any(v.status in ("stuck", "dead") for v in verdicts):
        straggler = sampled.by_trace(last, answering, who, command)
        if straggler is not None:
            verdicts.append(straggler)
        else:  # without the trace: ranks whose own steps are slower, where no collective keeps them in step
            verdicts += steps.slow_steps(last, answering, who, command) or sampled.judge(first, last, answering, who,
                                                                                         command)

    # Data loader stall, NaN/Inf, memory growth (and the OOM killer on a dead rank's verdict).
    verdicts += training.judge(first, last, answering, progress, window, who, command)
    verdicts += memory.judge(first, last, answering, verdicts, who, command)

    unavailable = _unavailable(last, answering, who, command)
    unavailable += with_how(training.unavailable(last, answering, who), command, last.recorded)
    unavailable += memory.unavailable(last, answering, who)
    if not verdicts:
        verdicts.append(steps.healthy(last, answering, progress, window, who, command)
                        or steps.healthy_by_trace(last, answering, progress, window, who, command))
    steps.annotate(verdicts, last, answering, progress, who, command)
    from probe.client.stack_history import since_lines  # since when each stuck rank has been where it is

    stuck = [v for v in verdicts if v.status == "stuck"]
    history = last.history
    if callable(history):  # asked now, of the named ranks' helpers alone (probe.diagnose.gather.sample_job)
        named = sorted({r for v in stuck for r in (v.culprits or v.victims)[:4]})
        history = history(named) if named else None
    for verdict in stuck:
        verdict.evidence += [Evidence(text, command(None, rest), [r])
                             for r, text, rest in since_lines(history, (verdict.culprits or verdict.victims)[:4])]
    unavailable += steps.unavailable(last, answering, who)
    _cause_first(verdicts, who)
    status = max((v.status for v in verdicts), key=STATUSES.index)
    verdicts.sort(key=lambda v: -STATUSES.index(v.status))
    return Report(status, verdicts, unavailable, window, 2, progress)


def _cause_first(verdicts: List[Verdict], who: Callable[[Sequence[int]], str]) -> None:
    """A collective hang whose culprit waits for its own data loader: the loader stall is the cause, so it is
    put first (the sort after keeps that order among equals) and the hang says so."""
    for hang in [v for v in verdicts if v.kind == "collective_hang"]:
        causes = [v for v in verdicts if v.kind == "loader_stall" and set(v.culprits) & set(hang.culprits)]
        if not causes:
            continue
        stalled = sorted({r for v in causes for r in v.culprits} & set(hang.culprits))
        hang.summary += "; %s waits for %s DataLoader worker instead (the data loader stall)" % (
            who(stalled), "its" if len(stalled) == 1 else "their")
        for cause in causes:
            verdicts.remove(cause)
            verdicts.insert(verdicts.index(hang), cause)

