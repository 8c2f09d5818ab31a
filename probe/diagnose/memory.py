"""The memory verdicts of ``probe diagnose``: growth over the looks, and the OOM killer for a dead rank.

Evidence, per rank and per look (:func:`gather`; reads only, bounded):

* one query, the process's RSS (``process.info``), kept with the readings of the earlier looks of this
  diagnose run (and of earlier rounds of ``--watch``): a slope over several readings, not one;
* once a reading is well above the one before, once per process: where its memory is (``torch.memory``:
  the live CPU tensors' bytes, the CUDA caching allocator's allocated and reserved bytes) and its largest
  holders (``torch.tensors`` grouped by kind, owner, shape): two scans of the garbage collector's objects,
  each bounded by the table's own budget; at the next look ``torch.memory`` once more, to see whether the
  live tensors grew with RSS (a program's RSS also rises for seconds and falls back as the allocator keeps
  and returns freed memory: over a few seconds that looks like a leak, tensors that grow do not);
* while RSS goes on rising (``--watch``), the largest holders again every ``HOLDERS_AGAIN_S``: where the
  largest grew since the first reading, the growth is said to be there;
* for a dead process of this host: the kernel log's line of the OOM killer naming its pid (where
  ``dmesg`` is readable), and its cgroup's ``memory.events`` ``oom_kill`` counter.
"""

import os
import re
import subprocess
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["gather", "judge", "unavailable", "rising", "oom_evidence"]

MB = 1024 * 1024
RISE_TRIGGER = 8 * MB  # a reading this far above the one before: look again, and read where the memory is
GROWTH_FLOOR = 16 * MB  # growth is said only above this over the readings ...
MIN_READINGS = 3  # ... over at least this many readings ...
MIN_SPAN_S = 2.0  # ... spanning this long, each above the one before
LONG_SPAN_S = 10.0  # RSS alone is growth only over this long; shorter, the live tensors must grow with it:
TENSOR_SHARE = 0.25  # ... by this share of RSS's rise between the two readings of the tensors ...
TENSOR_FLOOR = 4 * MB  # ... and at least this much
HOLDERS_AGAIN_S = 5.0  # while RSS rises, the largest holders are read again at most this often (a garbage collector
HOLDER_FLOOR = 1 * MB  # scan); the largest grew by this much, and by more tensors, since the first reading: it is there
RSS_SQL = "SELECT rss FROM process.info"
PYTHON_SQL = "SELECT python_traced_bytes FROM process.info"
SPLIT_SQL = "SELECT device, allocated_bytes, reserved_bytes, rss_bytes, tensors, complete FROM torch.memory"
HOLDERS_SQL = """\
SELECT kind, owner, shape, device, requires_grad, n, bytes FROM (
  SELECT kind, owner, shape, device, requires_grad, count(*) AS n, CAST(sum(bytes) AS BIGINT) AS bytes
  FROM torch.tensors GROUP BY ALL)
QUALIFY row_number() OVER (ORDER BY bytes DESC) <= 4 OR row_number() OVER (ORDER BY n DESC) <= 2
ORDER BY bytes DESC LIMIT 6"""

_HISTORY: Dict[Tuple[str, Optional[int], int], List[Tuple[float, int]]] = {}
_SPLIT: Dict[Tuple[str, Optional[int], int], Dict[str, Any]] = {}
_TENSORS: Dict[Tuple[str, Optional[int], int], List[Tuple[float, int, int]]] = {}  # (when, CPU tensors, RSS)


def _cpu_tensors(rows: Any) -> Optional[int]:
    """The live CPU tensors' bytes of a ``torch.memory`` reading, where the scan was complete."""
    row = next((r for r in rows or () if r.get("device") == "cpu"), None)
    if row is None or row.get("complete") is False or not isinstance(row.get("allocated_bytes"), int):
        return None
    return int(row["allocated_bytes"])


def gather(client: Any, ev: Any, query: Callable[[Any, str], List[Dict[str, Any]]]) -> None:
    """This look's memory evidence into ``ev.memory``; never raises."""
    from probe.errors import ProbeError

    out: Dict[str, Any] = {}
    key = (ev.host, ev.pid, ev.rank)
    if ev.state == "dead":
        if client.target.is_local and ev.pid is not None:
            out["oom"] = oom_evidence(ev.pid)
        ev.memory = out
        return
    if ev.state != "answering":
        return
    try:
        rows = query(client, RSS_SQL)
        rss = rows[0]["rss"] if rows else None
    except ProbeError as exc:
        out["why"] = exc.message
        rss = None
    history = _HISTORY.setdefault(key, [])
    if isinstance(rss, int):
        history.append((time.monotonic(), rss))
        del history[:-30]
        torch = ev.fr_why != "torch is not loaded"
        if len(history) >= 2 and rss - history[-2][1] >= RISE_TRIGGER and key not in _SPLIT and torch:
            split: Dict[str, Any] = {}
            for name, sql in (("split", SPLIT_SQL), ("holders", HOLDERS_SQL), ("python", PYTHON_SQL)):
                try:
                    split[name] = query(client, sql)
                except ProbeError as exc:
                    split[name + "_why"] = exc.message
            split["holders_at"] = time.monotonic()
            _SPLIT[key] = split
            _tensors_reading(key, split.get("split"), rss)
        elif key in _SPLIT and len(_TENSORS.get(key, ())) == 1 and torch:  # the look after: did the tensors grow?
            try:
                rows = query(client, SPLIT_SQL)
                _SPLIT[key]["split"] = rows
                _tensors_reading(key, rows, rss)
            except ProbeError:
                pass
        elif (key in _SPLIT and _SPLIT[key].get("holders") and torch and rss > history[-2][1]
              and time.monotonic() - _SPLIT[key]["holders_at"] >= HOLDERS_AGAIN_S):
            _holders_again(client, _SPLIT[key], query)
    out["readings"] = list(history)
    out.update(_SPLIT.get(key, {}))
    if key in _TENSORS:
        out["tensors"] = list(_TENSORS[key])
    ev.memory = out


def _holders_again(client: Any, split: Dict[str, Any], query: Callable[[Any, str], List[Dict[str, Any]]]) -> None:
    """The largest holders read again while RSS goes on rising (at most every ``HOLDERS_AGAIN_S``), beside
    the first reading: whether the largest holder grew over that time (:func:`_holder_growth`)."""
    from probe.errors import ProbeError

    try:
        rows = query(client, HOLDERS_SQL)
    except ProbeError:
        return
    split.setdefault("holders_before", split["holders"])
    split["holders"], split["holders_at"] = rows, time.monotonic()


def forget(key: Tuple[str, Optional[int], int]) -> None:
    """Forget one rank's readings (``probe.diagnose.evidence.forget``)."""
    for kept in (_HISTORY, _SPLIT, _TENSORS):
        kept.pop(key, None)


def _tensors_reading(key: Tuple[str, Optional[int], int], rows: Any, rss: int) -> None:
    value = _cpu_tensors(rows)
    if value is not None:
        _TENSORS.setdefault(key, []).append((time.monotonic(), value, rss))


def oom_evidence(pid: int) -> Dict[str, Any]:
    """What this host says of an OOM kill of ``pid``: the kernel log's line, the cgroup's oom_kill counter."""
    out: Dict[str, Any] = {}
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=2).stdout
        pattern = re.compile(r"(Killed process %d\b|oom-kill:.*\bpid=%d\b)" % (pid, pid))
        lines = [line.strip() for line in log.splitlines() if pattern.search(line)]
        if lines:
            out["kernel_log"] = lines[-1][:300]
    except (OSError, subprocess.SubprocessError):
        pass
    for source in ("/proc/%d/cgroup" % pid, "/proc/self/cgroup"):
        try:
            with open(source) as handle:
                path = next((line.split(":", 2)[2].strip() for line in handle if line.startswith("0::")), None)
        except OSError:
            continue
        if path is None:
            continue
        events = os.path.join("/sys/fs/cgroup", path.lstrip("/"), "memory.events")
        try:
            with open(events) as handle:
                counters = dict(line.split() for line in handle if len(line.split()) == 2)
            out["cgroup"] = path
            out["oom_kill"] = int(counters.get("oom_kill", 0))
            out["cgroup_is_its_own"] = source != "/proc/self/cgroup"
        except (OSError, ValueError):
            pass
        break
    return out


# -- judging ------------------------------------------------------------------------------------------


def _readings(ev: Any) -> List[Tuple[float, int]]:
    return list((getattr(ev, "memory", None) or {}).get("readings") or [])


def rising(first: Any, last: Any) -> bool:
    """Whether some rank's last reading is well above the one before: then look longer before judging."""
    for ev in last.ranks.values():
        readings = _readings(ev)
        if len(readings) >= 2 and readings[-1][1] - readings[-2][1] >= RISE_TRIGGER:
            return True
    return False


def _slope(readings: List[Tuple[float, int]]) -> float:
    n = len(readings)
    mt = sum(t for t, _ in readings) / n
    mv = sum(v for _, v in readings) / n
    den = sum((t - mt) ** 2 for t, _ in readings)
    return sum((t - mt) * (v - mv) for t, v in readings) / den if den else 0.0


def _growth(readings: List[Tuple[float, int]]) -> Optional[Dict[str, float]]:
    """RSS growth over the readings, or None where they do not show a steady rise."""
    if len(readings) < 2 or readings[-1][1] - readings[0][1] < GROWTH_FLOOR:
        return None
    return {"rise": readings[-1][1] - readings[0][1], "span": readings[-1][0] - readings[0][0],
            "slope": _slope(readings), "n": len(readings),
            "steady": all(b[1] > a[1] for a, b in zip(readings, readings[1:]))}


def _assess(ev: Any) -> Tuple[Optional[Dict[str, float]], str]:
    """A rank's RSS growth and what it amounts to: ``tensors`` (a steady rise, and the live CPU tensors grew
    with it), ``long`` (a steady rise over ``LONG_SPAN_S`` or more, whatever the tensors did), ``short`` (a
    steady rise too short to tell from the allocator's keeping of freed memory, the tensors not growing or
    not known), ``few`` (too few readings), or ``""`` (no growth)."""
    growth = _growth(_readings(ev))
    if growth is None:
        return None, ""
    if growth["n"] < MIN_READINGS or growth["span"] < MIN_SPAN_S:
        return growth, "few"
    if not growth["steady"]:
        return growth, ""
    since = _readings(ev)[0][0]  # tensors read before these readings (an earlier record's) say nothing of them
    tensors = [t for t in (getattr(ev, "memory", None) or {}).get("tensors") or [] if t[0] >= since]
    if len(tensors) >= 2:
        (t1, b1, r1), (t2, b2, r2) = tensors[0], tensors[-1]
        growth.update(tensors=b2 - b1, tensors_rss=r2 - r1, tensors_span=t2 - t1)
        # RSS's rise between the two readings, or its steady pace over as long, whichever is less: a rise
        # between two looks may hold a one-time jump (the agent's first query loads DuckDB: tens of MB)
        paced = min(r2 - r1, max(0.0, growth["slope"]) * (t2 - t1))
        if b2 - b1 >= max(TENSOR_FLOOR, TENSOR_SHARE * paced):
            return growth, "tensors"
    if _holder_growth(ev) is not None:
        return growth, "tensors"
    return growth, "long" if growth["span"] >= LONG_SPAN_S else "short"


def _holder_key(h: Dict[str, Any]) -> Tuple[Any, ...]:
    return (h.get("kind"), h.get("owner"), str(h.get("shape")), h.get("device"), h.get("requires_grad"))


def _holder_growth(ev: Any) -> Optional[Tuple[Dict[str, Any], Dict[str, Any]]]:
    """The largest holder of the last reading of ``torch.tensors`` and its row at the reading before, where
    it grew between them by ``TENSOR_FLOOR`` or more: then the growth is there, whatever RSS did."""
    memory = getattr(ev, "memory", None) or {}
    now, before = memory.get("holders") or [], memory.get("holders_before") or []
    if not now or not before:
        return None
    top = max(now, key=lambda h: h.get("bytes") or 0)
    old = next((h for h in before if _holder_key(h) == _holder_key(top)), {"n": 0, "bytes": 0})
    if (top.get("bytes") or 0) - (old.get("bytes") or 0) < HOLDER_FLOOR or (top.get("n") or 0) <= (old.get("n") or 0):
        return None
    return top, old


def _mb(value: Any) -> str:
    return "%.0f MB" % (value / MB) if isinstance(value, (int, float)) else "?"


def judge(first: Any, last: Any, answering: List[int], verdicts: List[Any], who: Callable[[Sequence[int]], str],
          command: Any) -> List[Any]:
    from probe.diagnose.verdict import Evidence, Verdict

    out = []
    for r in answering:
        ev = last.ranks[r]
        growth, kind = _assess(ev)
        if growth is None or kind not in ("tensors", "long"):
            continue
        memory = ev.memory or {}
        readings = _readings(ev)
        rss_now = readings[-1][1]
        summary = "memory grows on %s: RSS +%s in %.1f s (%.1f MB/s over %d looks), now %s" % (
            who([r]), _mb(growth["rise"]), growth["span"], growth["slope"] / MB, growth["n"], _mb(rss_now))
        evidence = [Evidence("RSS at each look: %s" % ", ".join(_mb(v) for _, v in readings[-8:]),
                             command([r], "query \"SELECT rss FROM process.info\""), [r],
                             [{"seconds": round(t - readings[0][0], 2), "rss": v} for t, v in readings])]
        grown = _holder_growth(ev)
        if "tensors" in growth:
            summary += ("; torch CPU tensors grew with it (%+.0f MB in %.1f s)" % (
                growth["tensors"] / MB, growth["tensors_span"]) if kind == "tensors" else "; not in torch CPU tensors")
            seen = [t for t in memory["tensors"] if t[0] >= readings[0][0]]
            text = "torch CPU tensors at two looks %.1f s apart: %s -> %s, while RSS rose %+.0f MB" % (
                growth["tensors_span"], _mb(seen[0][1]), _mb(seen[-1][1]), growth["tensors_rss"] / MB)
            if kind != "tensors":
                text += ": the growth is elsewhere (Python objects, native memory), steady over %.0f s" % growth["span"]
            evidence.append(Evidence(text, command([r], "query \"SELECT device, allocated_bytes, rss_bytes FROM "
                                                        "torch.memory\""), [r],
                                     [{"seconds": round(t - seen[0][0], 2), "cpu_tensor_bytes": b, "rss": v}
                                      for t, b, v in seen]))
        split = memory.get("split") or []
        cpu = next((row for row in split if row.get("device") == "cpu"), None)
        if cpu is not None:
            tensors = cpu.get("allocated_bytes") or 0
            parts = ["torch CPU tensors %s" % _mb(tensors)]
            for row in split:
                if row.get("device") != "cpu":
                    parts.append("%s allocator: %s allocated, %s reserved (device memory, not in RSS)" % (
                        row.get("device"), _mb(row.get("allocated_bytes")), _mb(row.get("reserved_bytes"))))
            python = next((row.get("python_traced_bytes") for row in memory.get("python") or ()), None)
            if isinstance(python, int):
                parts.append("Python's allocators %s (tracemalloc)" % _mb(python))
                parts.append("the rest %s (autograd graphs' saved tensors, allocator arenas, native libraries)"
                             % _mb(max(0, (cpu.get("rss_bytes") or rss_now) - tensors - python)))
            else:
                parts.append("the rest %s (Python objects, autograd graphs' saved tensors, allocator arenas, native "
                             "libraries; Python objects are counted where the job runs with PYTHONTRACEMALLOC=1)"
                             % _mb(max(0, (cpu.get("rss_bytes") or rss_now) - tensors)))
            evidence.append(Evidence("where it is: RSS %s = %s" % (_mb(cpu.get("rss_bytes") or rss_now),
                                                                   "; ".join(parts)),
                                     command([r], "query \"SELECT * FROM torch.memory\""), [r], split))
        elif memory.get("split_why"):
            evidence.append(Evidence("where it is: not known (%s)" % memory["split_why"], None, [r]))
        holders = memory.get("holders") or []
        if holders:
            graphs = [h for h in holders if h.get("kind") == "tensor" and h.get("requires_grad") and (h.get("n") or 0) >= 50]
            top = sorted(holders, key=lambda h: -(h.get("bytes") or 0))[:3]
            text = "; ".join("%s %s %s x%s %s" % (h.get("kind"), h.get("owner") or "", h.get("shape"), h.get("n"),
                                                   _mb(h.get("bytes"))) for h in top)
            if grown is not None:
                h, before = grown
                summary += "; it grows in its largest holder: %s, %s -> %s tensors, %s -> %s" % (
                    " ".join(str(w) for w in (h.get("kind"), h.get("owner"), h.get("shape")) if w), before.get("n"),
                    h.get("n"),
                    _mb(before.get("bytes")), _mb(h.get("bytes")))
                if h.get("requires_grad") and h.get("kind") == "tensor":
                    summary += " (with requires_grad, not parameters: each keeps its autograd graph and the " \
                               "activations it saved)"
            elif graphs:
                g = max(graphs, key=lambda h: h.get("n") or 0)
                summary += "; largest holder: %d tensors %s with requires_grad (not parameters), each keeping its " \
                           "autograd graph and the activations it saved" % (g.get("n"), g.get("shape"))
                text = "%d tensors of shape %s with requires_grad (not parameters: results kept with their autograd " \
                       "graph, e.g. losses kept without .item() or .detach()); by bytes: %s" % (g.get("n"), g.get("shape"), text)
            else:
                summary += "; largest holder: %s" % text.split(";")[0]
            evidence.append(Evidence("torch.tensors by kind, owner and shape: %s" % text, command(
                [r], "query \"SELECT kind, owner, shape, requires_grad, count(*) AS n, sum(bytes) AS bytes FROM "
                     "torch.tensors GROUP BY ALL ORDER BY bytes DESC LIMIT 10\""), [r], holders))
        elif memory.get("holders_why"):
            evidence.append(Evidence("its largest holders: not known (%s)" % memory["holders_why"], None, [r]))
        out.append(Verdict("memory_growth", "degraded", summary, [r], [], None, evidence, [
            "watch it go on: %s" % command([r], "diagnose --watch 10"),
            "what holds the tensors: %s" % command([r], "query \"SELECT * FROM torch.tensors ORDER BY bytes DESC "
                                                        "LIMIT 20\"")]))
    for verdict in verdicts:  # a dead rank: the OOM killer, where this host's records say so
        if verdict.kind != "dead":
            continue
        for r in verdict.culprits:
            oom = ((getattr(last.ranks.get(r), "memory", None) or {}).get("oom")) or {}
            if oom.get("kernel_log"):
                verdict.summary += " (the OOM killer, by the kernel log)"
                verdict.evidence.append(Evidence("kernel log: %s" % oom["kernel_log"], "dmesg | grep -i oom", [r]))
            elif oom.get("oom_kill") and "signal 9" in (last.ranks[r].why or ""):
                verdict.evidence.append(Evidence(
                    "%s cgroup %s: memory.events counts oom_kill %d: the OOM killer has killed in it (SIGKILL, as "
                    "this rank got)" % ("its" if oom.get("cgroup_is_its_own") else "this host's (probe's own)",
                    oom.get("cgroup"), oom["oom_kill"]), "cat /sys/fs/cgroup%s/memory.events" % oom.get("cgroup"),
                    [r], [oom]))
    return out


def unavailable(last: Any, answering: List[int], who: Callable[[Sequence[int]], str]) -> List[str]:
    out = []
    for r in answering:
        growth, kind = _assess(last.ranks[r])
        if kind == "few":
            out.append("memory growth: not enough samples: RSS +%s in %.1f s over %d looks on %s (`diagnose --watch "
                       "5` looks again)" % (_mb(growth["rise"]), growth["span"], growth["n"], who([r])))
        elif kind == "short":
            tensors = ("its torch CPU tensors did not grow with it (%+.0f MB)" % (growth["tensors"] / MB)
                       if "tensors" in growth else "its torch CPU tensors not read twice")
            out.append("memory growth: RSS +%s in %.1f s on %s, but %s: too short a look to tell a leak from the "
                       "allocator keeping freed memory (`diagnose --watch 5` looks for longer)" % (
                           _mb(growth["rise"]), growth["span"], who([r]), tensors))
    return out
