"""Training verdicts of ``probe diagnose``: a data loader stall and a numerical one (NaN/Inf).

Evidence, gathered per rank and per look by :func:`gather` (reads only, bounded):

* a main thread inside a multi-process DataLoader's wait for a batch (``_get_data`` / ``_try_get_data``)
  makes one query over ``python.workers`` (which worker holds the batch waited for, whether it lives), and
  the stack of that worker read from outside (it runs no agent), only where it is on this host;
* where torch is loaded, one query over ``torch.anomalies`` (the first NaN/Inf and how many since; the
  check runs only where the trace runs with ``--anomalies``), and once such a value is found, one query
  over ``torch.parameters`` for the parameters whose value or gradient is not finite.

:func:`judge` turns it into verdicts with the rows they rest on.
"""

import math
import socket
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["gather", "judge", "unavailable", "loader_wait_of"]

LOADER_FILE = "utils/data/dataloader.py"
LOADER_WAITS = ("_get_data", "_try_get_data")
WORKERS_SQL = ("SELECT pid, worker_id, alive, state, tasks_outstanding, tasks, next_task, waited_by, dataset "
               "FROM python.workers ORDER BY worker_id LIMIT 64")
ANOMALIES_SQL = """\
SELECT step, module, stage, kind, shape, loss, (SELECT count(*) FROM torch.anomalies) AS total,
  (SELECT max(step) FROM torch.anomalies) AS last_step,
  (SELECT arg_max(loss, step) FROM torch.anomalies WHERE loss IS NOT NULL) AS last_loss
FROM torch.anomalies ORDER BY step, seq LIMIT 1"""
PARAMS_SQL = ("SELECT model, name, has_nan, has_inf, grad_has_nan, grad_has_inf, count(*) OVER () AS total "
              "FROM torch.parameters WHERE grad_has_nan OR grad_has_inf OR has_nan OR has_inf LIMIT 8")

_PARAMS_DONE: Dict[Tuple[str, Optional[int]], Dict[str, Any]] = {}  # once per process and diagnose run


def forget(key: Tuple[str, Optional[int]]) -> None:
    """Forget the parameters read after a NaN of one process (``probe.diagnose.gather.forget``)."""
    _PARAMS_DONE.pop(key, None)


def loader_wait_of(key: Sequence[Tuple[str, str, int, str]]) -> Optional[Tuple[str, str, int, str]]:
    """The frame of a stack that waits in a multi-process DataLoader for a batch, or None."""
    for frame in key:
        if frame[0].rsplit(".", 1)[-1] in LOADER_WAITS and frame[1].endswith(LOADER_FILE):
            return frame
    return None


def _on_this_host(client: Any, host: str) -> bool:
    if client.target.is_local:
        return True
    name = (host or "").split(":")[0].strip("[]")
    if name in ("localhost", socket.gethostname()) or name.startswith("process "):
        return True
    try:
        from probe.client.local_token import _is_local

        return _is_local(socket.gethostbyname(name))
    except (OSError, UnicodeError, ValueError):
        return False


def _outside_stack(pid: int) -> Tuple[Optional[List[Tuple[str, str, int, str]]], Optional[str]]:
    """The main thread's Python stack of an agentless process, innermost first; or why not."""
    from probe.client.fallback import frames_of as _frames_of
    from probe.errors import ReaderError
    from probe.reader import live

    try:
        frames = [f for f in _frames_of(live.read_live(pid)) if f.frame_type == "python"]
    except ReaderError as exc:
        return None, exc.message
    except Exception as exc:  # a reader's surprise: said, not raised
        return None, "%s: %s" % (type(exc).__name__, exc)
    if not frames:
        return None, "no Python frames read"
    main = [f for f in frames if f.is_main] or frames
    thread = main[0].thread_id
    return [(f.func, f.file, f.lineno, (f.code or "").strip())
            for f in sorted((f for f in main if f.thread_id == thread), key=lambda f: f.depth)], None


def gather(client: Any, ev: Any, query: Callable[[Any, str], List[Dict[str, Any]]], taken: Optional[List[Any]] = None) -> None:
    """This look's training evidence into ``ev.training`` (``taken``: the straggler's samples taken ahead
    of it); never raises."""
    from probe.errors import ProbeError, TorchNotLoaded

    out: Dict[str, Any] = {}
    stacks = ev.stacks()
    main = stacks.get("MainThread") or ()
    if loader_wait_of(main) is not None:
        try:
            out["workers"] = query(client, WORKERS_SQL)
        except ProbeError as exc:
            out["workers_why"] = exc.message
        waited = [w for w in out.get("workers") or () if w.get("waited_by") or w.get("alive") is False]
        for worker in waited[:2]:
            pid = worker.get("pid")
            if not isinstance(pid, int):
                continue
            if not worker.get("alive"):
                continue
            if _on_this_host(client, ev.host):
                stack, why = _outside_stack(pid)
            else:
                stack, why = None, "it runs on %s, not this host: `probe %d backtrace` there reads it" % (ev.host, pid)
            out.setdefault("worker_stacks", {})[str(pid)] = stack
            if why:
                out.setdefault("worker_stacks_why", {})[str(pid)] = why
    if ev.fr_why != "torch is not loaded":
        try:
            rows = query(client, ANOMALIES_SQL)
            out["anomalies"] = rows[0] if rows else None
        except TorchNotLoaded:
            pass
        except ProbeError as exc:
            out["anomalies_why"] = exc.message
        if out.get("anomalies"):
            key = (ev.host, ev.pid)
            if key not in _PARAMS_DONE:
                try:
                    _PARAMS_DONE[key] = {"params": query(client, PARAMS_SQL)}
                except ProbeError as exc:
                    _PARAMS_DONE[key] = {"params_why": exc.message}
            out.update(_PARAMS_DONE[key])
        from probe.diagnose import numerics

        numerics.gather(client, ev, query, out)  # without the opt-in check: the parameters, once a diagnosis
        from probe.diagnose import straggler

        straggler.gather(client, ev, query, out, taken)  # where the main thread spends a step: more samples of its stack
    ev.training = out


# -- judging ------------------------------------------------------------------------------------------


def _main_key(ev: Any) -> Tuple[Tuple[str, str, int, str], ...]:
    return tuple(ev.stacks().get("MainThread") or ())


def judge(first: Any, last: Any, answering: List[int], progress: Dict[int, Dict[str, Any]], window: float,
          who: Callable[[Sequence[int]], str], command: Any) -> List[Any]:
    from probe.diagnose.verdict import HANG_FLOOR_S

    out = []
    for r in answering:
        moved = progress.get(r, {})
        if moved.get("stepped") or window < HANG_FLOOR_S:
            continue  # what most ranks of a working job say: no loader stall there (asked first: 16k ranks)
        a, b = first.ranks.get(r), last.ranks[r]
        if a is not None:
            stall = _loader_stall(a, b, moved, window, who, command)
            if stall is not None:
                out.append(stall)
    numerical = _numerical(last, answering, who, command)
    if numerical is not None:
        out.append(numerical)
    else:
        from probe.diagnose import numerics

        out += numerics.judge(last, answering, who, command)
    return out


def _task(ev: Any) -> Any:
    rows = (getattr(ev, "training", None) or {}).get("workers") or ()
    return next((w.get("next_task") for w in rows if w.get("next_task") is not None), None)


def _loader_stall(a: Any, b: Any, progress: Dict[str, Any], window: float, who: Callable[[Sequence[int]], str],
                  command: Any) -> Optional[Any]:
    from probe.diagnose.verdict import CPU_RAN_S, Evidence, Verdict, where_of, where_text

    key = _main_key(b)  # (a rank that stepped is not asked: see judge)
    if loader_wait_of(key) is None or loader_wait_of(_main_key(a)) is None:
        return None
    if (progress.get("cpu") or 0.0) >= CPU_RAN_S:
        return None
    training = getattr(b, "training", None) or {}
    if _task(a) is not None and _task(a) != _task(b):
        return None  # a batch came between the looks: slow data, not a stall
    name = who([b.rank])
    workers = training.get("workers") or []
    waited = [w for w in workers if w.get("waited_by")]
    dead = [w for w in workers if w.get("alive") is False]
    main_where = where_of(key, "MainThread", b.library())
    evidence = [Evidence("%s: %s, waiting for a batch over %.1f s with no CPU gained" % (
        name, where_text(main_where), window), command([b.rank], "backtrace"), [b.rank])]
    workers_cmd = command([b.rank], "query \"SELECT pid, worker_id, alive, state, tasks, next_task, waited_by "
                                    "FROM python.workers\"")
    where = main_where
    stacks = training.get("worker_stacks") or {}
    whys = training.get("worker_stacks_why") or {}
    if waited or dead:
        culprit = (dead or waited)[0]
        pid, wid = culprit.get("pid"), culprit.get("worker_id")
        label = "worker %s (pid %s)" % (wid, pid)
        if culprit.get("alive") is False:
            what = "is dead (%s)" % (culprit.get("state") or "gone")
        else:
            stack = stacks.get(str(pid))
            if stack:
                wwhere = where_of(stack, "MainThread of %s" % label, b.library())  # a fork: its parent's layout
                own = (wwhere or {}).get("called_from") or wwhere
                what = "is in %s" % where_text(wwhere)
                where = dict(wwhere or {}, process=pid)
                evidence.append(Evidence("%s, its stack read from outside: %s" % (
                    label, " <- ".join("%s (%s:%d)" % (f[0], f[1].rsplit("/", 1)[-1], f[2]) for f in stack[:6])),
                    "probe %s backtrace" % pid, [b.rank], [{"pid": pid, "func": own.get("func") if own else None,
                                                           "file": own.get("file") if own else None,
                                                           "line": own.get("line") if own else None}]))
            else:
                what = "is alive, its stack not read (%s)" % whys.get(str(pid), "no reader")
        summary = "data loader stall: %s's MainThread waits for batch %s of DataLoader %s, which %s" % (
            name, culprit.get("next_task"), label, what)
        evidence.insert(1, Evidence("python.workers: %s" % "; ".join(
            "worker %s pid %s %s%s%s" % (w.get("worker_id"), w.get("pid"), "alive" if w.get("alive") else "DEAD",
                                         ", making batches %s" % w.get("tasks") if w.get("tasks") not in (None, "", "[]")
                                         else "",
                                         ", waited for by %s" % w.get("waited_by") if w.get("waited_by") else "")
            for w in workers[:8]), workers_cmd, [b.rank], workers[:8]))
    else:
        why = training.get("workers_why") or "python.workers names no worker it waits for"
        summary = "data loader stall: %s's MainThread waits for a batch (%s)" % (name, why)
        evidence.append(Evidence("the workers: %s" % why, workers_cmd, [b.rank]))
    nexts = ["the batch's sample indices are in the worker: `probe PID inject` on it, then python.locals",
             "DataLoader(timeout=SECONDS) makes a hung worker raise instead of waiting forever"]
    return Verdict("loader_stall", "stuck", summary, [b.rank], [], where, evidence, nexts)


def _nan(value: Any) -> bool:
    return isinstance(value, float) and (math.isnan(value) or math.isinf(value))


def _numerical(last: Any, answering: List[int], who: Callable[[Sequence[int]], str], command: Any) -> Optional[Any]:
    from probe.diagnose.verdict import Evidence, Verdict

    found = {r: last.ranks[r].training["anomalies"] for r in answering
             if (getattr(last.ranks[r], "training", None) or {}).get("anomalies")}
    if not found:
        return None
    earliest = min(int(row.get("step") or 0) for row in found.values())
    culprits = sorted(r for r, row in found.items() if int(row.get("step") or 0) == earliest)
    row = found[culprits[0]]
    kind = str(row.get("kind") or "non-finite").replace("nan+inf", "NaN and Inf").replace("nan", "NaN").replace(
        "inf", "Inf")
    if row.get("stage") == "input":
        place = "the batch held %s (stage 'input', given to %s): the data brought it, not a module" % (
            kind, row.get("module"))
    else:
        place = "first in module %s's %s" % (row.get("module"), "output" if row.get("stage") == "forward"
                                             else "input gradient (backward)")
    summary = "numerical: %s first at step %s on %s: %s" % (kind, earliest, who(culprits), place)
    others = sorted(set(found) - set(culprits))
    if others:
        summary += "; later on %s" % who(others)
    evidence = [Evidence("torch.anomalies: first at step %s, %s %s%s; %s anomal%s up to step %s" % (
        earliest, row.get("stage"), row.get("module"), " shape %s" % row["shape"] if row.get("shape") else "",
        row.get("total"), "y" if row.get("total") == 1 else "ies", row.get("last_step")),
        command(culprits, "query \"SELECT step, module, stage, kind, loss FROM torch.anomalies ORDER BY step, seq "
                          "LIMIT 5\""), sorted(found), [dict(r, rank=k) for k, r in sorted(found.items())])]
    nan_loss = sorted(r for r, a in found.items() if _nan(a.get("last_loss")))
    if nan_loss:
        summary += "; the loss is %s" % found[nan_loss[0]]["last_loss"]
        evidence.append(Evidence("the loss of step %s is %s on %s" % (found[nan_loss[0]].get("last_step"),
                                                                      found[nan_loss[0]]["last_loss"], who(nan_loss)),
                                 None, nan_loss))
    params = {r: (last.ranks[r].training or {}).get("params") for r in found}
    bad = {r: p for r, p in params.items() if p}
    if bad:
        r0 = sorted(bad)[0]
        names = ", ".join("%s.%s" % (p.get("model"), p.get("name")) for p in bad[r0][:4])
        total = bad[r0][0].get("total") or len(bad[r0])
        grads = any(p.get("grad_has_nan") or p.get("grad_has_inf") for p in bad[r0])
        summary += "; %s parameter%s not finite%s (%s)" % (total, "" if total == 1 else "s",
                                                           " (value or gradient)" if grads else "", names)
        evidence.append(Evidence("torch.parameters on %s: %s with NaN/Inf in value or gradient: %s" % (
            who([r0]), total, names), command([r0], "query \"SELECT model, name, grad_has_nan, grad_has_inf, has_nan, "
                                                    "has_inf FROM torch.parameters WHERE grad_has_nan OR grad_has_inf "
                                                    "OR has_nan OR has_inf\""), sorted(bad), bad[r0]))
    elif any((last.ranks[r].training or {}).get("params") == [] for r in found):
        evidence.append(Evidence("torch.parameters: every parameter and gradient is finite now", None, sorted(found)))
    where = {"module": row.get("module"), "thread": "MainThread"}
    nexts = ["the batch of that step: check the data pipeline (a NaN in the input is the data's)"
             if row.get("stage") == "input" else
             "that module's inputs and weights: %s" % command(culprits[:1], "query \"SELECT * FROM torch.anomalies "
                                                                            "ORDER BY step, seq LIMIT 3\""),
             "a checkpoint from before step %s to go back to" % earliest]
    return Verdict("numerical", "degraded", summary, culprits, [], where, evidence, nexts)


def unavailable(last: Any, answering: List[int], who: Callable[[Sequence[int]], str]) -> List[str]:
    reasons: Dict[str, List[int]] = {}
    for r in answering:
        why = (getattr(last.ranks[r], "training", None) or {}).get("anomalies_why")
        if why:
            reasons.setdefault(why, []).append(r)
    from probe.diagnose import numerics

    return ["NaN/Inf check: %s on %s" % (why, who(rs)) for why, rs in sorted(reasons.items())] + numerics.unavailable(
        last, answering, who)
