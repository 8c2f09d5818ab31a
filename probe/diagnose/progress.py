"""Progress: whether each rank makes steps, at what rate, and how long a step takes. Above all from the step
counter (``torch.steps``), on every torch job, with or without the trace; also from the trace's steps, the
Flight Recorder's collectives and the main thread's CPU.

* the evidence: one query per look (:data:`STEPS_SQL`), kept as ``RankEvidence.steps`` (rows) or
  ``steps_why``;
* :func:`progress_of`: what changed in one rank between two looks (steps, collectives, CPU, stack), with
  :func:`merge`: what its counter did;
* by the trace: no step on any rank for long (:func:`trace_stalled`); healthy where the counter does not
  say (:func:`healthy_by_trace`: the trace's steps, the Flight Recorder's collectives, the main threads);
* the rules, called by ``rules.judge``: a rank whose counter stopped while others advance (:func:`stopped`);
  no step on any rank for long (:func:`stalled`; the ranks behind in steps, if some are, apart from those
  ahead); ranks whose own steps are slower (:func:`slow_steps`: only where the ranks are not kept in step,
  since a collective every step makes every rank's step time the slowest one's); healthy with the rate
  (:func:`healthy`); and the counter's reading added to the other verdicts (:func:`annotate`).

A step time here is a whole iteration (one step's end to the next one's): under a collective every step
(DDP, an all_reduce of the loss) it is the same on every rank, straggler or not; which rank computes
longest is for the trace to say, and the verdicts say so rather than guess.
"""

import statistics
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from probe._words import span
from probe.diagnose.evidence import RankEvidence, Sample, fr_by_pg, main_stack
from probe.diagnose.verdict import CPU_RAN_S, Commands, Evidence, Verdict, where_of, where_text
from probe.errors import ProbeError, TorchNotLoaded

__all__ = ["STEPS_SQL", "collect_steps", "progress_of", "merge", "stopped", "stalled", "slow_steps", "healthy",
           "annotate", "unavailable", "trace_stalled", "healthy_by_trace"]

STEPS_SQL = ("SELECT optimizer, optimizer_id, steps, last_step_age_s AS last_age, step_time_last_s AS step_last, "
             "step_time_median_s AS step_s, step_times FROM torch.steps")
"""Each optimizer's steps counted, seconds since its last one, its last and median step time."""

STOP_FLOOR_S = 2.0  # a rank's counter stopped for less is no stop, whatever else
STOP_STEPS = 10.0  # ... nor one stopped for less than this many of its step times
STALL_FLOOR_S = 10.0
STALL_STEPS = 10.0
SLOW_RATIO = 1.5
SLOW_FLOOR_S = 0.02

Who = Callable[[Sequence[int]], str]


def collect_steps(ev: RankEvidence, query: Callable[[Any, str], List[Dict[str, Any]]], client: Any) -> None:
    """One rank's counter, into ``ev.steps`` (rows, maybe none) or ``ev.steps_why``; never raises."""
    if ev.fr_why == "torch is not loaded":
        ev.steps_why = ev.fr_why
        return
    try:
        ev.steps = query(client, STEPS_SQL)
        if not ev.steps:
            ev.steps_why = "no optimizer has made a step since probe began counting"
    except TorchNotLoaded as exc:
        ev.steps_why = "torch is not loaded" if "torch.optim" not in exc.message else "it has no optimizer"
    except ProbeError as exc:
        ev.steps_why = exc.message
    except Exception as exc:  # a surprise in the reading: said, not guessed
        ev.steps_why = "%s: %s" % (type(exc).__name__, exc)


def counter(ev: Optional[RankEvidence]) -> Optional[Dict[str, Any]]:
    """The rank's main optimizer: the one whose last step is the most recent (None: no step counted)."""
    return None if ev is None else _memo(ev)[2]  # type: ignore[no-any-return]


def _counted_of(ev: RankEvidence) -> Any:
    """(steps, state, :func:`counter`, its step time, its last step's age), kept while ``steps`` and ``state``
    are the same: the rules ask for them some ten times a rank."""
    memo = ev.__dict__.get("_counter_memo")
    if memo is not None and memo[0] is ev.steps and memo[1] == ev.state:
        return memo
    rows = [r for r in (ev.steps or ()) if isinstance(r.get("steps"), int)]
    found = None if not rows or ev.state != "answering" else min(rows, key=lambda r: float(r.get("last_age") or 0.0))
    step_s = found.get("step_s") if found is not None else None
    age = found.get("last_age") if found is not None else None
    memo = ev.__dict__["_counter_memo"] = (ev.steps, ev.state, found,
                                           float(step_s) if isinstance(step_s, (int, float)) else None,
                                           float(age) if age is not None else None)
    return memo


def _trace_step(ev: RankEvidence) -> Optional[int]:
    value = (ev.trace or {}).get("step")
    return value if isinstance(value, int) else None


def progress_of(a: RankEvidence, b: RankEvidence) -> Dict[str, Any]:
    """What changed in one rank between two samples: steps (trace), collectives (Flight Recorder), its main
    thread's CPU and stack. ``stepped``: it made a step or finished a collective; ``ran``: its main thread
    ran (gained CPU or moved)."""
    out: Dict[str, Any] = {"stepped": None, "ran": None}
    if a.state != "answering" or b.state != "answering":
        return out
    sa, sb = _trace_step(a), _trace_step(b)
    if sa is not None and sb is not None:
        out["steps"] = sb - sa
        out["step"] = sb
        out["stepped"] = sb > sa
    fa, fb = fr_by_pg(a), fr_by_pg(b)
    if fa and fb:
        moved = any(fb[pg]["last_seq"] != fa.get(pg, {}).get("last_seq")
                    or bool(fb[pg].get("last_done")) != bool(fa.get(pg, {}).get("last_done")) for pg in fb)
        out["collectives"] = sum(max(0, int(fb[pg]["last_seq"]) - int(fa.get(pg, fb[pg])["last_seq"])) for pg in fb)
        out["stepped"] = bool(out["stepped"]) or moved
    ca, cb = a.main_cpu(), b.main_cpu()
    same_stack = main_stack(a) == main_stack(b)
    if ca is not None and cb is not None:
        out["cpu"] = round(cb - ca, 3)
        out["ran"] = (cb - ca) >= CPU_RAN_S or not same_stack
    else:
        out["ran"] = not same_stack
    merge(a, b, out)  # the step counter (torch.steps): steps made, trace or not
    return out


def merge(a: RankEvidence, b: RankEvidence, out: Dict[str, Any]) -> None:
    """Steps made between the two looks (every optimizer's), into ``out`` (``optimizer_steps``,
    ``optimizer_step``: the main optimizer's count; ``stepped`` set where some step was made)."""
    if a.steps is None or b.steps is None or a.state != "answering" or b.state != "answering":
        return
    made = 0
    if len(a.steps) == 1 and len(b.steps) == 1 and _id(a.steps[0]) == _id(b.steps[0]):
        rows: Any = ((b.steps[0], a.steps[0].get("steps")),)  # one optimizer, as most jobs have: no table
    else:
        before = {_id(r): r.get("steps") for r in a.steps}
        rows = ((row, before.get(_id(row))) for row in b.steps)
    for row, then in rows:
        now = row.get("steps")
        if isinstance(now, int):
            made += max(0, now - then) if isinstance(then, int) else now  # counted since the first look
    main = counter(b)
    out["optimizer_steps"] = made
    if main is not None:
        out["optimizer_step"] = main["steps"]
        out["step_s"] = main.get("step_s")
    out["stepped"] = bool(out.get("stepped")) or made > 0


def _id(row: Dict[str, Any]) -> Any:
    """An optimizer's identity across looks: its id (its name may be found between two looks)."""
    return row.get("optimizer_id") or row.get("optimizer")


def _age(ev: RankEvidence) -> Optional[float]:
    return _memo(ev)[4]  # type: ignore[no-any-return]


def _step_s(ev: RankEvidence) -> Optional[float]:
    return _memo(ev)[3]  # type: ignore[no-any-return]


def _counted(last: Sample, answering: List[int], progress: Dict[int, Dict[str, Any]]) -> List[int]:
    """The ranks whose step counter was read at both looks (kept for the same lists: four rules ask)."""
    memo = last.__dict__.get("_counted_memo")
    if memo is not None and memo[0] is answering and memo[1] is progress and memo[2] == len(answering):
        return list(memo[3])
    out = [r for r in answering if "optimizer_steps" in progress[r] and counter(last.ranks[r]) is not None]
    last.__dict__["_counted_memo"] = (answering, progress, len(answering), out)
    return list(out)


def _ran(progress: Dict[str, Any]) -> bool:
    return bool(progress.get("ran")) if progress.get("cpu") is None else float(progress["cpu"]) >= CPU_RAN_S


def steps_text(last: Sample, ranks: Sequence[int], who: Who) -> str:
    """``rank 1 at step 52, its last 8.1 s ago; ranks 0,2 at step 53, ...``: ranks grouped by their count."""
    groups: Dict[int, Tuple[List[int], List[float]]] = {}
    evs = last.ranks
    for r in ranks:
        memo = _memo(evs[r])  # once a rank: its counter and its last step's age
        main = memo[2]
        if main is not None:
            group = groups.get(int(main["steps"]))
            if group is None:
                group = groups[int(main["steps"])] = ([], [])
            group[0].append(r)
            group[1].append(memo[4] or 0.0)
    parts = []
    for steps, (rs, ages) in sorted(groups.items()):
        parts.append("%s at step %d, the last %s ago" % (who(rs), steps, _span(min(ages), max(ages))))
    return "; ".join(parts)


def _memo(ev: RankEvidence) -> Any:
    """:func:`_counted_of`'s memo of a rank, read in place where it is still good (asked some ten times a
    rank by the rules: at 16k ranks, a call less each time counts)."""
    memo = ev.__dict__.get("_counter_memo")
    if memo is None or memo[0] is not ev.steps or memo[1] != ev.state:
        memo = _counted_of(ev)
    return memo


def _span(low: float, high: float) -> str:
    return span(low, high, "%.1f", "s")


def _rows(last: Sample, ranks: Sequence[int]) -> List[Dict[str, Any]]:
    out = []
    evs = last.ranks
    for r in ranks:
        main = _memo(evs[r])[2]
        if main is not None:
            out.append({"rank": r, "optimizer": main.get("optimizer"), "steps": main.get("steps"),
                        "last_age": main.get("last_age"), "step_s": main.get("step_s")})
    return out


def _command(command: Commands, ranks: Optional[Sequence[int]] = None) -> str:
    return command(ranks, "query \"SELECT optimizer, steps, last_step_age_s, step_time_median_s FROM torch.steps\"")


def _where(ev: RankEvidence) -> Any:
    thread, key = main_stack(ev)
    return where_of(key, thread, ev.library()) if key else None


def stopped(first: Sample, last: Sample, answering: List[int], progress: Dict[int, Dict[str, Any]],
            window: float, who: Who, command: Commands) -> List[Any]:
    """Ranks whose counter stopped (no step in the window, the last one long ago) while others advance:
    one verdict for them; the advancing ranks are not blamed (they do not wait: they step)."""
    counted = _counted(last, answering, progress)
    advancing = [r for r in counted if progress[r]["optimizer_steps"] > 0]
    if not advancing:
        return []
    pace = statistics.median([_step_s(last.ranks[r]) or 0.0 for r in advancing])
    still = []
    for r in counted:
        if progress[r]["optimizer_steps"]:
            continue  # it stepped: its counter's age is not asked (16k ranks, most of them stepping)
        age = _age(last.ranks[r])
        own = _step_s(last.ranks[r]) or 0.0
        if age is not None and age >= max(STOP_FLOOR_S, STOP_STEPS * max(pace, own)):
            still.append(r)
    if not still:
        return []
    running = [r for r in still if _ran(progress[r])]
    rate = min(progress[r]["optimizer_steps"] for r in advancing) / window if window > 0 else 0.0
    where = _where(last.ranks[still[0]])
    summary = "%s make%s no optimizer step (%s) while %s advance%s (%.1f steps/s)" % (
        who(still), "s" if len(still) == 1 else "", steps_text(last, still, who), who(advancing),
        "s" if len(advancing) == 1 else "", rate)
    evidence = [Evidence("step counter: %s; %s (%.3f s a step)" % (steps_text(last, still, who),
                                                                   steps_text(last, advancing, who), pace),
                         _command(command), still + advancing, _rows(last, still + advancing)),
                Evidence("%s: %s%s" % (who(still[:1]), where_text(where), "; its main thread runs (CPU gained)"
                                       if running else "; its main thread gained no CPU over %.1f s" % window),
                         command(still, "backtrace"), still)]
    status = "degraded" if running and len(running) == len(still) else "stuck"
    return [Verdict("no_step", status, summary, still, [], where, evidence,
                    ["see what %s does: %s" % (who(still), command(still[:1], "backtrace --native")),
                     "its locals: %s" % command(still[:1], "eval --frame MainThread:0 \"sorted(locals())\"")])]


def stalled(last: Sample, answering: List[int], progress: Dict[int, Dict[str, Any]], window: float,
            who: Who, command: Commands) -> List[Any]:
    """No step on any rank for long (at least ``STALL_FLOOR_S`` and ``STALL_STEPS`` step times): stuck when
    no main thread runs, else degraded (an evaluation, a checkpoint, a loop that makes no step). Ranks
    behind in steps are named apart from those ahead."""
    counted = _counted(last, answering, progress)
    if not counted or len(counted) != len(answering) or any(progress[r].get("stepped") for r in answering):
        return []
    for r in counted:
        age, own = _age(last.ranks[r]), _step_s(last.ranks[r]) or 0.0
        if age is None or age < max(STALL_FLOOR_S, STALL_STEPS * own):
            return []
    counts = {r: int(counter(last.ranks[r])["steps"]) for r in counted}  # type: ignore[index]
    low = min(counts.values())
    behind = sorted(r for r, c in counts.items() if c == low)
    ahead = sorted(r for r, c in counts.items() if c > low)
    running = [r for r in counted if _ran(progress[r])]
    ages = [_age(last.ranks[r]) or 0.0 for r in counted]
    step_s = max(_step_s(last.ranks[r]) or 0.0 for r in counted)
    culprit = behind if ahead else counted
    where = _where(last.ranks[culprit[0]])
    summary = "no optimizer step on %s for %.0f s (a step took %.2f s before)" % (who(counted), min(ages), step_s)
    if ahead:
        summary += "; %s %s behind (step %d, the others %s)" % (
            who(behind), "is" if len(behind) == 1 else "are", low,
            "/".join(str(c) for c in sorted(set(counts.values()) - {low})))
    evidence = [Evidence("step counter: %s" % steps_text(last, counted, who), _command(command), counted,
                         _rows(last, counted)),
                Evidence("%s: %s" % (who(culprit[:1]), where_text(where)), command(culprit, "backtrace"), culprit)]
    if running:
        evidence.append(Evidence("%s: the main thread runs (CPU gained in %.1f s): an evaluation, a checkpoint, a "
                                 "loop that makes no step?" % (who(running), window),
                                 command(running, "backtrace"), running))
    status = "degraded" if running else "stuck"
    return [Verdict("stalled", status, summary, culprit, ahead, where, evidence,
                    ["see where every rank is: %s" % command(None, "backtrace")])]


def slow_steps(last: Sample, answering: List[int], who: Who, command: Commands) -> List[Any]:
    """Ranks whose own step time is well above the others': only possible where no collective keeps the
    ranks in step every step, so there it is the rank's own iterations that are slower."""
    times = {r: t for r in answering for t in [_step_s(last.ranks[r])] if t is not None and t > 0}
    if len(times) < 2:
        return []
    if len(times) == 2:
        base = min(times.values())
    else:
        base = statistics.median(times.values())
    slow = sorted(r for r, t in times.items() if t > SLOW_RATIO * base and t - base > SLOW_FLOOR_S)
    if not slow or len(slow) * 2 > len(times):
        return []
    others = sorted(set(times) - set(slow))
    summary = "slow steps: %s take%s %.3f s a step, %s %.3f s (median of the last 64): %s own iterations are " \
              "slower (no collective keeps the ranks in step)" % (
                  who(slow), "s" if len(slow) == 1 else "", max(times[r] for r in slow), who(others),
                  statistics.median(times[r] for r in others), "its" if len(slow) == 1 else "their")
    evidence = [Evidence("step counter: median step time %s" % ", ".join(
        "%s %.3f s" % (who([r]), t) for r, t in sorted(times.items(), key=lambda kv: -kv[1])[:6]),
        _command(command), sorted(times), [dict(rank=r, step_s=round(t, 4)) for r, t in sorted(times.items())])]
    return [Verdict("slow_steps", "degraded", summary, slow, [], _where(last.ranks[slow[0]]), evidence,
                    ["where its time goes, per module: %s" % command(slow[:1], "trace start"),
                     "its stacks: %s" % command(slow[:1], "backtrace")])]


def spread_evidence(last: Sample, ranks: Sequence[int], who: Who, command: Commands) -> Optional[Any]:
    """The step time across ranks, where it is about equal: what it does and does not say."""
    evs = last.ranks
    times = [t for r in ranks for t in [_memo(evs[r])[3]] if t is not None]
    if not times:
        return None
    text = "step time %s on %s (median of the last 64 steps)" % (_span3(min(times), max(times)), who(ranks))
    if len(times) >= 2:
        text += ("; about equal across ranks, as a collective every step makes it: a straggler would slow them "
                 "all alike, and only the trace tells whose compute is long (%s)" % command(None, "trace start"))
    return Evidence(text, _command(command), list(ranks))


def _span3(low: float, high: float) -> str:
    return span(low, high, "%.3f", "s")


def healthy(last: Sample, answering: List[int], progress: Dict[int, Dict[str, Any]], window: float,
            who: Who, command: Commands) -> Optional[Any]:
    """Healthy by the counter, where no rank has the trace (that verdict says the same with its own steps):
    every rank made steps (the rate), or no step in the window but none stopped for long."""
    if not answering or any(last.ranks[r].trace for r in answering):
        return None
    counted = _counted(last, answering, progress)
    if not counted:
        return None
    made = {r: progress[r]["optimizer_steps"] for r in counted}
    rate = min(made.values()) / window if window > 0 else 0.0
    low, high = min(made.values()), max(made.values())
    steps = span(low, high)
    evidence = [Evidence("step counter: %s optimizer step%s in %.1f s on %s (about %.1f steps/s); %s" % (
        steps, "" if steps == "1" else "s", window, who(counted), rate, steps_text(last, counted, who)),
        _command(command), counted, _rows(last, counted))]
    spread = spread_evidence(last, counted, who, command)
    if spread is not None:
        evidence.append(spread)
    uncounted = sorted(set(answering) - set(counted))
    if uncounted:
        evidence.append(Evidence("%s: no step counted (%s)" % (who(uncounted), last.ranks[uncounted[0]].steps_why
                                                               or "no optimizer"), None, uncounted))
    if all(made[r] > 0 for r in counted) and not uncounted:
        step_s = [t for r in counted for t in [_step_s(last.ranks[r])] if t is not None]
        summary = "healthy: steps advance on %s (%.1f steps/s%s)" % (
            who(answering), rate, "; %.3f s a step" % max(step_s) if step_s else "")
        return Verdict("healthy", "healthy", summary, [], [], None, evidence, [])
    idle = sorted(r for r in counted if made[r] == 0)
    summary = "no trouble found on %s; no optimizer step in the %.1f s watched on %s (%s)" % (
        who(answering), window, who(idle) if idle else who(uncounted), steps_text(last, idle, who) if idle
        else "none counted")
    return Verdict("healthy", "healthy", summary, [], [], None, evidence, [])


def annotate(verdicts: List[Any], last: Sample, answering: List[int], progress: Dict[int, Dict[str, Any]],
             who: Who, command: Commands) -> None:
    """Add the counter's reading to verdicts made from other evidence (a hang, a rank that cannot answer,
    the trace's healthy): the ranks they name, or every rank for a healthy one."""
    counted = _counted(last, answering, progress)
    if not counted:
        return
    for verdict in verdicts:
        if verdict.kind in ("no_step", "stalled", "slow_steps") or any(
                e.text.startswith("step counter:") for e in verdict.evidence):
            continue
        named = sorted(set(verdict.culprits) | set(verdict.victims)) or (
            counted if verdict.status == "healthy" else [])
        shown = [r for r in named if r in counted]
        if not shown:
            continue
        made = [progress[r]["optimizer_steps"] for r in shown]
        verdict.evidence.append(Evidence("step counter: %s; %s between the looks" % (
            steps_text(last, shown, who), _made_text(min(made), max(made))), _command(command), shown,
            _rows(last, shown)))


def _made_text(low: int, high: int) -> str:
    """How many steps the ranks made between the looks: "no step", "3 steps", "2-5 steps"."""
    if high == 0:
        return "no step"
    return span(low, high, unit="step" if high == 1 else "steps")


def unavailable(last: Sample, answering: List[int], who: Who) -> List[str]:
    reasons: Dict[str, List[int]] = {}
    for r in answering:
        why = getattr(last.ranks[r], "steps_why", None)
        if why and why != "torch is not loaded":
            reasons.setdefault(why, []).append(r)
    return ["step counter: %s on %s" % (why, who(rs)) for why, rs in sorted(reasons.items())]


# -- by the trace, where the counter does not say ----------------------------------------------------


def trace_stalled(last: Sample, answering: List[int], progress: Dict[int, Dict[str, Any]],
                  who: Callable[[Sequence[int]], str], command: Commands) -> Optional[Verdict]:
    """The trace's last step long ago on every rank (``STALL_FLOOR_S`` and ``STALL_STEPS`` step times), none
    made in the window."""
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
    thread, key = main_stack(last.ranks[traced[0]])
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


def healthy_by_trace(last: Sample, answering: List[int], progress: Dict[int, Dict[str, Any]], window: float,
                     who: Callable[[Sequence[int]], str], command: Commands) -> Verdict:
    """Healthy where the counter does not say: steps advancing by the trace or the Flight Recorder, or,
    without either, the main threads running and "progress unknown"."""
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
        evidence.append(Evidence("trace: %s in %.1f s on %s (about %.1f steps/s; %.3f s a step)" % (
            span(min(steps), max(steps), unit="step" if max(steps) == 1 else "steps"), window, who(traced), rate,
            max(step_s)),
            command(None, "query \"SELECT max(step) AS step FROM python.torch_trace\""), traced))
    fr = [r for r in answering if "collectives" in progress[r]]
    if fr:
        counts = [progress[r]["collectives"] for r in fr]
        evidence.append(Evidence("Flight Recorder: %s completed in %.1f s on %s" % (
            span(min(counts), max(counts), unit="collective" if max(counts) == 1 else "collectives"), window, who(fr)), command(None, "query \"SELECT pg, max(collective_seq_id) "
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
            who(ran), window, " (%s of CPU)" % span(min(cpu), max(cpu), "%.2f", "s") if cpu else ""),
            command(None, "query \"SELECT thread_name, cpu_user FROM python.threads\""), ran))
    idle = sorted(set(answering) - set(ran) - set(stepped))
    if idle:
        evidence.append(Evidence("%s: the main thread neither ran nor moved in %.1f s, and nothing else says it is "
                                 "stuck" % (who(idle), window), command(idle, "backtrace"), idle))
    torch_idle = [r for r in idle if last.ranks[r].fr_why != "torch is not loaded"]  # no collective without torch
    if torch_idle and not traced and not fr and len(answering) > 1 and not last.recorded:
        return _unsure(idle, answering, uncounted, window, evidence, who, command)
    summary = "no trouble found on %s%s" % (who(answering), "; %s: progress unknown" % uncounted if not traced and
                                            not fr else "; no step completed in the %.1f s watched" % window)
    return Verdict("healthy", "healthy", summary, [], [], None, evidence,
                   ["steps and a straggler's compute per rank: %s" % command(None, "trace start")] if not traced else [])


def _unsure(idle: List[int], answering: List[int], uncounted: str, window: float, evidence: List[Evidence],
            who: Callable[[Sequence[int]], str], command: Commands) -> Verdict:
    """A job with no sign of progress to read (no step counted, no trace, no Flight Recorder) where some
    ranks' main threads neither ran nor moved, torch loaded in one of them at least (without it no
    collective can hold them): a rank waiting for work and a hang look alike here (a hang
    in ``work.wait()`` of an async collective shows no torch.distributed frame), so the verdict is unsure,
    never "healthy" (exit 10), and says what would tell them apart."""
    summary = ("progress unknown on %s: %s, no trace and no Flight Recorder; the main thread of %s neither ran nor "
               "moved in %.1f s: a wait and a hang look alike here" % (who(answering), uncounted, who(idle), window))
    nexts = ["look again in a while: a hang stays where it is (%s)" % command(None, "diagnose --watch 10"),
             "where each rank waits: %s" % command(None, "backtrace --native"),
             "numbered collectives tell a hang from a wait: start the job with TORCH_FR_BUFFER_SIZE=2000",
             "steps and a straggler's compute per rank: %s" % command(None, "trace start")]
    return Verdict("unknown", "degraded", summary, [], [], None, evidence, nexts)


def _uncounted(last: Sample, answering: List[int]) -> str:
    """Why the step counter counted no optimizer step, in the words of its evidence."""
    whys = sorted({str(last.ranks[r].steps_why) for r in answering if last.ranks[r].steps_why})
    return "no optimizer step counted%s" % (" (%s)" % "; ".join(whys) if whys else "")
