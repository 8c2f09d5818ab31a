"""torch's own Flight Recorder dump files, read as a snapshot's ranks.

What torch 2.13 writes: ``FlightRecorder::dump`` pickles one dict a process (``version``, ``pg_config``,
``pg_status``, ``entries``, ``comm_lib_version``; each entry the same keys ``_dump_fr_trace_json`` gives,
which ``torch.flight_recorder`` reads live). torch's ``DebugInfoWriter`` writes it to
``$TORCH_FR_DUMP_TEMP_FILE<rank>`` (default ``${XDG_CACHE_HOME:-~/.cache}/torch/comm_lib_trace_rank_<rank>``),
and only ProcessGroupNCCL's watchdog calls it, on a collective's timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``,
on by default there). A gloo process group records into the same recorder but dumps nothing on its
timeout: a job on gloo writes the same bytes itself, ``torch._C._distributed_c10d._dump_fr_trace()``, to
that name.

Each file is read by ``probe.reader.fr_dump.load_dump`` (plain values only, bounded: a file from anywhere
is hostile).

Each rank's dump becomes a record of the snapshot format (``probe.snapshot.record``): the rows of
``torch.flight_recorder`` (the table's own row conversion) and evidence in state ``recorded`` (no stacks,
no threads: the dump has none) whose Flight Recorder summary is what ``diagnose``'s rules read, so that
the rank that did not issue a collective is named from the sequence numbers alone.
"""

import os
import re
from typing import Any, Dict, List, Optional, Tuple

from probe.errors import UsageError
from probe.reader.fr_dump import MAX_DUMP_BYTES, MAX_ENTRIES, REASON, load_dump

__all__ = ["MAX_DUMP_BYTES", "load_dump", "dump_files", "looks_like_dumps", "records", "fr_summary"]


_NUMBERED = re.compile(r"^(.*?)([0-9]+)$")


def dump_files(path_text: str) -> Dict[int, str]:
    """rank -> file, for ``snapshot:PATH`` where PATH is a directory of dumps (named ``<prefix><rank>``, one
    prefix), the prefix itself (``/tmp/fr_`` for ``/tmp/fr_0``, ``/tmp/fr_1``...) or one dump. UsageError
    where none."""
    path = os.path.abspath(os.path.expanduser(path_text))
    one = _NUMBERED.match(os.path.basename(path))
    if os.path.isfile(path) and one is not None:  # one rank's dump
        return {int(one.group(2)): path}
    if os.path.isdir(path):
        directory, prefixes = path, _by_prefix(path, None)
        if len(prefixes) > 1:
            raise UsageError("%s holds files of several prefixes (%s): which are the dumps?" % (
                path, ", ".join(sorted(p + "N" for p in prefixes)[:4])),
                hint="give the prefix itself: snapshot:%s" % os.path.join(path, sorted(prefixes)[0]))
    else:
        directory, base = os.path.split(path)
        prefixes = _by_prefix(directory or ".", base)
    found = next(iter(prefixes.values()), {})
    if not found:
        raise UsageError("no Flight Recorder dump at %s" % path_text,
                         hint="a directory of files <prefix><rank>, or the prefix itself (TORCH_FR_DUMP_TEMP_FILE)")
    return {rank: os.path.join(directory, name) for rank, name in sorted(found.items())}


def _by_prefix(directory: str, prefix: Optional[str]) -> Dict[str, Dict[int, str]]:
    try:
        names = os.listdir(directory)
    except OSError:
        return {}
    out: Dict[str, Dict[int, str]] = {}
    for name in names:
        if name.startswith("."):
            continue
        if prefix is not None:
            rest = name[len(prefix):] if name.startswith(prefix) else ""
            if not (rest.isascii() and rest.isdigit()):
                continue
            key, rank = prefix, int(rest)
        else:
            match = _NUMBERED.match(name)
            if match is None:
                continue
            key, rank = match.group(1), int(match.group(2))
        if os.path.isfile(os.path.join(directory, name)):
            out.setdefault(key, {})[rank] = name
    return out


def looks_like_dumps(path_text: str) -> bool:
    """Whether ``snapshot:PATH`` names torch dumps rather than a probe snapshot (whose rank files are JSON
    records named ``rank-N.json``)."""
    try:
        files = dump_files(path_text)
    except UsageError:
        return False
    return not any(os.path.basename(f).startswith("rank-") and f.endswith(".json") for f in files.values())


# -- a dump as a record ------------------------------------------------------------------------------


def _entries(dump: Dict[str, Any]) -> Tuple[List[Dict[str, Any]], int]:
    """The entries that are dicts, with plain fields (a group as a pair); how many were left out."""
    out, bad = [], 0
    entries = dump.get("entries") or []
    for entry in entries[-MAX_ENTRIES:]:
        if not isinstance(entry, dict):
            bad += 1
            continue
        entry = dict(entry)
        group = entry.get("process_group")
        entry["process_group"] = list(group)[:2] if isinstance(group, (list, tuple)) else [group, None]
        if not isinstance(entry.get("frames"), list):
            entry["frames"] = None
        out.append(entry)
    return out, bad


def _rows(entries: List[Dict[str, Any]]) -> Tuple[List[Tuple[Any, ...]], int]:
    from probe.tables.torch.flight_recorder import _row

    rows, bad = [], 0
    for entry in entries:
        try:
            rows.append(_row(entry))
        except (TypeError, ValueError, AttributeError, OverflowError):
            bad += 1
    return rows, bad


def fr_summary(rows_by_rank: Dict[int, List[Dict[str, Any]]], dumped_at: Dict[int, float]) -> Dict[int, List[Dict[str, Any]]]:
    """Per rank, one row per process group, as ``diagnose`` reads the live recorder (evidence.FR_SQL):
    the group's last collective (number, op, done or not, seconds from its issue to the dump, its input
    sizes and dtypes), the mean interval between its collectives and its last few (``recent``).

    Done: the backend's events say completed (nccl). gloo gives the recorder no events and retires an
    entry whether its work finished or failed (a timeout): there a retired entry is done only where
    every dumped rank of its group issued that collective too, since a collective that a member never
    issued cannot have finished."""
    from probe.diagnose.collectives import recent_text

    groups: Dict[int, Dict[str, List[Dict[str, Any]]]] = {}
    for rank, rows in rows_by_rank.items():
        for row in rows:
            if row.get("is_p2p") or row.get("collective_seq_id") is None:
                continue
            groups.setdefault(rank, {}).setdefault(str(row.get("pg")), []).append(row)
    reached: Dict[str, int] = {}  # the lowest last collective of each group over the dumped ranks
    for by_pg in groups.values():
        for pg, rows in by_pg.items():
            last = max(int(r["collective_seq_id"]) for r in rows)
            reached[pg] = min(reached.get(pg, last), last)
    out: Dict[int, List[Dict[str, Any]]] = {}
    for rank, by_pg in groups.items():
        for pg, rows in sorted(by_pg.items()):
            rows.sort(key=lambda r: int(r["collective_seq_id"]))
            last = rows[-1]
            seq = int(last["collective_seq_id"])
            evented = bool(last.get("time_started_ns") or last.get("time_completed_ns"))
            done = last.get("state") == "completed" if evented else (
                bool(last.get("retired")) and seq <= reached[pg])
            created = [r["time_created"] for r in rows if r.get("time_created") is not None]
            age = None
            if last.get("time_created") is not None and rank in dumped_at:
                age = max(0.0, dumped_at[rank] - _epoch(last["time_created"]))
            period = ((_epoch(max(created)) - _epoch(min(created))) / max(len(created) - 1, 1)) if created else None
            out.setdefault(rank, []).append({
                "pg": pg, "pg_desc": last.get("pg_desc"), "last_seq": seq, "last_op": last.get("op"),
                "last_done": done, "last_age": age, "period": period, "call_site": last.get("call_site"),
                "entries": len(rows), "last_sizes": last.get("input_sizes"), "last_dtypes": last.get("input_dtypes"),
                "recent": recent_text(rows)})
    return out


def _epoch(value: Any) -> float:
    import datetime

    if isinstance(value, datetime.datetime):
        return value.replace(tzinfo=datetime.timezone.utc).timestamp()
    return float(value)


def records(path_text: str) -> List[Dict[str, Any]]:
    """Every rank's dump under ``snapshot:PATH`` as a snapshot record (probe.snapshot.record's format),
    in rank order."""
    from probe.diagnose.evidence import RankEvidence
    from probe.snapshot.record import FORMAT, _plain, evidence_to_json
    from probe.tables.torch.flight_recorder import COLUMNS

    files = dump_files(path_text)
    names = [c.name for c in COLUMNS]
    columns = [[c.name, c.type] for c in COLUMNS]
    tables: Dict[int, Dict[str, Any]] = {}
    rows_by_rank: Dict[int, List[Dict[str, Any]]] = {}
    dumped_at: Dict[int, float] = {}
    missing: Dict[int, Dict[str, str]] = {}
    versions: Dict[int, Any] = {}
    for rank, path in files.items():
        dump = load_dump(path)
        entries, bad = _entries(dump)
        rows, unread = _rows(entries)
        versions[rank] = dump.get("version")
        dumped_at[rank] = os.stat(path).st_mtime
        rows_by_rank[rank] = [dict(zip(names, row)) for row in rows]
        tables[rank] = {"torch.flight_recorder": {"columns": columns, "rows": _plain([list(r) for r in rows]),
                                                  "truncated": False}}
        said = {name: "a torch Flight Recorder dump holds no %s" % what for name, what in (
            ("python.backtrace", "stacks"), ("python.threads", "threads"), ("python.locals", "locals"),
            ("python.torch_trace", "trace"), ("torch.steps", "step counter"), ("torch.anomalies", "anomalies"),
            ("process.info", "process facts"))}
        if bad + unread:
            said["torch.flight_recorder"] = "%d entries of the dump could not be read, left out" % (bad + unread)
        if len(dump.get("entries") or ()) > MAX_ENTRIES:
            said["torch.flight_recorder"] = "the newest %d entries of %d kept" % (MAX_ENTRIES, len(dump["entries"]))
        missing[rank] = said
    summary = fr_summary(rows_by_rank, dumped_at)
    out = []
    for rank, path in files.items():
        host = os.path.basename(path)
        why = "not in a torch Flight Recorder dump"
        ev = RankEvidence(rank, host, None, state="recorded", why="read from %s (torch %s)" % (path, versions[rank]),
                          source=REASON, frames=None, threads_why=why, trace_why=why, steps_why=why,
                          fr=summary.get(rank) or None, at=0.0,
                          fr_why=None if summary.get(rank) else "the dump holds no collective")
        look = evidence_to_json(ev)
        look["wall_at"] = dumped_at[rank]
        out.append({"format": FORMAT, "job": "torch-fr-dump", "rank": rank, "host": host, "pid": None,
                    "recorded_at": dumped_at[rank], "reason": REASON, "evidence": [look, dict(look)],
                    "tables": tables[rank], "missing": missing[rank], "crash": None, "seconds": 0.0,
                    "source": path})
    return out
