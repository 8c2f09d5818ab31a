"""``torch.flight_recorder``: the entries of torch's Flight Recorder (the ring buffer of recent collectives
that c10d keeps per process), read with ``_dump_fr_trace_json``: a local copy, no collective."""

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
    Column("state", "VARCHAR", "scheduled, started or completed (what the backend could observe)."),
    Column("retired", "BOOLEAN", "Whether the work object has been retired by the backend."),
    Column("input_sizes", "VARCHAR", "Shapes of the input tensors, as JSON."),
    Column("input_dtypes", "VARCHAR", "dtypes of the input tensors, as JSON."),
    Column("output_sizes", "VARCHAR", "Shapes of the output tensors, as JSON."),
    Column("output_dtypes", "VARCHAR", "dtypes of the output tensors, as JSON."),
    Column("time_created", "TIMESTAMP", "When the collective was enqueued (wall clock, UTC)."),
    Column("time_started_ns", "BIGINT", "When it was seen to start, ns since the epoch; NULL when not recorded."),
    Column("time_completed_ns", "BIGINT", "When it was seen to complete, ns since the epoch; NULL when not "
                                          "recorded."),
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
            _str(entry.get("state")), entry.get("retired"),
            _json(entry.get("input_sizes")), _json(entry.get("input_dtypes")),
            _json(entry.get("output_sizes")), _json(entry.get("output_dtypes")),
            _timestamp(created), _nonzero(entry.get("time_discovered_started_ns")),
            _nonzero(entry.get("time_discovered_completed_ns")), _float(entry.get("duration_ms")),
            _int(entry.get("timeout_ms")), _str(entry.get("thread_name")), _call_site(entry.get("frames")))


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
