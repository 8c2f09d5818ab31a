"""The rules of ``probe diagnose``: plain code over the evidence of two samples a moment apart.

Each rule names the ranks it blames (culprits) apart from those that only wait for them (victims), the
place (function, file:line, thread), and the evidence it rests on; no rule speaks without evidence. In
order of weight:

1. a dead rank (how it ended; its last stacks where its crash record kept them);
2. a rank that cannot answer: a C call holds its GIL (where), or it is stopped; one that gave no answer;
3. a collective hang: from the Flight Recorder, the ranks whose last collective of a group is before the
   one the others issued and still wait in (its number, op, for how long); without it, from the stacks:
   ranks whose main thread stayed inside a torch.distributed collective over the whole window, with no
   CPU gained and no step made, against the ranks outside it;
4. a stall: the trace's last step long ago on every rank, none made in the window;
5. a lock wait: a thread that stayed at ``with X:`` / ``X.acquire(`` over the window, gaining no CPU, its
   holder by the lock's identity (:mod:`probe.diagnose.lockwaits`);
6. a straggler: a rank whose own compute per step (forward self time in the trace) is well above the
   others' median; not the ranks that wait for it in collectives;
7. otherwise healthy: steps advancing (trace, Flight Recorder, the step counter), or, without any, the main
   threads running and "no optimizer step counted ...: progress unknown".
"""

import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from probe.diagnose.evidence import RankEvidence, Sample
from probe.diagnose import silent as cannot
from probe.diagnose.lockwaits import lock_verdict, lock_wait_of, lock_waits

__all__ = ["STATUSES", "EXIT_CODES", "Evidence", "Verdict", "Report", "judge", "Commands", "needs_longer_look",
           "lock_wait_of", "lock_waits"]

STATUSES = ("healthy", "degraded", "stuck", "dead")
EXIT_CODES = {"healthy": 0, "degraded": 10, "stuck": 11, "dead": 12}
"""The exit status of ``probe diagnose``: apart from probe's own (1-7, 130)."""

CPU_RAN_S = 0.02  # a thread that gained this much CPU over the window ran
HANG_FLOOR_S = 2.0  # a collective waited in for less is no hang, whatever else
HANG_PERIODS = 5.0  # ... nor one waited in for less than this many of the group's mean intervals
STRAGGLER_RATIO = 1.5
STRAGGLER_FLOOR_S = 0.02
STALL_FLOOR_S = 10.0
STALL_STEPS = 10.0

Commands = Callable[[Optional[Sequence[int]], str], str]
"""(ranks or None for all, the command's rest) -> the probe command line that shows it."""


@dataclass
class Evidence:
    text: str
    command: Optional[str] = None
    ranks: List[int] = field(default_factory=list)
    rows: List[Dict[str, Any]] = field(default_factory=list)

    def as_json(self) -> Dict[str, Any]:
        return {"text": self.text, "command": self.command, "ranks": self.ranks, "rows": self.rows}


@dataclass
class Verdict:
    kind: str
    status: str
    summary: str
    culprits: List[int] = field(default_factory=list)
    victims: List[int] = field(default_factory=list)
    where: Optional[Dict[str, Any]] = None
    evidence: List[Evidence] = field(default_factory=list)
    next: List[str] = field(default_factory=list)

    def as_json(self) -> Dict[str, Any]:
        return {"kind": self.kind, "status": self.status, "summary": self.summary, "culprits": self.culprits,
                "victims": self.victims, "where": self.where, "evidence": [e.as_json() for e in self.evidence],
                "next": self.next}


@dataclass
class Report:
    status: str
    verdicts: List[Verdict]
    unavailable: List[str]
    window: float
    samples: int
    progress: Dict[int, Dict[str, Any]]

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    def as_json(self) -> Dict[str, Any]:
        return {"status": self.status, "exit_code": self.exit_code, "verdicts": [v.as_json() for v in self.verdicts],
                "unavailable": self.unavailable, "window_s": round(self.window, 3), "samples": self.samples,
                "progress": {str(r): p for r, p in sorted(self.progress.items())}}


# -- small readings of the evidence -------------------------------------------------------------------


def ranks_word(ranks: Sequence[int], single: bool = False, pid: Optional[int] = None) -> str:
    from probe.client.cluster import compact_ranks

    if single:
        return "process %d" % pid if pid is not None else "the process"
    return ("rank %s" if len(ranks) == 1 else "ranks %s") % compact_ranks(ranks)


def _short(path: str) -> str:
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path[path.index(marker) + len(marker):]
    return path


def _frame_text(frame: Tuple[str, str, int, str]) -> str:
    return "%s (%s:%d)" % (frame[0], _short(frame[1]), frame[2])


def where_of(key: Sequence[Tuple[str, str, int, str]], thread: str, library: Any = None) -> Optional[Dict[str, Any]]:
    """The innermost frame of a stack, and the innermost of the program's own frames when that one is a
    library's: ``{"func", "file", "line", "thread", "called_from"}``. ``library``: the process's layout
    (``RankEvidence.library()``; this host's where not given)."""
    if not key:
        return None
    if library is None:
        from probe.diagnose.library import local_layout

        library = local_layout()
    top = key[0]
    out: Dict[str, Any] = {"func": top[0], "file": top[1], "line": top[2], "thread": thread}
    if library.holds(top[1]):
        own = next((f for f in key if not library.holds(f[1])), None)
        if own is not None:
            out["called_from"] = {"func": own[0], "file": own[1], "line": own[2]}
    return out


def where_text(where: Optional[Dict[str, Any]]) -> str:
    if not where:
        return "(no stack)"
    text = "%s (%s:%d)" % (where["func"], _short(where["file"]), where["line"])
    if where.get("called_from"):
        own = where["called_from"]
        text += " called from %s (%s:%d)" % (own["func"], own["file"], own["line"])
    return text + ", thread %s" % where["thread"]


_C10D = ("distributed/distributed_c10d.py", "distributed/_functional_collectives.py", "distributed/c10d_logger.py")


def collective_of(key: Sequence[Tuple[str, str, int, str]]) -> Optional[str]:
    """The torch.distributed collective a stack is inside (``all_reduce``, ``barrier``...), or None."""
    for func, path, _, _ in key:
        if path.endswith(_C10D[:2]) and not func.startswith("_") and func != "wrapper":
            return func
    return None


def _main(ev: RankEvidence) -> Tuple[str, Tuple[Tuple[str, str, int, str], ...]]:
    stacks = ev.stacks()
    if "MainThread" in stacks:
        return "MainThread", stacks["MainThread"]
    for name, key in stacks.items():
        return name, key
    return "MainThread", ()


def _fr_by_pg(ev: RankEvidence) -> Dict[str, Dict[str, Any]]:
    return {str(r.get("pg")): r for r in ev.fr or () if r.get("last_seq") is not None}


def _step(ev: RankEvidence) -> Optional[int]:
    value = (ev.trace or {}).get("step")
    return value if isinstance(value, int) else None


def progress_of(a: RankEvidence, b: RankEvidence) -> Dict[str, Any]:
    """What changed in one rank between two samples: steps (trace), collectives (Flight Recorder), its main
    thread's CPU and stack. ``stepped``: it made a step or finished a collective; ``ran``: its main thread
    ran (gained CPU or moved)."""
    out: Dict[str, Any] = {"stepped": None, "ran": None}
    if a.state != "answering" or b.state != "answering":
        return out
    sa, sb = _step(a), _step(b)
    if sa is not None and sb is not None:
        out["steps"] = sb - sa
        out["step"] = sb
        out["stepped"] = sb > sa
    fa, fb = _fr_by_pg(a), _fr_by_pg(b)
    if fa and fb:
        moved = any(fb[pg]["last_seq"] != fa.get(pg, {}).get("last_seq")
                    or bool(fb[pg].get("last_done")) != bool(fa.get(pg, {}).get("last_done")) for pg in fb)
        out["collectives"] = sum(max(0, int(fb[pg]["last_seq"]) - int(fa.get(pg, fb[pg])["last_seq"])) for pg in fb)
        out["stepped"] = bool(out["stepped"]) or moved
    ca, cb = a.main_cpu(), b.main_cpu()
    same_stack = _main(a) == _main(b)
    if ca is not None and cb is not None:
        out["cpu"] = round(cb - ca, 3)
        out["ran"] = (cb - ca) >= CPU_RAN_S or not same_stack
    else:
        out["ran"] = not same_stack
    from probe.diagnose import progress as steps

    steps.merge(a, b, out)  # the step counter (torch.steps): steps made, trace or not
    return out


def needs_longer_look(first: Sample, last: Sample) -> bool:
    """Whether some rank that answers showed no sign of life between the samples: then look longer before
    calling anything stuck."""
    for rank, b in last.ranks.items():
        a = first.ranks.get(rank)
        if a is None or b.state != "answering":
            continue
        moved = progress_of(a, b)
        if not moved.get("stepped") and not moved.get("ran"):
            return True
        if lock_waits(a, b):
            return True
    from probe.diagnose import memory

    return memory.rising(first, last)


# -- the rules ---------------------------------------------------------------------------------------


def judge(first: Sample, last: Sample, command: Commands) -> Report:
    """The verdicts on a job (or a process) from two samples ``last.at - first.at`` seconds apart."""
    window = max(0.0, last.at - first.at)
    single = last.single
    ranks = last.ranks
    pid_of = {r: ev.pid for r, ev in ranks.items()}

    def who(rs: Sequence[int]) -> str:
        return ranks_word(rs, single, pid_of.get(rs[0]) if rs else None)

    progress = {r: progress_of(first.ranks.get(r, ev), ev) for r, ev in ranks.items()}
    verdicts: List[Verdict] = []
    answering = sorted(r for r, ev in ranks.items() if ev.state == "answering")
    silent = sorted(r for r, ev in ranks.items() if ev.state != "answering" and ev.state != "no_agent")

    # Ranks waiting inside a collective, by stacks, stuck over the whole window (victims of whoever is missing).
    in_collective: Dict[int, Tuple[str, str, Any]] = {}
    for r in answering:
        name, key = _main(ranks[r])
        op = collective_of(key)
        a = first.ranks.get(r)
        if op is not None and a is not None and _main(a) == (name, key) and not progress[r].get("stepped") \
                and not (progress[r].get("cpu") or 0) >= CPU_RAN_S:
            in_collective[r] = (op, name, key)

    # 1-2. Ranks that cannot answer, dead first.
    for state in ("dead", "gil_held", "stopped", "no_answer", "unreachable"):
        group = [r for r in silent if ranks[r].state == state]
        if state == "dead":  # ranks die of one rank's death (the launcher's SIGTERM, a lost peer): that one first
            group.sort(key=lambda r: cannot.died_of_another(ranks[r]))
            first_deaths = [r for r in group if not cannot.died_of_another(ranks[r])]
        for r in group:
            verdict = cannot.cannot_answer(ranks[r], who([r]), cannot.waiting(in_collective, first, last, progress),
                                           ranks, who, command, single, last.recorded)
            if state == "dead" and first_deaths and cannot.died_of_another(ranks[r]):
                verdict.summary += ("; most likely of the death of %s (its launcher's SIGTERM to the others, or a "
                                    "collective's lost peer)" % who(first_deaths))
            verdicts.append(verdict)

    # 3. Collective hang: Flight Recorder first, else stacks; only where every rank answers (otherwise the
    # ranks that cannot answer are the reason, and their verdicts name the waiting ones).
    if not silent and len(answering) >= 2:
        from probe.diagnose.collectives import mismatch

        hang = mismatch(first, last, answering, who, command) or _fr_hang(first, last, answering, who, command) or \
            _stack_hang(
            last, answering, in_collective, window, who, command)
        if hang is not None:
            verdicts.append(hang)

    # One process of a job, waiting in a collective: the rank to blame is elsewhere, and only the job says which.
    if single and in_collective and window >= HANG_FLOOR_S:
        verdicts.append(_waits_alone(ranks[0], in_collective[0], window, command))

    # 4. A stall: no step on any rank for long, by the trace.
    if not verdicts:
        stall = _stall(last, answering, progress, who, command)
        if stall is not None:
            verdicts.append(stall)

    # 4b. By the step counter, trace or not: a rank that stopped stepping while others advance; no step for long.
    from probe.diagnose import progress as steps

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
        straggler = _straggler(last, answering, who, command)
        if straggler is not None:
            verdicts.append(straggler)
        else:  # without the trace: ranks whose own steps are slower, where no collective keeps them in step
            from probe.diagnose import straggler as sampled

            verdicts += steps.slow_steps(last, answering, who, command) or sampled.judge(first, last, answering, who,
                                                                                         command)

    # Data loader stall, NaN/Inf, memory growth (and the OOM killer on a dead rank's verdict).
    from probe.diagnose import memory, training

    verdicts += training.judge(first, last, answering, progress, window, who, command)
    verdicts += memory.judge(first, last, answering, verdicts, who, command)
    from probe.diagnose.unknown import unavailable as _unavailable, with_how

    unavailable = _unavailable(last, answering, who, command)
    unavailable += with_how(training.unavailable(last, answering, who), command, last.recorded)
    unavailable += memory.unavailable(last, answering, who)
    if not verdicts:
        verdicts.append(steps.healthy(last, answering, progress, window, who, command)
                        or _healthy(last, answering, progress, window, who, command))
    steps.annotate(verdicts, last, answering, progress, who, command)
    from probe.client.stack_history import since_lines  # since when each stuck rank has been where it is

    for verdict in [v for v in verdicts if v.status == "stuck"]:
        verdict.evidence += [Evidence(text, command(None, rest), [r])
                             for r, text, rest in since_lines(last.history, (verdict.culprits or verdict.victims)[:4])]
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


def _fr_hang(first: Sample, last: Sample, answering: List[int], who: Callable[[Sequence[int]], str],
             command: Commands) -> Optional[Verdict]:
    """From the Flight Recorder: per group, the ranks at its last collective #M that wait in it, and the
    ranks whose last collective is before M (they did not issue #M)."""
    groups: Dict[str, Dict[int, Dict[str, Any]]] = {}
    for r in answering:
        for pg, row in _fr_by_pg(last.ranks[r]).items():
            groups.setdefault(pg, {})[r] = row
    for pg, rows in sorted(groups.items()):
        if len(rows) < 2:
            continue
        top = max(int(row["last_seq"]) for row in rows.values())
        waiting = sorted(r for r, row in rows.items() if int(row["last_seq"]) == top and not row.get("last_done"))
        behind = sorted(r for r, row in rows.items() if int(row["last_seq"]) < top)
        if not waiting or not behind:
            continue
        still = []
        for r in waiting:
            before = _fr_by_pg(first.ranks[r]).get(pg) if r in first.ranks else None
            row = rows[r]
            period = float(row.get("period") or 0.0)
            age = float(row.get("last_age") or 0.0)
            if before is not None and int(before["last_seq"]) == top and not before.get("last_done") \
                    and age >= max(HANG_FLOOR_S, HANG_PERIODS * period):
                still.append(r)
        if still != waiting:
            continue  # a rank arrived, or the wait is short for this group's pace: not a hang (yet)
        row = rows[waiting[0]]
        op = str(row.get("last_op") or "a collective")
        desc = " (%s)" % row["pg_desc"] if row.get("pg_desc") else ""
        thread, key = _main(last.ranks[behind[0]])
        where = where_of(key, thread, last.ranks[behind[0]].library())
        behind_at = sorted({int(rows[r]["last_seq"]) for r in behind})
        summary = ("collective hang in process group %s%s: %s did not issue %s #%d; %s wait%s in it" % (
            pg, desc, who(behind), op, top, who(waiting), "s" if len(waiting) == 1 else ""))
        ages = [float(rows[r].get("last_age") or 0) for r in waiting]
        fr_cmd = command(None, "query \"SELECT pg, collective_seq_id, op, state, retired, time_created FROM "
                               "torch.flight_recorder ORDER BY collective_seq_id DESC LIMIT 3\"")
        evidence = [
            Evidence("Flight Recorder, group %s: %s issued #%d (%s) %.1f s ago and it is not done; %s's last is #%s"
                     % (pg, who(waiting), top, op, min(ages), who(behind), ",".join(map(str, behind_at))),
                     fr_cmd, waiting + behind,
                     [dict(rank=r, pg=pg, last_seq=rows[r]["last_seq"], last_op=rows[r].get("last_op"),
                           last_done=rows[r].get("last_done"), last_age=rows[r].get("last_age")) for r in sorted(rows)]),
            Evidence("%s: %s" % (who(behind), where_text(where)), command(behind, "backtrace"), behind)]
        vthread, vkey = _main(last.ranks[waiting[0]])
        evidence.append(Evidence("%s: %s" % (who(waiting), where_text(where_of(vkey, vthread,
                                                                                last.ranks[waiting[0]].library()))),
                                 command(waiting, "backtrace"), waiting))
        return Verdict("collective_hang", "stuck", summary, behind, waiting, where, evidence, _hang_next(behind, command))
    return None


def _waits_alone(ev: RankEvidence, found: Tuple[str, str, Any], window: float, command: Commands) -> Verdict:
    op, thread, key = found
    where = where_of(key, thread, ev.library())
    fr = [row for row in _fr_by_pg(ev).values() if not row.get("last_done")]
    age = max((float(row.get("last_age") or 0) for row in fr), default=window)
    summary = "process %s waits in %s (no progress for %.1f s): the rank it waits for is elsewhere" % (
        ev.pid if ev.pid is not None else "", op, age)
    evidence = [Evidence("%s, the same stack over %.1f s with no CPU gained and no step" % (where_text(where), window),
                         command(None, "backtrace"), [ev.rank])]
    for row in fr:
        evidence.append(Evidence("Flight Recorder, group %s: #%s (%s) issued %.1f s ago, not done" % (
            row.get("pg"), row.get("last_seq"), row.get("last_op"), float(row.get("last_age") or 0)),
            command(None, "query \"SELECT * FROM torch.flight_recorder ORDER BY collective_seq_id DESC LIMIT 3\""),
            [ev.rank], [row]))
    return Verdict("collective_wait", "stuck" if age >= HANG_FLOOR_S * 5 else "degraded", summary, [], [],
                   where, evidence, ["diagnose the whole job to find the rank that did not join: probe MASTER:PROBE_PORT "
                                     "diagnose (or probe slurm:JOBID diagnose)"])


def _hang_next(culprits: List[int], command: Commands) -> List[str]:
    return ["see what %s does, with its C frames: %s" % (ranks_word(culprits), command(culprits[:1], "backtrace --native")),
            "why it did not reach the collective: a data loader, a rank-dependent branch, an exception caught and "
            "ignored; its locals: %s" % command(culprits[:1], "eval --frame MainThread:0 \"sorted(locals())\""),
            "save the state before restarting, into a directory every rank can write (DIR: choose one; it must "
            "exist): %s" % command(None, "checkpoint DIR/emergency-{rank}.pt")]


def _stack_hang(last: Sample, answering: List[int], in_collective: Dict[int, Any], window: float,
                who: Callable[[Sequence[int]], str], command: Commands) -> Optional[Verdict]:
    """From the stacks alone: ranks whose main thread stayed in a collective over the window (same stack, no
    CPU, no step) while the other ranks are outside it (or in another)."""
    if not in_collective or window < HANG_FLOOR_S:
        return None
    ops: Dict[str, List[int]] = {}
    for r, (op, _, _) in in_collective.items():
        ops.setdefault(op, []).append(r)
    op, waiting = max(ops.items(), key=lambda kv: (len(kv[1]), kv[0]))
    waiting.sort()
    outside = sorted(r for r in answering if r not in waiting)
    if not outside:
        return None  # every rank in the same collective: no rank is missing from it by the stacks
    thread, key = _main(last.ranks[outside[0]])
    where = where_of(key, thread, last.ranks[outside[0]].library())
    summary = "collective hang: %s did not enter %s; %s wait%s in it (no progress for %.1f s)" % (
        who(outside), op, who(waiting), "s" if len(waiting) == 1 else "", window)
    vthread, vkey = _main(last.ranks[waiting[0]])
    evidence = [Evidence("%s: %s, the same stack over %.1f s with no CPU gained and no step"
                         % (who(waiting), where_text(where_of(vkey, vthread, last.ranks[waiting[0]].library())), window),
                         command(waiting, "backtrace"), waiting),
                Evidence("%s: %s, outside %s" % (who(outside), where_text(where), op), command(outside, "backtrace"),
                         outside),
                Evidence("the Flight Recorder is off: the collective's number is not known "
                         "(TORCH_FR_BUFFER_SIZE=2000 at the job's start records it)", None, [])][
                    :3 if any(last.ranks[r].fr_why for r in answering) else 2]
    return Verdict("collective_hang", "stuck", summary, outside, waiting, where, evidence, _hang_next(outside, command))


def _stall(last: Sample, answering: List[int], progress: Dict[int, Dict[str, Any]],
           who: Callable[[Sequence[int]], str], command: Commands) -> Optional[Verdict]:
    traced = [r for r in answering if last.ranks[r].trace]
    if not traced or len(traced) != len(answering) or any(progress[r].get("stepped") for r in answering):
        return None
    stale = []
    for r in traced:
        trace = last.ranks[r].trace or {}
        age, step_s = float(trace.get("last_age") or 0), float(trace.get("step_s") or 0)
        if age >= max(STALL_FLOOR_S, STALL_STEPS * step_s):
            stale.append(r)
    if stale != traced:
        return None
    thread, key = _main(last.ranks[traced[0]])
    where = where_of(key, thread, last.ranks[traced[0]].library())
    ages = [float(last.ranks[r].trace["last_age"]) for r in traced]  # type: ignore[index]
    summary = "no step on %s for %.0f s (a step took %.2f s before)" % (
        who(traced), min(ages), float(last.ranks[traced[0]].trace.get("step_s") or 0))  # type: ignore[union-attr]
    evidence = [Evidence("trace: last step %s, its last span began %.0f s ago" % (
        last.ranks[traced[0]].trace.get("step"), min(ages)),  # type: ignore[union-attr]
        command(None, "query \"SELECT max(step), max(time) FROM python.torch_trace\""), traced),
        Evidence("%s: %s" % (who([traced[0]]), where_text(where)), command(None, "backtrace"), traced)]
    return Verdict("stalled", "stuck", summary, traced, [], where, evidence,
                   ["see where every rank is: %s" % command(None, "backtrace")])


def _straggler(last: Sample, answering: List[int], who: Callable[[Sequence[int]], str],
               command: Commands) -> Optional[Verdict]:
    compute = {r: float(last.ranks[r].trace["compute"]) for r in answering  # type: ignore[index]
               if last.ranks[r].trace and isinstance(last.ranks[r].trace.get("compute"), (int, float))}  # type: ignore[union-attr]
    if len(compute) < 2:
        return None
    median = statistics.median(compute.values())
    slow = sorted(r for r, c in compute.items() if c > STRAGGLER_RATIO * median and c - median > STRAGGLER_FLOOR_S)
    if not slow or len(slow) * 2 > len(compute) and len(compute) > 2:
        return None
    if len(compute) == 2:  # two ranks: the slower one, if it is well above the other
        low = min(compute.values())
        slow = [r for r, c in compute.items() if c > STRAGGLER_RATIO * low and c - low > STRAGGLER_FLOOR_S]
        median = low
        if len(slow) != 1:
            return None
    r = slow[0]
    top = last.ranks[r].trace.get("top_module")  # type: ignore[union-attr]
    summary = "straggler: %s compute%s %.3f s a step (forward self time), the others %.3f s%s" % (
        who(slow), "s" if len(slow) == 1 else "", compute[r], median,
        "; most of it in module %s" % top if top else "")
    where = {"module": top, "thread": "MainThread"} if top else None
    rows = [dict(rank=k, compute=round(v, 4), top_module=last.ranks[k].trace.get("top_module"))  # type: ignore[union-attr]
            for k, v in sorted(compute.items())]
    shown = ", ".join("%s %.3f s" % (who([k]), v) for k, v in sorted(compute.items(), key=lambda kv: -kv[1])[:4])
    evidence = [Evidence("trace: forward self time per step over the last 5 steps: %s%s" % (
        shown, ", ..." if len(compute) > 4 else ""), command(
        None, "query \"SELECT sum(duration) AS compute FROM python.torch_trace WHERE step > (SELECT max(step) - 5 "
              "FROM python.torch_trace) AND stage = 'forward'\" --merge \"SELECT rank, compute FROM result ORDER BY "
              "compute DESC\""), sorted(compute), rows)]
    return Verdict("straggler", "degraded", summary, slow, sorted(set(compute) - set(slow)), where, evidence,
                   ["its slowest modules: %s" % command(slow[:1], "query \"SELECT module, sum(duration) AS t FROM "
                                                                    "python.torch_trace WHERE stage = 'forward' GROUP BY "
                                                                    "1 ORDER BY 2 DESC LIMIT 5\""),
                    "the others wait for it in their collectives: their long collective time is its effect, not a cause"])


def _healthy(last: Sample, answering: List[int], progress: Dict[int, Dict[str, Any]], window: float,
             who: Callable[[Sequence[int]], str], command: Commands) -> Verdict:
    if not answering:
        return Verdict("unknown", "degraded", "no rank gave evidence", [], [], None, [], [])
    stepped = [r for r in answering if progress[r].get("stepped")]
    traced = [r for r in answering if "steps" in progress[r]]
    ran = [r for r in answering if progress[r].get("ran")]
    evidence = []
    if traced:
        steps = [progress[r]["steps"] for r in traced]
        rate = min(steps) / window if window > 0 else 0.0
        step_s = [float(last.ranks[r].trace.get("step_s") or 0) for r in traced]  # type: ignore[union-attr]
        evidence.append(Evidence("trace: %d-%d steps in %.1f s on %s (about %.1f steps/s; %.3f s a step)" % (
            min(steps), max(steps), window, who(traced), rate, max(step_s)),
            command(None, "query \"SELECT max(step) AS step FROM python.torch_trace\""), traced))
    fr = [r for r in answering if "collectives" in progress[r]]
    if fr:
        counts = [progress[r]["collectives"] for r in fr]
        evidence.append(Evidence("Flight Recorder: %d-%d collectives completed in %.1f s on %s" % (
            min(counts), max(counts), window, who(fr)), command(None, "query \"SELECT pg, max(collective_seq_id) "
                                                                       "FROM torch.flight_recorder GROUP BY 1\""), fr))
    if stepped and len(stepped) == len(answering):
        summary = "healthy: steps advance on %s" % who(answering)
        if traced:
            summary += " (%.1f steps/s)" % (min(progress[r]["steps"] for r in traced) / window if window else 0.0)
        return Verdict("healthy", "healthy", summary, [], [], None, evidence, [])
    uncounted = _uncounted(last, answering)
    if not traced and not fr:
        evidence.append(Evidence("progress unknown: %s; neither the trace's steps nor the Flight Recorder's "
                                 "collectives are recorded" % uncounted, command(None, "trace start"), answering))
    cpu = [progress[r].get("cpu") for r in ran if progress[r].get("cpu") is not None]
    if ran:
        evidence.append(Evidence("%s: the main thread ran in the %.1f s watched%s" % (
            who(ran), window, " (%.2f-%.2f s of CPU)" % (min(cpu), max(cpu)) if cpu else ""),
            command(None, "query \"SELECT thread_name, cpu_user FROM python.threads\""), ran))
    idle = sorted(set(answering) - set(ran) - set(stepped))
    if idle:
        evidence.append(Evidence("%s: the main thread neither ran nor moved in %.1f s, and nothing else says it is "
                                 "stuck" % (who(idle), window), command(idle, "backtrace"), idle))
    summary = "no trouble found on %s%s" % (who(answering), "; %s: progress unknown" % uncounted if not traced and
                                            not fr else "; no step completed in the %.1f s watched" % window)
    return Verdict("healthy", "healthy", summary, [], [], None, evidence,
                   ["steps and a straggler's compute per rank: %s" % command(None, "trace start")] if not traced else [])


def _uncounted(last: Sample, answering: List[int]) -> str:
    """Why the step counter counted no optimizer step, in the words of its evidence."""
    whys = sorted({str(last.ranks[r].steps_why) for r in answering if last.ranks[r].steps_why})
    return "no optimizer step counted%s" % (" (%s)" % "; ".join(whys) if whys else "")
