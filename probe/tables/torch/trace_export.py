"""The trace as Chrome trace-event JSON (Perfetto, chrome://tracing): one process per rank, one track per thread.

Every span is a complete event (``"ph": "X"``, microseconds); each step is one more event around its
spans on every track that has some, so steps and modules nest. Events of one track are sorted by start,
longer first at equal starts, which is the order viewers nest them in.
"""

from typing import Any, Dict, List, Optional, Tuple

__all__ = ["chrome_trace"]


def chrome_trace(columns: Dict[str, List[Any]], host: str = "",
                 thread_names: Optional[Dict[int, str]] = None) -> Dict[str, Any]:
    """``columns``: the rows of python.torch_trace as one list per column (see ``trace.columns``)."""
    events: List[Dict[str, Any]] = []
    steps: Dict[Tuple[int, int, int], List[float]] = {}
    n = len(columns["step"])
    for i in range(n):
        rank, tid, step = columns["rank"][i], columns["thread_id"][i], columns["step"][i]
        ts = float(columns["time"][i])
        dur = max(columns["host_duration"][i] * 1e6, 0.001)
        events.append({
            "name": columns["module"][i], "cat": columns["stage"][i], "ph": "X", "ts": ts, "dur": dur,
            "pid": rank, "tid": tid,
            "args": {"step": step, "seq": columns["seq"][i], "stage": columns["stage"][i],
                     "duration_s": columns["duration"][i], "allocated_mb": columns["allocated"][i],
                     "max_allocated_mb": columns["max_allocated"][i]},
        })
        begin = ts - columns["time_offset"][i] * 1e6
        bounds = steps.setdefault((rank, tid, step), [begin, ts + dur])
        bounds[0] = min(bounds[0], begin)
        bounds[1] = max(bounds[1], ts + dur)
    for (rank, tid, step), (begin, end) in steps.items():
        events.append({"name": "step %d" % step, "cat": "step", "ph": "X", "ts": begin, "dur": max(end - begin, 0.001),
                       "pid": rank, "tid": tid, "args": {"step": step}})
    events.sort(key=lambda e: (e["pid"], e["tid"], e["ts"], -e["dur"]))
    meta: List[Dict[str, Any]] = []
    for rank in sorted({e["pid"] for e in events}):
        label = "rank %d" % rank + (" (%s)" % host if host else "")
        meta.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": label}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
    for rank, tid in sorted({(e["pid"], e["tid"]) for e in events}):
        name = (thread_names or {}).get(tid) or "thread %d" % tid
        meta.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}})
    return {"traceEvents": meta + events, "displayTimeUnit": "ms"}
