"""``torch.flight_recorder``: the entries of torch's Flight Recorder (the ring buffer of recent collectives
that c10d keeps per process), read with ``_dump_fr_trace_json``: a local copy, no collective.

What the recorder knows of an entry's progress (torch 2.13, ``FlightRecorderDetail.hpp``): its state is
read from the start and end events the backend gave it when it recorded the collective (``scheduled``
until the start event has fired, ``started``, then ``completed``, with the time each was first seen),
and ``retired`` is set when the backend tells the recorder that the work is over. NCCL gives CUDA
events. Gloo gives none (``ProcessGroupGloo`` records with no events and retires an entry once its
worker thread has run the work), so every gloo entry reads ``scheduled`` with no times, finished or
not: there ``retired`` is what tells a finished collective (done or failed) from one still pending,
and the table's state says ``completed`` for an entry that is retired without events.
"""

import json
import sys
from typing import Any, Dict, Iterator, Optional, Tuple

from probe.tables.spec import Column
from probe.tables.torch._common import torch_or_raise

__all__ = ["NAME", "DESCRIPTION", "COLUMNS", "EXAMPLE", "rows"]

NAME = "torch.flight_recorder"
DESCRIPTION = ("Recent collectives recorded by torch's Flight Recorder, one row per entry. Empty unless the "
               "target was started with TORCH_FR_BUFFER_SIZE=N (N entries kept; older torch: "
               "TORCH_NCCL_TRACE_BUFFER_SIZE); records gloo and nccl groups.")
COLUMNS = (
    Column("pg", "VARCHAR", "The process group's name (torch.distributed.group_name)."),
    Column("pg_desc", "VARCHAR", "The process group's description, e.g. default_pg."),
    Column("pg_id", "BIGINT", "The process group's id in the recorder."),
    Column("collective_seq_id", "BIGINT", "Sequence number of the collective in its group (equal across ranks "
                                          "for the same collective: compare them to find a rank that is behind)."),
    Column("p2p_seq_id", "BIGINT", "Sequence number of point-to-point operations in the group."),
    Column("op_id", "BIGINT", "Operation id within the group (coalesced operations share a collective)."),
    Column("record_id", "BIGINT", "Position of the entry in the recorder's history."),
    Column("op", "VARCHAR", "The operation, e.g. gloo:all_reduce, nccl:all_gather."),
    Column("is_p2p", "BOOLEAN", "Whether it is a point-to-point operation (send, recv)."),
    Column("state", "VARCHAR", "scheduled, started or completed, as the backend's events showed them (nccl); where "
                               "the backend gives the recorder no events (gloo: torch says 'scheduled' for every "
                               "entry), completed once the entry is retired and scheduled until then (pending: "
                               "queued or running, gloo does not say which)."),
    Column("retired", "BOOLEAN", "Whether the backend has retired the work (it finished, or failed): under gloo "
                                 "what tells a finished collective from a pending one."),
    Column("input_sizes", "VARCHAR", "Shapes of the input tensors, as JSON."),
    Column("input_dtypes", "VARCHAR", "dtypes of the input tensors, as JSON."),
    Column("output_sizes", "VARCHAR", "Shapes of the output tensors, as JSON."),
    Column("output_dtypes", "VARCHAR", "dtypes of the output tensors, as JSON."),
    Column("time_created", "TIMESTAMP", "When the collective was enqueued (wall clock, UTC)."),
    Column("time_started_ns", "BIGINT", "When it was seen to start, ns since the epoch; NULL when not recorded "
                                        "(always under gloo: no events)."),
    Column("time_completed_ns", "BIGINT", "When it was seen to complete, ns since the epoch; NULL when not "
                                          "recorded (always under gloo)."),
    Column("duration_ms", "DOUBLE", "Its duration where the backend timed it (nccl with timing enabled); NULL "
                                    "otherwise."),
    Column("timeout_ms", "BIGINT", "The collective's timeout."),
    Column("thread_name", "VARCHAR", "The thread that issued it."),
    Column("call_site", "VARCHAR", "Where it was issued (innermost frames, 'file:line name; ...') where the "
                                   "recorder kept a stack; NULL otherwise."),
)
EXAMPLE = "SELECT pg, collective_seq_id, op, state FROM torch.flight_recorder ORDER BY collective_seq_id DESC LIMIT 5"


def rows() -> Iterator[Tuple[Any, ...]]:
    torch_or_raise()
    c10d = sys.modules.get("torch._C._distributed_c10d")
    dump = getattr(c10d, "_dump_fr_trace_json", None) if c10d is not None else None
    if dump is None:
        return
    try:
        raw = dump(True, False)  # (include collectives, only active ones)
    except TypeError:
        raw = dump()
    data = json.loads(raw)
    for entry in data.get("entries", ()) or ():
        yield _row(entry)


def _row(entry: Dict[str, Any]) -> Tuple[Any, ...]:
    group = entry.get("process_group") or [None, None]
    created = _int(entry.get("time_created_ns"))
    return (_str(group[0]), _str(group[1] if len(group) > 1 else None), _int(entry.get("pg_id")),
            _int(entry.get("collective_seq_id")), _int(entry.get("p2p_seq_id")), _int(entry.get("op_id")),
            _int(entry.get("record_id")), _str(entry.get("profiling_name")), entry.get("is_p2p"),
            _state(entry), entry.get("retired"),
            _json(entry.get("input_sizes")), _json(entry.get("input_dtypes")),
            _json(entry.get("output_sizes")), _json(entry.get("output_dtypes")),
            _timestamp(created), _nonzero(entry.get("time_discovered_started_ns")),
            _nonzero(entry.get("time_discovered_completed_ns")), _float(entry.get("duration_ms")),
            _int(entry.get("timeout_ms")), _str(entry.get("thread_name")), _call_site(entry.get("frames")))


def _state(entry: Dict[str, Any]) -> Optional[str]:
    """The recorder's state, or completed for an entry retired without events (gloo's every entry reads
    'scheduled', its times 0, even once its work is over)."""
    state = _str(entry.get("state"))
    if (state == "scheduled" and entry.get("retired") is True and not entry.get("time_discovered_started_ns")
            and not entry.get("time_discovered_completed_ns")):
        return "completed"
    return state


def _call_site(frames: Any) -> Optional[str]:
    if not isinstance(frames, list) or not frames:
        return None
    parts = []
    for frame in frames[:8]:
        if isinstance(frame, dict):
            parts.append("%s:%s %s" % (frame.get("filename"), frame.get("line"), frame.get("name")))
    return "; ".join(parts) or None


def _timestamp(ns: Optional[int]) -> Any:
    if not ns:
        return None
    import datetime

    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.timezone.utc).replace(tzinfo=None)


def _json(value: Any) -> Optional[str]:
    return None if value is None else json.dumps(value)


def _str(value: Any) -> Optional[str]:
    return None if value is None else str(value)


def _int(value: Any) -> Optional[int]:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def _nonzero(value: Any) -> Optional[int]:
    number = _int(value)
    return number or None


def _float(value: Any) -> Optional[float]:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None
