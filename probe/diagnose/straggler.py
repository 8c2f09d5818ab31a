"""A straggler slow outside its forward pass: where the extra time of a rank that holds the others up goes.

In a job with a collective every step, every rank's step takes as long as the slowest rank's: whole step
times are equal, and the forward self time (the trace's straggler rule) shows only a straggler whose
modules are slow. A rank slow in its own data loading, its optimizer or any code of its own is found by
where the ranks' main threads are, sampled: the ranks that wait are inside a torch.distributed collective
most of the time, the straggler is mostly elsewhere, and where it is names the cause.

* :func:`gather`, at each look of a rank that is stepping (its optimizer stepped in the last 2 s; without an
  optimizer counted, a traced span or a recorded collective in the last 2 s):
  ``SAMPLES`` more stacks of the main thread, ``GAP_S`` apart (one ``/v1/backtrace`` each: the agent reads
  the stacks, a few ms of the GIL), kept as ``training["main_samples"]``; after the first look, of a rank
  that was stepping at the previous one, taken in the wait before the look (:func:`ahead`), not after it
  (through the node helpers, both looks' samples are taken right after the first and come with the
  second: ``probe.host.prefetch``);
* :func:`judge`: with the looks' own stacks, each sample's phase: inside a collective, in a backward pass
  (its own code run inside it, a hook or an autograd Function's backward, apart: under DDP every rank's
  step ends in its backward, the ranks that wait with the engine's frame innermost), the optimizer, a
  forward pass, or the program's own code (data loading, preprocessing). A rank mostly
  (half its samples and more) in a phase where the others are 0.4 less often, while the others are mostly
  where a rank waits for another (a collective; a backward pass: DDP's gradient all_reduce waits there,
  in C) and it 0.4 less often, is the straggler; its most sampled own function is named, with the trace's
  phase times per step where the trace runs. Exactly one rank must fit: else nothing is said.

Where the trace runs, a straggler slow in its forward pass is found first by its own compute per step
(:func:`by_trace`: forward self time well above the others' median); not the ranks that wait for it in
collectives.
"""

import statistics
import time
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from probe.diagnose.collectives import collective_of
from probe.diagnose.evidence import Sample, agent_frames, main_stack
from probe.diagnose.progress import counter, _step_s as step_of
from probe.diagnose.verdict import Commands, Evidence, Verdict, where_of

__all__ = ["SAMPLES", "GAP_S", "AHEAD_S", "ahead", "sample_main", "gather", "judge", "by_trace"]

SAMPLES = 5
GAP_S = 0.08
STEPPING_S = 2.0
MIN_SAMPLES = 6
STRAGGLER_RATIO = 1.5  # by the trace: a rank's forward self time this many times the others' median ...
STRAGGLER_FLOOR_S = 0.02  # ... and this much above it

Frame = Tuple[str, str, int, str]
PHASES = (("backward", ("torch/autograd/", "torch/_tensor.py")), ("optimizer", ("torch/optim/",)),
          ("forward", ("torch/nn/modules/module.py",)))

PHASES_SQL = """\
WITH s AS (SELECT step, stage, depth, time_offset, total_duration, host_duration FROM python.torch_trace
  WHERE step >= (SELECT max(step) - 5 FROM python.torch_trace) AND step < (SELECT max(step) FROM python.torch_trace))
SELECT count(DISTINCT step) AS steps,
  sum(CASE WHEN stage = 'forward' AND depth = 0 THEN total_duration END) / greatest(count(DISTINCT step), 1) AS forward,
  sum(CASE WHEN stage = 'backward' AND depth = 0 THEN total_duration END) / greatest(count(DISTINCT step), 1) AS backward,
  sum(CASE WHEN stage = 'optimizer' THEN total_duration END) / greatest(count(DISTINCT step), 1) AS optimizer,
  (SELECT avg(first) FROM (SELECT min(time_offset) AS first FROM s WHERE stage = 'forward' GROUP BY step)) AS before_forward
FROM s"""
"""Per step over the last 5 whole steps: forward, backward, optimizer (host or device time) and the time
from the step's beginning to its first forward (data loading, zero_grad, the program's own code)."""


AHEAD_S = SAMPLES * GAP_S
"""How long before a look its samples start where they are taken ahead of it (:func:`ahead`)."""


def ahead(previous: Any) -> bool:
    """Whether a rank's next look takes its samples AHEAD of its own stacks (in the wait before it, so the
    look ends ``AHEAD_S`` sooner): where its previous look found it stepping. The look keeps them only
    where it finds the rank stepping still (:func:`gather`), as if taken after it."""
    return previous is not None and previous.state == "answering" and _moving(previous, counter(previous))


def sample_main(client: Any, n: int = SAMPLES) -> List[List[List[Any]]]:
    """``n`` stacks of the main thread, ``GAP_S`` apart (the first ``GAP_S`` from now); fewer where the
    agent stopped answering. Never raises."""
    from probe.errors import ProbeError

    samples: List[List[List[Any]]] = []
    for _ in range(n):
        time.sleep(GAP_S)
        try:
            frames = agent_frames(client)
        except ProbeError:
            break
        except Exception:  # a surprise in the reading: fewer samples, said by their count
            break
        mains = sorted((f for f in frames if f.is_main and f.frame_type == "python"), key=lambda f: f.depth)
        samples.append([[f.func, f.file, f.lineno, (f.code or "").strip()] for f in mains[:60]])
    return samples


def gather(client: Any, ev: Any, query: Callable[[Any, str], List[Dict[str, Any]]], out: Dict[str, Any],
           taken: Optional[List[List[List[Any]]]] = None) -> None:
    """More samples of the main thread's stack into ``out["main_samples"]``, where the rank is stepping
    (``taken``: those taken ahead of this look, kept only then; ``[]`` where they are taken after it and
    come with the next look: ``probe.host.prefetch``); the trace's phases where it runs. Never raises."""
    from probe.errors import ProbeError

    if not _moving(ev, counter(ev)):
        return
    out["main_samples"] = taken if taken is not None else sample_main(client)
    if ev.trace:
        try:
            rows = query(client, PHASES_SQL)
            out["phases"] = rows[0] if rows else None
        except ProbeError as exc:
            out["phases_why"] = exc.message


def _moving(ev: Any, main: Optional[Dict[str, Any]]) -> bool:
    """Whether the rank made progress in the last ``STEPPING_S``: an optimizer step, else (no optimizer
    counted) a traced span or a collective issued."""
    if main is not None:
        age = main.get("last_age")
        return isinstance(age, (int, float)) and age <= STEPPING_S
    ages = [(ev.trace or {}).get("last_age")] + [row.get("last_age") for row in ev.fr or ()]
    return any(isinstance(a, (int, float)) and a <= STEPPING_S for a in ages)


def _parts(ev: Any) -> Optional[Tuple[int, int]]:
    """What :func:`_samples` reads of one look of a rank, by identity (None: it reads nothing there). The
    objects are the rank's own, alive while the looks are: their ids name them for the judgement's time."""
    if ev is None or ev.state != "answering":
        return None
    return id(main_stack(ev)[1]), id((getattr(ev, "training", None) or {}).get("main_samples"))


def _samples(first: Any, last: Any, rank: int, seen: Optional[Dict[int, Any]] = None) -> List[Tuple[Frame, ...]]:
    """``seen``: id of a sample -> the stack read from it, where the same sample object is shared by ranks
    (evidence gathered through the node helpers shares them): read once. The samples outlive the call."""
    out: List[Tuple[Frame, ...]] = []
    for ev in (first.ranks.get(rank), last.ranks.get(rank)):
        if ev is None or ev.state != "answering":
            continue
        key = main_stack(ev)[1]
        if key:
            out.append(tuple(key))
        for stack in (getattr(ev, "training", None) or {}).get("main_samples") or ():
            read = seen.get(id(stack)) if seen is not None else None
            if read is None:
                try:
                    read = tuple((str(f[0]), str(f[1]), int(f[2]), str(f[3])) for f in stack)
                except (TypeError, ValueError, IndexError):
                    continue
                if seen is not None:
                    seen[id(stack)] = read
            out.append(read)
    return out


def _phase(key: Sequence[Frame], library: Any = None) -> str:
    """The phase of one sample (innermost frame first). In a backward pass, frames of the program's own
    code inside the autograd engine's (a hook, an autograd Function's backward, a recomputed forward) make
    it ``backward code``: the rank computes there in Python, where a rank waiting for DDP's gradient
    all_reduce shows the engine's frame innermost (the wait is in C)."""
    if collective_of(key) is not None:
        return "collective"
    for phase, marks in PHASES:
        engine = next((i for i, f in enumerate(key) if any(m in f[1] for m in marks)), None)
        if engine is None:
            continue
        if phase == "backward" and library is not None and any(not library.holds(f[1]) for f in key[:engine]):
            return "backward code"
        return phase
    return "own code"


def _own(key: Sequence[Frame], library: Any) -> Optional[Frame]:
    """The innermost frame of the program's own code: not a library's by the rank's own layout
    (``RankEvidence.library``: never by a folder's name)."""
    return next((f for f in key if not library.holds(f[1])), None)


def judge(first: Any, last: Any, answering: List[int], who: Callable[[Sequence[int]], str], command: Any) -> List[Any]:
    """The straggler by the main threads' samples: one rank mostly in a phase of its own (its code, its
    forward, its optimizer) where the others seldom are, while they are mostly where ranks wait for another
    (a collective; a backward pass, where DDP's gradient all_reduce waits) and it seldom is."""
    if len(answering) < 2:
        return []
    phases: Dict[int, Counter] = {}
    keys: Dict[int, List[Tuple[Frame, ...]]] = {}
    seen: Dict[int, Any] = {}  # the ranks of a job share their samples' stacks: each read and phased once
    phased: Dict[Tuple[Any, int], str] = {}
    by_samples: Dict[Tuple[Any, int], Counter] = {}
    # Ranks whose looks hold the same objects (a main stack, a list of samples: the helpers' evidence shares
    # them) have the same samples and counts: read once a group (at 16k ranks, a few groups).
    by_parts: Dict[Tuple[Any, ...], Tuple[List[Tuple[Frame, ...]], Counter]] = {}
    for r in answering:
        b = last.ranks[r]
        if not (b.training or {}).get("main_samples"):
            return []  # not sampled (not stepping): no judgement
        library = b.library()
        parts = (_parts(first.ranks.get(r)), _parts(b), id(library))
        got = by_parts.get(parts)
        if got is None:
            samples = _samples(first, last, r, seen)
            if len(samples) < MIN_SAMPLES:
                return []  # too few samples: no judgement
            # Ranks whose samples are the same objects share their count too, read only: counted once per
            # distinct set of samples, not once a rank.
            signature = (tuple(map(id, samples)), id(library))
            counted = by_samples.get(signature)
            if counted is None:
                counted = by_samples[signature] = Counter()
                for k in samples:  # by identity: the samples are shared objects, hashing each stack cost more
                    phase = phased.get((id(k), id(library)))
                    if phase is None:
                        phase = phased[(id(k), id(library))] = _phase(k, library)
                    counted[phase] += 1
            got = by_parts[parts] = (samples, counted)
        keys[r], phases[r] = got
    found = _culprit(phases, keys)
    if found is None:
        return []
    r, phase, wait = found
    others = sorted(set(phases) - {r})
    library = last.ranks[r].library()
    in_phase = [k for k in keys[r] if _phase(k, library) == phase]
    funcs = Counter(f for f in (_own(k, library) for k in in_phase) if f is not None)
    top = funcs.most_common(1)[0][0] if funcs else None
    key = next((k for k in in_phase if _own(k, library) == top), in_phase[0])
    where = where_of(key, "MainThread")
    if where is not None and top is not None and where.get("called_from") is None and \
            (where["func"], where["line"]) != (top[0], top[2]):
        where["called_from"] = {"func": top[0], "file": top[1], "line": top[2]}
    fn = "%s (%s:%d)" % (top[0], top[1].rsplit("/", 1)[-1], top[2]) if top else "code its stacks do not name"
    n = len(keys[r])
    wait_word = "a collective" if wait == "collective" else "the backward pass (where DDP's gradient all_reduce waits)"
    step_s = _step_s(last, answering)
    summary = ("straggler: %s holds up %s: its main thread was in %s in %d of %d samples, mostly %s, while %s "
               "waited in %s (%s)%s" % (
                   who([r]), who(others), _PHASE_WORDS[phase], phases[r][phase], n, fn, who(others), wait_word,
                   ", ".join("%s %d of %d" % (who([o]), phases[o][wait], len(keys[o])) for o in others[:4]),
                   "; a step takes %.3f s on every rank (the step counter)" % step_s if step_s else ""))
    rows = [dict(rank=k, samples=len(keys[k]), **{p: phases[k][p] for p in _PHASE_WORDS}) for k in sorted(phases)]
    evidence = [Evidence("main thread samples (the looks' stacks and %d more a look, %.0f ms apart), by phase: %s" % (
        SAMPLES, GAP_S * 1000, "; ".join("%s: %s" % (who([k]), ", ".join("%s %d" % (p, c) for p, c in
                                                                       phases[k].most_common())) for k in sorted(phases))),
        command(None, "backtrace"), sorted(phases), rows)]
    evidence.append(Evidence("%s, in %d of its %d samples: %s" % (
        who([r]), funcs[top] if top else len(in_phase), n, " <- ".join(
            "%s (%s:%d)" % (f[0], f[1].rsplit("/", 1)[-1], f[2]) for f in key[:5])), command([r], "backtrace"), [r]))
    trace = _phase_evidence(last, sorted(phases), who, command)
    if trace is not None:
        evidence.append(trace)
    nexts = ["what %s does there: %s" % (who([r]), command([r], "backtrace")),
             "the others' long %s time is its effect, not a cause" % ("collective" if wait == "collective" else "backward")]
    if phase == "own code":
        nexts.insert(1, "a data loader with workers (num_workers) or prefetching takes the loading off the step")
    if phase == "backward code":
        nexts.insert(1, "%s runs in every backward pass of %s: make it cheaper, run it on fewer steps, or find why "
                        "it is slower there than on %s" % (fn, who([r]), who(others)))
    return [Verdict("straggler", "degraded", summary, [r], others, where, evidence, nexts)]


_PHASE_WORDS = {"own code": "its own code outside forward, backward and the optimizer (data loading, preprocessing)",
                "backward code": "its own code run inside its backward pass (a hook, an autograd Function's backward)",
                "forward": "its forward pass", "backward": "its backward pass", "optimizer": "its optimizer step",
                "collective": "a collective"}
AT_LEAST = 0.5  # the straggler in its phase, the others where they wait: in at least this share of the samples
APART = 0.4  # ... and this much more than the others there (median), or than the straggler where they wait


def _median_without(ordered: List[float], value: float) -> float:
    """``statistics.median`` of ``ordered`` (sorted) less one occurrence of ``value``, in O(log n)."""
    import bisect

    i = bisect.bisect_left(ordered, value)
    m = len(ordered) - 1

    def at(k: int) -> float:
        return ordered[k] if k < i else ordered[k + 1]

    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


_ALL_PHASES = ("own code", "forward", "optimizer", "backward", "backward code", "collective")


def _culprit(phases: Dict[int, Counter], keys: Dict[int, List[Any]]) -> Optional[Tuple[int, str, str]]:
    """(rank, its phase, where the others wait), where exactly one rank fits."""
    # Ranks that share their count (one Counter object) and their number of samples share their shares,
    # and so whether they fit: each such group is judged once (at 16k ranks, a few groups).
    groups: Dict[Tuple[int, int], List[int]] = {}
    for r in phases:
        groups.setdefault((id(phases[r]), len(keys[r])), []).append(r)
    shares = {g: {p: phases[rs[0]][p] / g[1] for p in _ALL_PHASES} for g, rs in groups.items()}
    # Each phase's shares sorted once: the others' median is the median of that list less the rank's own
    # share (a median over the others for each rank was quadratic: seconds at a thousand ranks).
    ordered = {phase: sorted(v for g, rs in groups.items() for v in [shares[g][phase]] * len(rs))
               for phase in _ALL_PHASES}

    found = []
    for g, rs in groups.items():
        if len(phases) < 2:
            break
        own = shares[g]
        for phase in _ALL_PHASES[:5]:
            if own[phase] < AT_LEAST or own[phase] - _median_without(ordered[phase], own[phase]) < APART:
                continue
            for wait in ("collective", "backward"):
                waited = _median_without(ordered[wait], own[wait])
                if wait != phase and waited >= AT_LEAST and waited - own[wait] >= APART:
                    found.extend((r, phase, wait) for r in rs)
                    break
    ranks = {f[0] for f in found}
    return found[0] if len(ranks) == 1 else None


def _step_s(last: Any, answering: List[int]) -> Optional[float]:
    times = [t for r in answering for t in [step_of(last.ranks[r])] if t]
    return max(times) if times else None


def _phase_evidence(last: Any, ranks: List[int], who: Callable[[Sequence[int]], str], command: Any) -> Optional[Any]:
    rows = {r: (last.ranks[r].training or {}).get("phases") for r in ranks}
    rows = {r: p for r, p in rows.items() if p and p.get("steps")}
    if not rows:
        return None

    def num(value: Any) -> float:
        return float(value) if isinstance(value, (int, float)) else 0.0

    text = "; ".join("%s: before forward (data) %.3f s, forward %.3f s, backward %.3f s, optimizer %.3f s" % (
        who([r]), num(p.get("before_forward")), num(p.get("forward")), num(p.get("backward")), num(p.get("optimizer")))
        for r, p in sorted(rows.items()))
    return Evidence("trace, a step over the last 5: %s" % text,
                    command(None, "query \"SELECT stage, sum(total_duration) FROM python.torch_trace WHERE depth = 0 "
                                  "GROUP BY 1\""), sorted(rows), [dict(p, rank=r) for r, p in sorted(rows.items())])


def by_trace(last: Sample, answering: List[int], who: Callable[[Sequence[int]], str],
             command: Commands) -> Optional[Verdict]:
    """A straggler by the trace: a rank whose own compute per step (forward self time over the last 5 steps)
    is well above the others' median (of two ranks, well above the other's)."""
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
