"""What a finished capture of ``torch.profiler`` becomes: rows of ``torch.profile`` (ops summed per step)
and trace events for one Chrome/Perfetto file (``probe.tables.torch.profile``).

Both are built on the agent's thread when first asked for, never on the training thread. Runs in the
target: stdlib only here; the profiler object comes from the target's own torch.
"""

import bisect
import json
import os
import tempfile
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["summed_rows", "trace_events", "is_communication", "MAX_ROWS_PER_STEP", "STACK_FRAMES"]

MAX_ROWS_PER_STEP = 500
"""Ops (name, shapes, stack) kept per step, the ones with most self time; the rest are counted as cut."""
STACK_FRAMES = 8
"""Python frames kept of an op's stack (innermost first), with ``--stacks``."""
_STEP_PREFIX = "ProfilerStep"  # "ProfilerStep#k" in the trace, "ProfilerStep*" as an event: one a step, in order
_COMMUNICATION = ("nccl", "gloo", "c10d", "allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter",
                  "reducescatter", "broadcast", "barrier", "alltoall", "all_to_all", "send", "recv", "mpi:", "ucc")


def is_communication(name: str) -> bool:
    """Whether an op is a collective or point-to-point transfer (NCCL, Gloo, c10d), by its name."""
    low = name.lower()
    return any(word in low for word in _COMMUNICATION)


def _step_bounds(events: List[Any]) -> Tuple[List[float], List[float], List[int]]:
    """The ``ProfilerStep#k`` spans, sorted: their starts, ends (us) and numbers."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.name.startswith(_STEP_PREFIX))
    return [s[0] for s in spans], [s[1] for s in spans], list(range(len(spans)))


def _step_of(starts: List[float], ends: List[float], numbers: List[int], at: float) -> Optional[int]:
    i = bisect.bisect_right(starts, at) - 1
    if i >= 0 and at <= ends[i]:
        return numbers[i]
    return None


def summed_rows(events: List[Any], rank: int, first_step: int) -> Tuple[List[Tuple[Any, ...]], int]:
    """One row per (step, op, input shapes, stack): calls and times summed, as ``key_averages`` does per
    step; ops outside any step (a thread that began before the first step's mark) go under step NULL.
    At most ``MAX_ROWS_PER_STEP`` per step; returns the rows and how many were cut."""
    starts, ends, numbers = _step_bounds(events)
    sums: Dict[Tuple[Any, ...], List[float]] = {}
    for event in events:
        name = event.name
        if name.startswith(_STEP_PREFIX):
            continue
        step = _step_of(starts, ends, numbers, event.time_range.start)
        shapes = str(event.input_shapes) if getattr(event, "input_shapes", None) else None
        stack = "\n".join(list(event.stack)[:STACK_FRAMES]) if getattr(event, "stack", None) else None
        key = (step, name, shapes, stack)
        held = sums.get(key)
        if held is None:
            held = sums[key] = [0, 0.0, 0.0, 0.0, 0.0]
        held[0] += 1
        held[1] += event.self_cpu_time_total
        held[2] += event.cpu_time_total
        held[3] += getattr(event, "self_device_time_total", 0.0) or 0.0
        held[4] += getattr(event, "device_time_total", 0.0) or 0.0
    by_step: Dict[Any, List[Tuple[Any, ...]]] = {}
    for (step, name, shapes, stack), (calls, self_cpu, cpu, self_dev, dev) in sums.items():
        by_step.setdefault(step, []).append((
            rank, None if step is None else first_step + step, name,
            "communication" if is_communication(name) else "compute", int(calls), self_cpu / 1e6, cpu / 1e6,
            self_dev / 1e6, dev / 1e6, shapes, stack))
    out: List[Tuple[Any, ...]] = []
    cut = 0
    for step in sorted(by_step, key=lambda s: -1 if s is None else s):
        rows = sorted(by_step[step], key=lambda r: (-(r[5] + r[7]), r[2]))
        out.extend(rows[:MAX_ROWS_PER_STEP])
        cut += max(0, len(rows) - MAX_ROWS_PER_STEP)
    return out, cut


def trace_events(profiler: Any, rank: int, wall_us: float, max_events: int, max_bytes: int) -> Dict[str, Any]:
    """The capture's Chrome trace events, this rank as process ``rank`` ("rank N"), and the epoch (us since
    1970) that the events' ``ts`` count from, so that the client puts every rank on one clock. Kineto
    writes its events with ``baseTimeNanoseconds``: ts + base is wall-clock time; where it does not, the
    wall clock read as the capture began stands for its first event. At most ``max_events`` events and
    about ``max_bytes`` of JSON, the earliest kept; ``cut`` says how many went."""
    handle, path = tempfile.mkstemp(prefix="probe-profile-", suffix=".json")
    os.close(handle)
    try:
        profiler.export_chrome_trace(path)
        with open(path) as stream:
            data = json.load(stream)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    raw = data.get("traceEvents") or []
    timed = sorted((e for e in raw if isinstance(e, dict) and e.get("ph") != "M" and "ts" in e),
                   key=lambda e: float(e["ts"]))
    base_ns = data.get("baseTimeNanoseconds")
    if isinstance(base_ns, (int, float)) and base_ns > 0:
        epoch_us = base_ns / 1e3
    else:
        epoch_us = wall_us - (float(timed[0]["ts"]) if timed else 0.0)
    host_pid = os.getpid()
    out: List[Dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": "rank %d" % rank}},
        {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}}]
    for meta in raw:  # the host's threads keep their names
        if isinstance(meta, dict) and meta.get("ph") == "M" and meta.get("name") == "thread_name" \
                and meta.get("pid") == host_pid:
            out.append(dict({k: v for k, v in meta.items() if k != "ts"}, pid=rank))
    named = set()
    size, cut = 200, 0
    for event in timed:
        if len(out) >= max_events or size >= max_bytes:
            cut += 1
            continue
        event = dict(event)
        pid = event.get("pid")
        if not isinstance(pid, int):  # the profiler's own marker tracks ("Spans", "Traces")
            continue
        if pid != host_pid and isinstance(pid, int):  # a device's stream: its own track within the rank
            tid = 1_000_000 * (pid + 1) + (event.get("tid") if isinstance(event.get("tid"), int) else 0)
            if tid not in named:
                named.add(tid)
                out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                            "args": {"name": "device %s stream %s" % (pid, event.get("tid"))}})
            event["tid"] = tid
        event["pid"] = rank
        out.append(event)
        size += len(json.dumps(event)) + 2
    return {"traceEvents": out, "epoch_us": epoch_us, "cut": cut, "events": len(timed)}
