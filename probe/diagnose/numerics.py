"""NaN/Inf in a model's parameters or gradients, found without the opt-in check (``trace start --anomalies``).

A job whose loss is ``nan`` on every rank still makes steps: by progress alone it is healthy. So, once per
rank and diagnosis, where the rank is stepping, ``diagnose`` reads ``torch.parameters`` once
(:data:`PARAMS_SQL`): the table takes the gradients' references on the training thread right after an
optimizer step (so the wait is at most one step: only a rank whose last step ended under
``STEPPING_S`` ago, in steps no longer than that, is read) and computes one norm per CPU parameter and
gradient off that thread (the NaN/Inf tests only where a norm is not finite), within the table's own time
budget (``torch.parameters.BUDGET_S``). CUDA tensors are not read (that would synchronise the device):
they are counted and said under "not known". A rank is read again only ``AGAIN_S`` later (``--watch``).

The verdict names the ranks whose parameters or gradients are not finite, the parameters (value or
gradient, NaN or Inf), and the step each rank had reached when read (the step counter's count): the
first step it came in is only known with the opt-in check, and the verdict says so.

Beside the parameters, the framework's last logged loss where one keeps it (:data:`LOSS_SQL`: HF
Trainer's ``state.log_history``, Lightning's ``callback_metrics``; ``torch.trainer``'s ``loss`` column,
read by attribute, no framework imported, at most 16 log entries and 64 metric names looked at), once
per rank every ``AGAIN_S`` whether or not the rank is stepping, where the main thread's stack shows the
framework's frames: a loss logged NaN or Inf is named in the
verdict, and is a numerical verdict of its own where the parameters could not be read or are finite.
"""

import math
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["PARAMS_SQL", "LOSS_SQL", "gather", "judge", "unavailable", "forget"]

PARAMS_SQL = """\
SELECT model, name, device, has_nan, has_inf, grad_has_nan, grad_has_inf, note, params, checked, bad FROM (
  SELECT *, count(*) OVER () AS params, count(has_nan) OVER () AS checked,
    count(*) FILTER (WHERE has_nan OR has_inf OR grad_has_nan OR grad_has_inf) OVER () AS bad,
    row_number() OVER (ORDER BY coalesce(has_nan OR has_inf OR grad_has_nan OR grad_has_inf, false) DESC,
                                has_nan IS NULL DESC) AS k
  FROM torch.parameters) WHERE k <= 8 ORDER BY k"""
"""Up to 8 parameters (those not finite first, then one not read, for its note), with the counts: every
parameter, those read, those not finite."""

LOSS_SQL = "SELECT trainer, kind, loss, loss_from FROM torch.trainer WHERE loss IS NOT NULL"
"""The framework's last logged loss, for each trainer that keeps one."""

STEPPING_S = 2.0
AGAIN_S = 30.0

_DONE: Dict[Tuple[str, Optional[int]], Tuple[float, Dict[str, Any]]] = {}
_LOSS_DONE: Dict[Tuple[str, Optional[int]], Tuple[float, Dict[str, Any]]] = {}


def forget(key: Tuple[str, Optional[int]]) -> None:
    _DONE.pop(key, None)
    _LOSS_DONE.pop(key, None)


_FRAMEWORKS = ("/transformers/", "/lightning/", "/pytorch_lightning/")


def _framework_running(ev: Any) -> bool:
    """Whether the main thread runs a framework that logs a loss (a frame of its package on the stack): the
    trainer table is read only then, its discovery kept out of every other job's look."""
    stacks = ev.stacks() or {}
    return any(any(mark in str(frame[1]) for mark in _FRAMEWORKS) for frame in stacks.get("MainThread") or ())


def _gather_loss(client: Any, key: Tuple[str, Optional[int]], query: Callable[[Any, str], List[Dict[str, Any]]],
                 out: Dict[str, Any]) -> None:
    """``logged_loss`` (torch.trainer's rows with a loss) into ``out``, read at most once every ``AGAIN_S``."""
    done = _LOSS_DONE.get(key)
    if done is None or time.monotonic() - done[0] >= AGAIN_S:
        try:
            result: Dict[str, Any] = {"logged_loss": query(client, LOSS_SQL)}
        except Exception as exc:  # a trainer table that cannot be read: said under "not known", not raised
            result = {"logged_loss_why": getattr(exc, "message", None) or "%s: %s" % (type(exc).__name__, exc)}
        done = _LOSS_DONE[key] = (time.monotonic(), result)
    out.update(done[1])


def _stepping(ev: Any) -> Optional[str]:
    """None where the rank is stepping (its gradients can be taken at a step's end soon); else why not."""
    from probe.diagnose.progress import counter

    main = counter(ev)
    if main is None:
        return "no optimizer step counted (the gradients are read at a step's end)"
    age, step_s = main.get("last_age"), main.get("step_s")
    if not isinstance(age, (int, float)) or age > STEPPING_S:
        return "no optimizer step in the last %.0f s (the gradients are read at a step's end)" % STEPPING_S
    if isinstance(step_s, (int, float)) and step_s > STEPPING_S:
        return "steps of %.1f s: reading at a step's end would wait that long" % step_s
    return None


def gather(client: Any, ev: Any, query: Callable[[Any, str], List[Dict[str, Any]]], out: Dict[str, Any]) -> None:
    """Into ``out`` (the look's training evidence): ``finite_check`` (the rows and the step when read) or
    ``finite_check_why``; at most once per process every ``AGAIN_S``. Never raises."""
    from probe.diagnose.progress import counter
    from probe.errors import ProbeError

    if ev.fr_why == "torch is not loaded" or out.get("anomalies"):
        return  # no torch; or the opt-in check found one, and its rule reads the parameters itself
    key = (ev.host, ev.pid)
    if _framework_running(ev):
        _gather_loss(client, key, query, out)
    done = _DONE.get(key)
    if done is not None and time.monotonic() - done[0] < AGAIN_S:
        out.update(done[1])
        return
    why = _stepping(ev)
    if why is not None:
        out["finite_check_why"] = why
        return
    main = counter(ev)
    start = time.monotonic()
    try:
        rows = query(client, PARAMS_SQL)
        result: Dict[str, Any] = {"finite_check": {"rows": rows, "step": main.get("steps") if main else None,
                                                   "optimizer": main.get("optimizer") if main else None,
                                                   "seconds": round(time.monotonic() - start, 3)}}
    except ProbeError as exc:
        result = {"finite_check_why": exc.message}
    except Exception as exc:  # a surprise in the reading: said, not raised
        result = {"finite_check_why": "%s: %s" % (type(exc).__name__, exc)}
    _DONE[key] = (time.monotonic(), result)
    out.update(result)


def _check(ev: Any) -> Optional[Dict[str, Any]]:
    return (getattr(ev, "training", None) or {}).get("finite_check")


def _bad(check: Dict[str, Any]) -> List[Dict[str, Any]]:
    return [r for r in check.get("rows") or () if r.get("has_nan") or r.get("has_inf") or r.get("grad_has_nan")
            or r.get("grad_has_inf")]


def _what(row: Dict[str, Any]) -> str:
    parts = []
    for part, nan, inf in (("value", "has_nan", "has_inf"), ("gradient", "grad_has_nan", "grad_has_inf")):
        kinds = [k for k, flag in (("NaN", nan), ("Inf", inf)) if row.get(flag)]
        if kinds:
            parts.append("%s %s" % (part, "/".join(kinds)))
    return "%s.%s (%s)" % (row.get("model"), row.get("name"), ", ".join(parts))


def _bad_losses(ev: Any) -> List[Dict[str, Any]]:
    """The rank's logged losses that are NaN or Inf."""
    rows = (getattr(ev, "training", None) or {}).get("logged_loss") or ()
    return [r for r in rows if isinstance(r.get("loss"), float) and not math.isfinite(r["loss"])]


def _loss_text(row: Dict[str, Any]) -> str:
    return "%s (%s)" % ("nan" if math.isnan(row["loss"]) else repr(row["loss"]), row.get("loss_from"))


def judge(last: Any, answering: List[int], who: Callable[[Sequence[int]], str], command: Any) -> List[Any]:
    """The numerical verdict from the parameters read, where some rank's are not finite, or from the
    framework's last logged loss, where it is NaN or Inf."""
    from probe.diagnose.verdict import Evidence, Verdict

    checks: Dict[int, Dict[str, Any]] = {}
    bad: Dict[int, List[Dict[str, Any]]] = {}
    losses: Dict[int, List[Dict[str, Any]]] = {}
    evs = last.ranks
    for r in answering:  # one pass over the ranks (16k of them at scale), each rank's rows read once
        ev = evs[r]
        check = _check(ev)
        if check is not None:
            checks[r] = check
            found = _bad(check)
            if found:
                bad[r] = found
        rows = _bad_losses(ev)
        if rows:
            losses[r] = rows
    loss_evidence = [Evidence("the last logged loss on %s: %s" % (who([r]), ", ".join(_loss_text(x) for x in rows)),
                              command([r], "query \"%s\"" % LOSS_SQL), [r], [dict(x, rank=r) for x in rows])
                     for r, rows in sorted(losses.items())[:4]]
    if not bad:
        return _loss_verdict(losses, checks, loss_evidence, who, command) if losses else []
    ranks = sorted(bad)
    fine = sorted(set(checks) - set(bad))
    r0 = ranks[0]
    first = bad[r0]
    total = int(first[0].get("bad") or len(first))
    grads = any(r.get("grad_has_nan") or r.get("grad_has_inf") for r in first)
    values = any(r.get("has_nan") or r.get("has_inf") for r in first)
    kind = "NaN" if any(r.get("has_nan") or r.get("grad_has_nan") for rs in bad.values() for r in rs) else "Inf"
    steps = {r: checks[r].get("step") for r in ranks}
    step_text = "; ".join("%s at optimizer step %s" % (who([r]), s) for r, s in sorted(steps.items())
                          if s is not None)
    earliest = min((s for s in steps.values() if isinstance(s, int)), default=None)
    summary = "numerical: %s in the %s of %s (%d parameter%s on %s, e.g. %s), found by step %s%s; the step it came " \
              "in is not known without the NaN/Inf check (trace start --anomalies)" % (
                  kind, "values and gradients" if grads and values else "gradients" if grads else "values",
                  who(ranks), total, "" if total == 1 else "s", who([r0]), _what(first[0]),
                  earliest if earliest is not None else "?", "; finite on %s" % who(fine) if fine else "")
    if losses:
        r = min(losses)
        summary += "; the last logged loss on %s: %s" % (who([r]), _loss_text(losses[r][0]))
    sql = ("query \"SELECT model, name, has_nan, has_inf, grad_has_nan, grad_has_inf FROM torch.parameters WHERE "
           "has_nan OR has_inf OR grad_has_nan OR grad_has_inf\"")
    evidence = [Evidence("torch.parameters on %s, read once at its optimizer step %s: %d of %d parameters not finite "
                         "(value or gradient): %s" % (who([r]), steps[r], int(bad[r][0].get("bad") or len(bad[r])),
                                                      int(checks[r]["rows"][0].get("params") or 0),
                                                      ", ".join(_what(x) for x in bad[r][:4])),
                         command([r], sql), [r], [dict(x, rank=r) for x in bad[r][:8]]) for r in ranks[:4]]
    evidence += loss_evidence
    if fine:
        evidence.append(Evidence("%s: every parameter and gradient read is finite" % who(fine), None, fine))
    if step_text:
        evidence.append(Evidence("read at: %s" % step_text, None, ranks))
    where = {"module": str(first[0].get("name") or "").rsplit(".", 1)[0] or None, "thread": "MainThread"}
    nexts = ["where it first comes in, module and step: %s, then diagnose again" % command(
        None, "trace start --anomalies"),
        "a checkpoint from before step %s to go back to" % (earliest if earliest is not None else "it came in"),
        "a lower learning rate, gradient clipping, or the batch of that step (a NaN in the data is the data's)"]
    return [Verdict("numerical", "degraded", summary, ranks, [], where, evidence, nexts)]


def _loss_verdict(losses: Dict[int, List[Dict[str, Any]]], checks: Dict[int, Any], evidence: List[Any],
                  who: Callable[[Sequence[int]], str], command: Any) -> List[Any]:
    """The numerical verdict from the logged loss alone (the parameters finite, or not read)."""
    from probe.diagnose.verdict import Verdict

    ranks = sorted(losses)
    row = losses[ranks[0]][0]
    kind = "NaN" if math.isnan(row["loss"]) else "Inf"
    read = sorted(r for r in checks if r in losses)
    params = ("every parameter and gradient read on %s is finite (a loss can be %s where the weights are not yet)"
              % (who(read), kind) if read else "the parameters were not read (see not known)")
    summary = "numerical: the last logged loss is %s on %s: %s; %s" % (kind, who(ranks), _loss_text(row), params)
    nexts = ["where it first comes in, module and step: %s, then diagnose again" % command(
        None, "trace start --anomalies"),
        "the batch of that step (a NaN in the data is the data's), a lower learning rate, gradient clipping",
        "a checkpoint from before that step to go back to"]
    return [Verdict("numerical", "degraded", summary, ranks, [], {"thread": "MainThread"}, evidence, nexts)]


def unavailable(last: Any, answering: List[int], who: Callable[[Sequence[int]], str]) -> List[str]:
    """What the check could not read: why a rank was not read, and CUDA or budget-skipped tensors."""
    reasons: Dict[str, List[int]] = {}
    ranks = last.ranks
    for r in answering:
        training = getattr(ranks[r], "training", None) or {}
        why = training.get("finite_check_why")
        check = training.get("finite_check")
        if check is not None:
            rows = check.get("rows") or []
            if rows and not rows[0].get("params"):
                rows = []  # nothing counted as left unread: the common case, read no further
            params = int(rows[0].get("params") or 0) if rows else 0
            read = int(rows[0].get("checked") or 0) if rows else 0
            if params > read:
                note = next((str(x.get("note")) for x in rows if x.get("has_nan") is None and x.get("note")), "not read")
                why = "%d of %d parameters not read (%s)" % (params - read, params, note)
        if why and why != "torch is not loaded":
            reasons.setdefault(why, []).append(r)
    return ["parameters' NaN/Inf: %s on %s" % (why, who(rs)) for why, rs in sorted(reasons.items())]
