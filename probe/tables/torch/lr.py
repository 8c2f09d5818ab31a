"""Changing the learning rate so that it sticks (``probe TARGET lr``), reading it back, and the warning
an eval gets when it sets a group's ``lr`` that a scheduler will set back.

A scheduler such as ``LambdaLR`` (Hugging Face's Trainer makes one) computes each step's lr from its
own ``base_lrs``: a group's ``lr`` set alone is undone at its next step. So a change here scales, for
each group it touches, everything the schedule is made from by one factor: the group's ``lr`` and
``initial_lr`` (OneCycleLR: ``max_lr``, ``min_lr``), and each driving scheduler's ``base_lrs`` (timm:
``base_values``; CyclicLR: ``max_lrs``; DeepSpeed's: what each computes lr from, its ``min_lrs`` too) and
``_last_lr``. The factor is ``VALUE / lr`` (the lr is VALUE
now, and the schedule goes on from there, in proportion), or with ``base=True`` ``VALUE / base_lr``
(the scheduler's base becomes VALUE, and the lr follows its schedule from that base). Floors such as
``eta_min`` and ReduceLROnPlateau's ``min_lrs`` are left as they are.

:func:`change` runs on the training thread right after an optimizer step (the CLI sends it with the
eval placement ``step``); :func:`readback` after the next one. Each answers a JSON-ready dict; a
problem is ``{"error": {"code", "message", "hint"}}`` with the code of a probe error. Runs in the
target: stdlib only, torch from ``sys.modules``.
"""

import itertools
import json
import math
import re
import sys
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

from probe.errors import ProbeError
from probe.tables.torch import schedulers as sched
from probe.tables.torch._common import number, torch_or_raise
from probe.tables.torch.discovery import find_optimizers
from probe.tables.torch.optimizers import step_of_params

__all__ = ["plan", "change", "readback", "answer", "watch_before", "watch_after"]

_KEEP = 16  # changes remembered for their read-back
_lock = threading.Lock()
_changes: Dict[int, Dict[str, Any]] = {}
_tokens = itertools.count(1)


class _Refused(Exception):
    def __init__(self, code: str, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.code, self.message, self.hint = code, message, hint


def answer(what: str, *args: Any) -> str:
    """``plan``, ``change`` or ``readback`` as one JSON text (what the CLI's snippet prints)."""
    work = {"plan": plan, "change": change, "readback": readback}[what]
    try:
        result = work(*args)
    except _Refused as refused:
        result = {"error": {"code": refused.code, "message": refused.message, "hint": refused.hint}}
    except ProbeError as exc:
        result = {"error": {"code": exc.code, "message": exc.message, "hint": exc.hint or ""}}
    return json.dumps(result, default=repr)


def plan(value: float, groups: Optional[Sequence[int]] = None, optimizer: Optional[str] = None,
         base: bool = False) -> Dict[str, Any]:
    """What :func:`change` would do now, changing nothing: the errors come before any wait for a step."""
    return _work(value, groups, optimizer, base, apply=False)


def change(value: float, groups: Optional[Sequence[int]] = None, optimizer: Optional[str] = None,
           base: bool = False) -> Dict[str, Any]:
    """Set the lr of ``groups`` (all when None) of the optimizer named ``optimizer`` (the only one when
    None) so that it sticks; what it changed, before and after, and a ``token`` for :func:`readback`."""
    return _work(value, groups, optimizer, base, apply=True)


def readback(token: int) -> Dict[str, Any]:
    """The lr of the changed groups now, and whether the change held (``stuck``), ``undone`` or ``unchanged``."""
    with _lock:
        record = _changes.get(token)
    optimizer = record["optimizer"]() if record else None
    if optimizer is None:
        raise _Refused("not_found", "the optimizer that was changed is gone (or the change is too old to read back)")
    torch = torch_or_raise()
    groups = optimizer.param_groups
    drivers = [d for d in (r() for r in record["drivers"]) if d is not None]
    out = []
    for index, made in record["groups"].items():
        group = groups[index] if index < len(groups) else {}
        lr = number(torch, group.get("lr"))
        base_now = _first_base(torch, drivers, index)
        verdict = _verdict(made["before"], made["set"], lr, made.get("base_set"), base_now)
        out.append({"group": index, "lr": lr, "base_lr": base_now, "set": made["set"], "before": made["before"],
                    "verdict": verdict})
    return {"groups": out, "step": _step_of(torch, optimizer), "scheduler_step": _scheduler_step(drivers),
            "stuck": all(g["verdict"] in ("stuck", "unchanged") for g in out)}


# -- the change ---------------------------------------------------------------------------------------

def _work(value: Any, groups: Optional[Sequence[int]], name: Optional[str], base: bool,
          apply: bool) -> Dict[str, Any]:
    torch = torch_or_raise()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise _Refused("bad_request", "the learning rate must be a finite number of 0 or more, not %r" % (value,))
    value = float(value)
    opt_name, optimizer = _choose(torch, name)
    param_groups = optimizer.param_groups
    chosen = _groups(param_groups, groups, opt_name)
    drivers = sched.drivers_of(optimizer, sched.find_schedulers([optimizer]))
    factors: Dict[int, float] = {}
    for index in chosen:
        factors[index] = _factor(torch, param_groups[index], index, value, base, drivers, opt_name)
    if groups is None and len(chosen) > 1:
        _refuse_different(torch, param_groups, chosen, base, drivers)
    rows = []
    for index in chosen:
        group = param_groups[index]
        before = _group_values(torch, group, drivers, index)
        if apply:  # without a scheduler, or asked for the lr itself: it is exactly VALUE
            _scale(torch, group, index, factors[index], drivers, None if base and drivers else value)
        after = _group_values(torch, group, drivers, index) if apply else None
        rows.append({"group": index, "factor": factors[index], "before": before, "after": after})
    out: Dict[str, Any] = {
        "optimizer": opt_name, "class": sched.class_text(optimizer), "value": value,
        "mode": "base" if base else "lr", "groups": rows, "step": _step_of(torch, optimizer),
        "schedulers": [{"name": d.name, "class": sched.class_text(d.scheduler), "kind": sched.kind_of(d.scheduler),
                        "via": d.via, "note": sched.note_for(d),
                        "step": sched.step_count(d.scheduler)} for d in drivers],
    }
    if apply:
        out["token"] = _remember(optimizer, drivers, rows)
    return out


def _choose(torch: Any, name: Optional[str]) -> Tuple[str, Any]:
    found = _distinct(find_optimizers(torch))
    names = ", ".join(n for n, _ in found)
    if name is not None:
        for found_name, optimizer in found:
            if found_name == name:
                return found_name, optimizer
        raise _Refused("not_found", "no optimizer named %r%s" % (name, " (found: %s)" % names if found else ""),
                       "the names are those of torch.optimizers' optimizer column")
    if not found:
        raise _Refused("not_found", "no optimizer found in the target",
                       "keep it where probe looks (a global, a trainer's attribute, a local of the training "
                       "function), or register it in the script with probe.watch(optimizer)")
    if len(found) > 1:
        raise _Refused("bad_request", "%d optimizers found (%s): say which with --optimizer NAME" % (len(found), names))
    return found[0]


def _distinct(found: List[Tuple[str, Any]]) -> List[Tuple[str, Any]]:
    """One entry per set of param groups: a wrapper and the optimizer it wraps share theirs."""
    out, seen = [], set()
    for name, optimizer in found:
        groups = sched.param_groups_of(optimizer)
        if groups is None or id(groups) in seen:
            continue
        seen.add(id(groups))
        out.append((name, optimizer))
    return out


def _groups(param_groups: List[Any], groups: Optional[Sequence[int]], name: str) -> List[int]:
    if groups is None:
        return list(range(len(param_groups)))
    for index in groups:
        if not isinstance(index, int) or not 0 <= index < len(param_groups):
            raise _Refused("bad_request", "group %s is out of range: %s has %d param group%s (0 to %d)"
                           % (index, name, len(param_groups), "" if len(param_groups) == 1 else "s",
                              len(param_groups) - 1))
    return sorted(set(groups))


def _readable(torch: Any, value: Any, what: str) -> Optional[float]:
    if value is None:
        return None
    read = number(torch, value)
    if read is None:
        raise _Refused("bad_request", "%s is a %s, which probe does not read (it would synchronise the device)"
                       % (what, getattr(getattr(value, "device", None), "type", type(value).__name__)))
    return read


def _factor(torch: Any, group: Dict[str, Any], index: int, value: float, base: bool, drivers: List[Any],
            name: str) -> float:
    lr = _readable(torch, group.get("lr"), "group %d's lr" % index)
    if lr is None:
        raise _Refused("bad_request", "group %d of %s has no lr" % (index, name))
    for driver in drivers:  # everything that will be scaled must be readable first: nothing half done
        for values in _lists(driver.scheduler):
            if index < len(values):
                _readable(torch, values[index], "a base value of %s" % driver.name)
    for key in ("initial_lr", "max_lr", "min_lr"):
        _readable(torch, group.get(key), "group %d's %s" % (index, key))
    reference = lr
    if base and drivers:
        own = sched.base_of(drivers[0].scheduler, index)  # ReduceLROnPlateau has none: its base is the lr
        reference = lr if own is None else (_readable(torch, own, "the base value") or 0.0)
    if reference == 0:
        if not drivers:
            return 0.0  # no schedule: lr is simply set
        raise _Refused("bad_request", "group %d's %s is 0 now, so the schedule cannot be scaled to %g"
                       % (index, "base lr" if base else "lr", value),
                       "" if base else "give --base to set the scheduler's base value instead (a warmup starts at 0)")
    return value / reference


def _refuse_different(torch: Any, param_groups: List[Any], chosen: List[int], base: bool, drivers: List[Any]) -> None:
    values = []
    for index in chosen:
        value = sched.base_of(drivers[0].scheduler, index) if base and drivers else None
        value = param_groups[index].get("lr") if value is None else value
        values.append(number(torch, value))
    if any(v is None or abs(v - values[0]) > 1e-12 * max(abs(values[0]), 1e-300) for v in values[1:]):
        shown = ", ".join("group %d: %g" % (i, v) for i, v in zip(chosen, values) if v is not None)
        raise _Refused("bad_request", "the groups' %s differ (%s): setting them all to one value would flatten them"
                       % ("base lr" if base else "lr", shown), "name the groups to change with --group N (repeatable)")


def _lists(scheduler: Any, seen: Optional[set] = None) -> List[List[Any]]:
    """The per-group lists of ``scheduler`` (and of the schedulers it chains) that the schedule is made from."""
    seen = set() if seen is None else seen
    if id(scheduler) in seen:
        return []
    seen.add(id(scheduler))
    attrs = sched.attrs_of(scheduler)
    keys = ("base_lrs", "base_values", "max_lrs", "_last_lr") + tuple(sched.deepspeed_lists(scheduler))
    out = [attrs[k] for k in keys if isinstance(attrs.get(k), list)]
    for child in attrs.get("_schedulers") or ():
        out += _lists(child, seen)
    unique, ids = [], set()
    for values in out:
        if id(values) not in ids:
            ids.add(id(values))
            unique.append(values)
    return unique


def _scale(torch: Any, group: Dict[str, Any], index: int, factor: float, drivers: List[Any],
           exact: Optional[float]) -> None:
    """Multiply what the schedule of group ``index`` is made from by ``factor``; the group's lr becomes
    ``exact`` when given (no rounding), else lr * factor."""
    scheduled = bool(drivers)
    for key in ("initial_lr", "max_lr", "min_lr"):
        if key in group and (scheduled or key == "initial_lr"):
            _put(torch, group, key, exact if not scheduled and exact is not None else number(torch, group[key]) * factor)
    lists: List[List[Any]] = []
    for driver in drivers:
        lists += [v for v in _lists(driver.scheduler) if not any(v is w for w in lists)]
    for values in lists:
        if index < len(values):
            _put(torch, values, index, number(torch, values[index]) * factor)
    _put(torch, group, "lr", exact if exact is not None else number(torch, group["lr"]) * factor)


def _put(torch: Any, container: Any, key: Any, value: float) -> None:
    old = container[key]
    if isinstance(old, torch.Tensor):
        old.fill_(value)  # as torch's schedulers do: the tensor may be captured by a compiled step
    else:
        container[key] = value


def _group_values(torch: Any, group: Dict[str, Any], drivers: List[Any], index: int) -> Dict[str, Any]:
    out = {"lr": number(torch, group.get("lr")), "initial_lr": number(torch, group.get("initial_lr"))}
    if drivers:
        out["base_lr"] = _first_base(torch, [d.scheduler for d in drivers], index)
    return out


def _first_base(torch: Any, drivers: List[Any], index: int) -> Optional[float]:
    for driver in drivers:
        value = sched.base_of(getattr(driver, "scheduler", driver), index)
        if value is not None:
            return number(torch, value)
    return None


def _remember(optimizer: Any, drivers: List[Any], rows: List[Dict[str, Any]]) -> int:
    refs = []
    for driver in drivers:
        try:
            refs.append(weakref.ref(driver.scheduler))
        except TypeError:
            pass
    made = {row["group"]: {"before": row["before"]["lr"], "set": row["after"]["lr"],
                           "base_set": row["after"].get("base_lr")} for row in rows}
    with _lock:
        token = next(_tokens)
        _changes[token] = {"optimizer": weakref.ref(optimizer), "drivers": refs, "groups": made}
        while len(_changes) > _KEEP:
            _changes.pop(min(_changes))
    return token


def _verdict(before: Optional[float], made: Optional[float], now: Optional[float], base_set: Optional[float],
             base_now: Optional[float]) -> str:
    """``unchanged`` (the value was already that), ``stuck`` (nearer what was set than what was there,
    and the scheduler's base still what was set), ``undone``, or ``unknown`` (not readable)."""
    if before is None or made is None or now is None:
        return "unknown"
    if _distance(before, made) < 1e-9:
        return "unchanged"
    if base_set is not None and base_now is not None and _distance(base_set, base_now) > 1e-9:
        return "undone"
    return "stuck" if _distance(now, made) < _distance(now, before) else "undone"


def _distance(a: float, b: float) -> float:
    """How far apart two rates are, as a ratio (on a log scale); infinite when one only is 0."""
    if a == b:
        return 0.0
    if a <= 0 or b <= 0:
        return math.inf
    return abs(math.log(a / b))


def _scheduler_step(drivers: List[Any]) -> Optional[int]:
    return sched.step_count(drivers[0]) if drivers else None


def _step_of(torch: Any, optimizer: Any) -> Optional[int]:
    """The optimizer's own step count (Adam's state 'step'), where it keeps one."""
    state = getattr(optimizer, "state", None)
    return step_of_params(torch, state, [p for group in optimizer.param_groups for p in list(group.get("params", ()))[:8]])


# -- the warning of an eval that sets lr under a scheduler ---------------------------------------------

_MENTIONS = re.compile(r"\blr\b|param_groups")


def watch_before(code: str) -> Optional[List[Tuple[str, Any, List[Tuple[Dict[str, Any], Any]]]]]:
    """Before a snippet that mentions lr or param_groups: each optimizer's groups and their lr (cheap: no
    scheduler is looked for unless an lr changes). None when there is nothing to watch."""
    if "torch.optim" not in sys.modules or not _MENTIONS.search(code) or "base_lrs" in code or __name__ in code:
        return None
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    snapshot = []
    for name, optimizer in _distinct(find_optimizers(torch)):
        snapshot.append((name, optimizer, [(g, number(torch, g.get("lr"))) for g in list(optimizer.param_groups)]))
    return snapshot


def watch_after(snapshot: Optional[List[Tuple[str, Any, List[Tuple[Dict[str, Any], Any]]]]]) -> str:
    """A warning line for each optimizer whose group lr the snippet changed where a scheduler will set it
    back (the scheduler's own last value differs from the group's: the snippet, not the scheduler, set it)."""
    if not snapshot:
        return ""
    torch = sys.modules.get("torch")
    changed = []
    for name, optimizer, groups in snapshot:
        moved = []
        for index, (group, before) in enumerate(groups):
            now = number(torch, group.get("lr"))
            if before is not None and now is not None and now != before:
                moved.append((index, before, now))
        if moved:
            changed.append((name, optimizer, moved))
    if not changed:
        return ""
    drivers = sched.find_schedulers([optimizer for _, optimizer, _ in changed])
    lines = []
    for name, optimizer, moved in changed:
        for driver in sched.drivers_of(optimizer, drivers):
            if sched.kind_of(driver.scheduler) == "lr":
                continue
            last = sched.attrs_of(driver.scheduler).get("_last_lr")
            undone = [(i, b, n) for i, b, n in moved
                      if not (isinstance(last, list) and i < len(last) and number(torch, last[i]) == n)]
            if not undone:
                continue  # the scheduler itself set these (it stepped while the snippet ran)
            shown = ", ".join("group %d: %g -> %g" % m for m in undone[:4])
            lines.append("probe: warning: the snippet set lr of %s (%s), but its scheduler %s (%s) sets lr from its "
                         "base values at every step, so this is undone at its next step; `probe TARGET lr %g` "
                         "changes base_lrs and initial_lr too, so that it sticks\n"
                         % (name, shown, driver.name, sched.torch_class(driver.scheduler)
                            or type(driver.scheduler).__name__, undone[0][2]))
            break
    return "".join(lines)
