"""One rank's record: the format, its writing (atomic, owner-only, bounded) and its reading.

A record is one JSON object a rank (``rank-00003.json``)::

    {"format": "probe-snapshot 1", "job": str, "rank": int, "host": str, "pid": int|null,
     "recorded_at": epoch seconds, "reason": "by hand" | "stall: ..." | ...,
     "evidence": [first, last],   # RankEvidence of two looks about a second apart (evidence_to_json)
     "tables": {"python.backtrace": {"columns": [[name, type], ...], "rows": [[...], ...], "truncated": bool}, ...},
     "missing": {table or "evidence": why it could not be had},
     "crash": str|null,          # the rank's crash record text, where it died and left one
     "seconds": float}           # how long taking it took

Evidence is kept whole: every field of :class:`probe.diagnose.evidence.RankEvidence` but the live error
object, frames in full, so that the rules judge a record as they judge the live job. ``at`` stays the
recording host's monotonic clock (only differences between a rank's two looks mean anything);
``wall_at`` is the same moment in epoch seconds.

A file is written as ``.rank-N.json.tmp-<pid>``, flushed to disk and renamed over its name: a reader
sees the whole file or none, whatever kills the writer. Mode 0600. A record bigger than
``PROBE_SNAPSHOT_MAX_RANK_BYTES`` (default 2 MB) is cut table by table (``truncated`` says so) before
it is written.
"""

import dataclasses
import datetime
import json
import os
import socket
from typing import Any, Dict, List, Optional

from probe.errors import UsageError

__all__ = ["FORMAT", "MAX_RANK_BYTES", "evidence_to_json", "evidence_from_json", "write_rank", "write_meta",
           "read_rank", "read_meta", "rank_file_name", "meta_file_name", "is_recorded", "max_rank_bytes"]

FORMAT = "probe-snapshot 1"
META_FORMAT = "probe-snapshot-meta 1"
MAX_RANK_BYTES = 2 * 1024 * 1024
_FRAME_FIELDS = ("thread_id", "thread_name", "native_id", "is_main", "depth", "func", "file", "lineno", "code",
                 "frame_type")
_KEPT_AT_TAIL = ("python.torch_trace", "torch.flight_recorder", "cluster.stack_history")  # cut from the oldest end


def max_rank_bytes() -> int:
    try:
        return max(64 * 1024, int(os.environ.get("PROBE_SNAPSHOT_MAX_RANK_BYTES", "") or MAX_RANK_BYTES))
    except ValueError:
        return MAX_RANK_BYTES


def rank_file_name(rank: int) -> str:
    return "rank-%05d.json" % rank


def meta_file_name(host: str) -> str:
    return "meta-%s.json" % _safe(host or "host")


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text)[:100] or "_"


# -- evidence <-> JSON ---------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """``value`` as JSON can hold it: tuples as lists, times as ISO text, other objects as their text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def evidence_to_json(ev: Any) -> Dict[str, Any]:
    """Every field of a ``RankEvidence`` (the live ``error`` object left out: its text is in ``why``),
    frames in full, as a JSON object that :func:`evidence_from_json` turns back into the same evidence."""
    out: Dict[str, Any] = {}
    for f in dataclasses.fields(ev):
        if f.name == "error":
            continue
        value = getattr(ev, f.name)
        if f.name == "frames":
            out["frames"] = None if value is None else [[_plain(getattr(fr, k)) for k in _FRAME_FIELDS] for fr in value]
        else:
            out[f.name] = _plain(value)
    return out


def evidence_from_json(raw: Dict[str, Any]) -> Any:
    """The ``RankEvidence`` :func:`evidence_to_json` wrote (fields this version does not know are left out,
    missing ones take their defaults); raises UsageError on what is not evidence."""
    from probe.client.results import Frame
    from probe.diagnose.evidence import RankEvidence

    if not isinstance(raw, dict) or not isinstance(raw.get("rank"), int):
        raise UsageError("not a rank's evidence: %s" % _brief(raw))
    known = {f.name for f in dataclasses.fields(RankEvidence)} - {"error"}
    values = {k: v for k, v in raw.items() if k in known}
    try:
        if values.get("frames") is not None:
            values["frames"] = [Frame(*row) for row in values["frames"]]
        memory = values.get("memory")
        if isinstance(memory, dict) and isinstance(memory.get("readings"), list):
            values["memory"] = dict(memory, readings=[tuple(r) for r in memory["readings"]])
        training = values.get("training")
        if isinstance(training, dict) and isinstance(training.get("worker_stacks"), dict):
            stacks = {pid: None if stack is None else [tuple(f) for f in stack]
                      for pid, stack in training["worker_stacks"].items()}
            values["training"] = dict(training, worker_stacks=stacks)
        return RankEvidence(**values)
    except (TypeError, ValueError) as exc:
        raise UsageError("a rank's evidence that cannot be read back (%s): %s" % (exc, _brief(raw))) from None


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def is_recorded(record: Dict[str, Any]) -> bool:
    """Whether a record holds this rank's stacks (from its agent, from outside or from its crash record):
    a rank whose record has none could not be recorded."""
    if (record.get("tables") or {}).get("python.backtrace", {}).get("rows"):
        return True
    return any((e or {}).get("frames") for e in record.get("evidence") or ())


# -- writing -------------------------------------------------------------------------------------------


def _atomic_write(directory: str, name: str, data: bytes) -> str:
    """``data`` into ``directory/name``: a hidden temporary file of this process, flushed to disk, then
    renamed over the name (then the directory flushed), so a reader sees the old file, the new one, or
    none, never half of one. Mode 0600 whatever the umask."""
    path = os.path.join(directory, name)
    temp = os.path.join(directory, ".%s.tmp-%d" % (name, os.getpid()))
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.fchmod(fd, 0o600)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink(temp)
        raise
    os.close(fd)
    try:
        os.replace(temp, path)
    except BaseException:
        _unlink(temp)
        raise
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:  # a file system that cannot flush a directory: the rename stands as it is
        pass
    return path


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _dump(value: Any) -> bytes:
    return json.dumps(value, default=str, separators=(",", ":")).encode("utf-8")


def _fit(record: Dict[str, Any], limit: int) -> bytes:
    """The record's bytes, within ``limit``: the biggest table loses half its rows (the oldest, for the
    trace and the Flight Recorder), again and again; past the tables, each thread's stack in the evidence
    is cut to its innermost 50 frames. What was cut is said (``truncated``, ``missing``)."""
    data = _dump(record)
    tables = record.get("tables") or {}
    while len(data) > limit:
        sizes = {name: len(_dump(t.get("rows"))) for name, t in tables.items() if t.get("rows")}
        if not sizes:
            break
        name = max(sizes, key=lambda n: sizes[n])
        table = tables[name]
        rows = table["rows"]
        keep = len(rows) // 2
        table["rows"] = (rows[len(rows) - keep:] if name in _KEPT_AT_TAIL else rows[:keep]) if keep else []
        table["truncated"] = True
        record.setdefault("missing", {})[name] = "cut to %d rows: the record is bounded to %d bytes" % (keep, limit)
        data = _dump(record)
    if len(data) > limit:
        for ev in record.get("evidence") or ():
            frames = ev.get("frames")
            if frames:
                ev["frames"] = [f for f in frames if f[4] < 50]
        record.setdefault("missing", {})["evidence"] = "stacks cut to their innermost 50 frames: the record is " \
                                                       "bounded to %d bytes" % limit
        data = _dump(record)
    return data


def write_rank(snapshot_dir: str, record: Dict[str, Any]) -> str:
    """Write one rank's record into ``snapshot_dir`` (atomic, 0600, bounded); its path."""
    if record.get("format") != FORMAT or not isinstance(record.get("rank"), int):
        raise UsageError("not a probe snapshot record: %s" % _brief({k: record.get(k) for k in ("format", "rank")}))
    return _atomic_write(snapshot_dir, rank_file_name(record["rank"]), _fit(record, max_rank_bytes()))


def write_meta(snapshot_dir: str, meta: Dict[str, Any]) -> str:
    """Write a node's meta (``meta-<host>.json``) into ``snapshot_dir``, atomically; its path. Written last:
    a snapshot directory with its meta is complete. Keys: ``job``, ``host``, ``reason``, ``started`` and
    ``ended`` (epoch s), ``ranks`` (recorded, a list), ``failed`` ({rank as text: why it could not be}),
    ``hang_after_s`` (the watch's), ``probe_version``; ``format`` is added."""
    meta = dict(meta)
    meta.setdefault("format", META_FORMAT)
    meta.setdefault("host", socket.gethostname())
    return _atomic_write(snapshot_dir, meta_file_name(str(meta["host"])), _dump(_plain(meta)))


# -- reading -------------------------------------------------------------------------------------------


def _load(path: str, what: str) -> Any:
    try:
        with open(path, "rb") as handle:
            data = handle.read(8 * max_rank_bytes() + 1)
    except FileNotFoundError:
        raise UsageError("no %s at %s" % (what, path), hint="`probe snapshots DIR` lists what was recorded") from None
    except IsADirectoryError:
        raise UsageError("%s is a directory, not a %s" % (path, what)) from None
    except OSError as exc:
        raise UsageError("cannot read %s %s: %s" % (what, path, exc.strerror or exc)) from None
    if len(data) > 8 * max_rank_bytes():
        raise UsageError("%s is too big for a %s (over %d bytes)" % (path, what, 8 * max_rank_bytes()))
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise UsageError("%s is not a %s: cut short or not JSON (%s)" % (path, what, exc),
                         hint="a record is written whole or not at all: this file was not written by probe") from None
    from probe.reader.bounded import check

    too_much = check(raw)
    if too_much is not None:
        raise UsageError("%s is not a %s: %s" % (path, what, too_much),
                         hint="probe writes records 10 levels deep at most: this file was not written by probe")
    return raw


def read_rank(path: str) -> Dict[str, Any]:
    """One rank's record, checked: its format, its rank, two looks of evidence, its tables; a bad, foreign
    or cut file is a UsageError that says which and why."""
    raw = _load(path, "probe snapshot record")
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise UsageError("%s is not a probe snapshot record (format %r, expected %r)" % (path, found, FORMAT),
                         hint="a newer probe may have written it" if isinstance(found, str)
                         and found.startswith("probe-snapshot") else None)
    problems = []
    if not isinstance(raw.get("rank"), int):
        problems.append("no rank")
    evidence = raw.get("evidence")
    if not isinstance(evidence, list) or len(evidence) != 2 or not all(isinstance(e, dict) for e in evidence):
        problems.append("evidence is not two looks")
    tables = raw.get("tables")
    if not isinstance(tables, dict) or not all(isinstance(t, dict) and isinstance(t.get("columns"), list)
                                               and isinstance(t.get("rows"), list) for t in tables.values()):
        problems.append("tables are not columns and rows")
    if problems:
        raise UsageError("%s is a damaged probe snapshot record: %s" % (path, ", ".join(problems)))
    raw.setdefault("missing", {})
    raw.setdefault("crash", None)
    return raw


def read_meta(path: str) -> Dict[str, Any]:
    """A node's meta, checked as far as its format."""
    raw = _load(path, "probe snapshot meta file")
    if not isinstance(raw, dict) or raw.get("format") != META_FORMAT:
        raise UsageError("%s is not a probe snapshot meta file" % path)
    return raw


def new_record(job: str, rank: int, host: str, pid: Optional[int], reason: str, recorded_at: float,
               evidence: List[Dict[str, Any]]) -> Dict[str, Any]:
    """A record with its fixed fields; tables, missing and crash to be filled."""
    return {"format": FORMAT, "job": job, "rank": rank, "host": host, "pid": pid, "recorded_at": recorded_at,
            "reason": reason, "evidence": evidence, "tables": {}, "missing": {}, "crash": None, "seconds": 0.0}
