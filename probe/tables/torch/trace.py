"""``python.torch_trace``: one row per traced span (module forward, backward, optimizer step), and the
control of the trace behind ``probe T trace start|stop|status|export`` and ``PROBE_TORCH_TRACE=1``.

One trace per process. Starting while one runs replaces it (new options, an empty buffer); a stopped
trace keeps its rows for queries and export until the next start. Nothing here imports torch: every
entry point takes it from ``sys.modules`` and says so when the target has not imported it.
"""

import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from probe.errors import BadRequest, Forbidden, NotFound, TooLarge
from probe.tables.spec import Column
from probe.tables.torch._common import torch_or_raise
from probe.tables.torch.anomalies import STORE, rank_and_world
from probe.tables.torch.trace_events import APPEND_NS
from probe.tables.torch.trace_hooks import Tracer
from probe.tables.torch.trace_options import TraceOptions
from probe.tables.torch.trace_ring import STAGES

__all__ = ["NAME", "DESCRIPTION", "COLUMNS", "EXAMPLE", "rows", "columns", "start", "stop", "status", "current", "control",
           "refresh_device_results"]

NAME = "python.torch_trace"
DESCRIPTION = ("One row per traced span of a PyTorch training step: each module's forward (and backward when "
               "asked for) and the optimizer step; start it with `probe T trace start` or PROBE_TORCH_TRACE=1.")
COLUMNS = (
    Column("step", "BIGINT", "Training step: counts the steps of the first optimizer seen (0 = the first traced "
                             "step); before any optimizer steps (inference), each call of the first top-level module."),
    Column("seq", "BIGINT", "The span's order within its step, by start time (0 = the first span to begin)."),
    Column("module", "VARCHAR", "Module path as named_modules() gives it (the root: its class name); for "
                                "stage 'optimizer', the optimizer's class."),
    Column("stage", "VARCHAR", "'forward', 'backward' (module's backward, from autograd graph hooks) or 'optimizer'."),
    Column("depth", "INTEGER", "Nesting depth of the module call (0 = a top-level call)."),
    Column("duration", "DOUBLE", "Seconds spent in the span itself: its total_duration minus its traced children's "
                                 "(self time), so SUM(duration) counts no time twice and a slow module ranks "
                                 "above the modules that call it. Device time (CUDA events) where CUDA is in use "
                                 "and the events have completed, else host wall time."),
    Column("total_duration", "DOUBLE", "Seconds from the span's begin to its end, children included (device time "
                                       "on CUDA once completed, else host)."),
    Column("host_duration", "DOUBLE", "Seconds of host (CPU) wall time between the span's begin and end hooks, "
                                      "children included."),
    Column("time_offset", "DOUBLE", "Seconds from the step's beginning (the previous optimizer step's end) to the "
                                    "span's beginning."),
    Column("allocated", "DOUBLE", "MB at the span's end: CUDA caching allocator's allocated bytes; on a CPU-only "
                                  "process, the process's resident set size (RSS). Once an optimizer has stepped, a "
                                  "step's spans share the reading taken as the step began: a fresh one every step "
                                  "where a reading costs under 0.1 % of the step, else one kept for 1000 x what a "
                                  "reading takes (30-60 us on a busy VM: 30-60 ms), never more than 250 ms old; "
                                  "before that, spans within 1-250 ms of a reading (5000 x its cost) share it."),
    Column("max_allocated", "DOUBLE", "MB: CUDA peak allocated bytes; on CPU, the highest RSS this trace has seen."),
    Column("cached", "DOUBLE", "MB reserved by the CUDA caching allocator; NULL on a CPU-only process."),
    Column("max_cached", "DOUBLE", "MB: CUDA peak reserved bytes; NULL on a CPU-only process."),
    Column("device", "VARCHAR", "Where the memory columns come from: 'cuda:N' (allocator) or 'cpu' (RSS)."),
    Column("thread_id", "BIGINT", "Python thread identifier of the thread that ran the span's end hook."),
    Column("rank", "INTEGER", "This process's rank (torch.distributed, else RANK), 0 if not distributed."),
    Column("world_size", "INTEGER", "Ranks in the job, 1 if not distributed."),
    Column("time", "TIMESTAMP", "Wall-clock time (UTC) when the span began."),
)
EXAMPLE = ("SELECT module, stage, COUNT(*) AS count, AVG(duration) AS avg_time, SUM(duration) AS total_time "
           "FROM python.torch_trace WHERE step > (SELECT MAX(step) - 5 FROM python.torch_trace) "
           "GROUP BY module, stage ORDER BY total_time DESC LIMIT 10")

_lock = threading.Lock()
_tracer: Optional[Tracer] = None


def current() -> Optional[Tracer]:
    """The running trace, or the last one that ran (its rows stay until the next start); None if none."""
    return _tracer


def start(options: Optional[TraceOptions] = None) -> Dict[str, Any]:
    """Start tracing (replacing a running trace); ``TorchNotLoaded`` if the target has not imported torch."""
    global _tracer
    torch = torch_or_raise()
    options = options or TraceOptions()
    with _lock:
        if _tracer is not None:
            _tracer.flush()
            _tracer.stop()
        tracer = Tracer(torch, options, STORE)
        if options.anomalies:
            STORE.refresh = refresh_device_results
            STORE.enabled_once = True
        tracer.start()
        _tracer = tracer
    return status()


def stop() -> Dict[str, Any]:
    torch_or_raise()
    with _lock:
        if _tracer is not None:
            _tracer.flush()
            _tracer.stop()
    return status()


def status() -> Dict[str, Any]:
    """What ``probe T trace status`` shows; works with or without a trace (not without torch)."""
    torch_or_raise()
    tracer = _tracer
    if tracer is None:
        return {"state": "off", "rows": 0, "anomalies": len(STORE)}
    tracer.flush()
    end = tracer.stopped_perf_ns or time.perf_counter_ns()
    elapsed = max(end - tracer.started_perf_ns, 1)
    hook_ns = tracer.hook_time_ns()
    state = "on" if tracer.running else ("failed" if tracer.failure else "stopped")
    return {
        "state": state,
        "failure": tracer.failure,
        "options": tracer.options.to_json(),
        "device": tracer.device,
        "rows": tracer.ring.held(),
        "size": tracer.ring.size,
        "spans_recorded": tracer.ring.written(),
        "spans_dropped_unread": tracer.spans_cut(),  # about: records dropped unbuilt, older than the ring holds
        "step": tracer.step,
        "steps_seen": tracer.steps_seen,
        "hook_seconds": round(hook_ns / 1e9, 6),
        "overhead_percent": round(100.0 * hook_ns / elapsed, 3),
        "hook_us_per_step": round(hook_ns / 1e3 / max(tracer.steps_seen, 1), 1),
        "append_only_calls": tracer.append_only_calls(),  # in hook_seconds at append_ns each (not timed)
        "append_ns": APPEND_NS,
        "hooks_left": tracer.hooks_left(),
        "anomalies": len(STORE),
        "started": tracer.started_wall_ns / 1e9,
    }


def refresh_device_results() -> None:
    """Fill in device times and CUDA anomaly results that have completed (never waits for the device)."""
    tracer = _tracer
    if tracer is None:
        return
    try:
        if tracer.timer is not None:
            tracer.timer.resolve(tracer.ring.set_device_time)
        if tracer.anomaly is not None:
            tracer.anomaly.resolve()
    except Exception:
        pass


def rows() -> Any:
    """The table's rows: once pyarrow is loaded (the agent loads it for its first query), a
    ``pyarrow.Table`` made straight from the ring's arrays (no Python object per value); before that,
    one list per column (:func:`columns`)."""
    tracer, rank, world = _source()
    if "pyarrow" in sys.modules:
        return _arrow(tracer, rank, world)
    return _columns(tracer, rank, world)


def columns() -> Dict[str, List[Any]]:
    """The rows as one list per column (``time`` in integer microseconds), oldest span first."""
    return _columns(*_source())


def _source() -> Tuple[Tracer, int, int]:
    torch = torch_or_raise()
    tracer = _tracer
    if tracer is None:
        raise NotFound("no torch trace has run in this process",
                       hint="start one with `probe TARGET trace start` (or PROBE_TORCH_TRACE=1 at start)")
    tracer.flush()  # the spans a step in progress has completed
    refresh_device_results()
    rank, world = rank_and_world(torch)
    return tracer, rank, world


def _base_us(tracer: Tracer) -> int:
    """Added to a span's ``perf_counter_ns() // 1000``: its wall-clock time in microseconds."""
    return tracer.started_wall_ns // 1000 - tracer.started_perf_ns // 1000


def _columns(tracer: Tracer, rank: int, world: int) -> Dict[str, List[Any]]:
    data = tracer.ring.snapshot()
    n = len(data["step"])
    base_us = _base_us(tracer)
    cpu = tracer.device == "cpu"  # no caching allocator: the cached columns are NULL
    return {
        "step": data["step"], "seq": data["seq"], "module": data["module"], "stage": data["stage"],
        "depth": data["depth"], "duration": data["duration"], "total_duration": data["total"],
        "host_duration": data["host"], "time_offset": data["time_offset"],
        "allocated": data["allocated"], "max_allocated": data["max_allocated"],
        "cached": [None] * n if cpu else data["cached"], "max_cached": [None] * n if cpu else data["max_cached"],
        "device": [tracer.device] * n, "thread_id": data["thread"],
        "rank": [rank] * n, "world_size": [world] * n,
        "time": [base_us + ns // 1000 for ns in data["start_ns"]],
    }


def _arrow(tracer: Tracer, rank: int, world: int) -> Any:
    """The ring's array copies wrapped as Arrow buffers (no copy, no Python object per value); module
    and stage names by one ``take`` of the names each; the ring's rotation as two record batches."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from probe.tables.arrow import schema_of

    data, names, first = tracer.ring.arrays()
    n = len(data["step"])

    def wrap(column: str, kind: Any = pa.int64()) -> Any:
        return pa.Array.from_buffers(kind, n, [None, pa.py_buffer(data[column])])

    def same(value: Any, kind: Any) -> Any:
        return pa.repeat(pa.scalar(value, kind), n)

    doubles = [wrap(c, pa.float64()) for c in ("duration", "total", "host", "time_offset", "allocated",
                                                  "max_allocated")]
    if tracer.device == "cpu":  # no caching allocator: the cached columns are NULL
        cached = [pa.nulls(n, pa.float64()), pa.nulls(n, pa.float64())]
    else:
        cached = [wrap("cached", pa.float64()), wrap("max_cached", pa.float64())]
    time_us = pc.add(pc.divide(wrap("start_ns"), 1000), _base_us(tracer))
    arrays = ([wrap("step"), wrap("seq"), pa.array(names, pa.string()).take(wrap("module")),
               pa.array(STAGES, pa.string()).take(wrap("stage")), wrap("depth").cast(pa.int32())]
              + doubles + cached + [same(tracer.device, pa.string()), wrap("thread"), same(rank, pa.int32()),
                                    same(world, pa.int32()), time_us.cast(pa.timestamp("us"))])
    batch = pa.RecordBatch.from_arrays(arrays, schema=schema_of([(c.name, c.type) for c in COLUMNS]))
    return pa.Table.from_batches([batch.slice(first), batch.slice(0, first)] if first else [batch])


def control(body: Dict[str, Any], eval_enabled: bool, max_bytes: int) -> Dict[str, Any]:
    """``POST /v1/torch/trace``: ``{"action": "start"|"stop"|"status"|"export", options...}``.

    ``start`` changes what the target's training step runs (it adds hooks), so an agent whose eval is
    switched off (read-only) refuses it; ``stop`` only takes our hooks out and ``status``/``export``
    only read, so they always work.
    """
    action = body.get("action")
    if action == "start":
        if not eval_enabled:
            raise Forbidden("this agent is read-only (--no-eval / PROBE_EVAL=0), and starting a trace changes what "
                            "the target runs", hint="start it at launch with PROBE_TORCH_TRACE=1, or give the "
                            "agent eval; `trace status`, `stop` and `export` work read-only")
        return start(TraceOptions.from_request(body))
    if action == "stop":
        return stop()
    if action == "status":
        return status()
    if action == "export":
        data = columns()
        if len(data["step"]) * _EXPORT_BYTES_PER_SPAN > max_bytes:
            raise TooLarge("the trace holds %d spans, more than one answer of the agent may carry as JSON"
                           % len(data["step"]), hint="export fewer: restart the trace with a smaller "
                           "PROBE_TORCH_TRACE_SIZE, or query python.torch_trace with SQL")
        import socket

        from probe.tables.torch.trace_export import chrome_trace

        return chrome_trace(data, socket.gethostname(), _thread_names())
    raise BadRequest("action must be start, stop, status or export, got %r" % (action,))


_EXPORT_BYTES_PER_SPAN = 400


def _thread_names() -> Dict[int, str]:
    return {t.ident: t.name for t in threading.enumerate() if t.ident is not None}
