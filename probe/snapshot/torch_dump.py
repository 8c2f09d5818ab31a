"""torch's own Flight Recorder dump files, read as a snapshot's ranks.

What torch 2.13 writes: ``FlightRecorder::dump`` pickles one dict a process (``version``, ``pg_config``,
``pg_status``, ``entries``, ``comm_lib_version``; each entry the same keys ``_dump_fr_trace_json`` gives,
which ``torch.flight_recorder`` reads live). torch's ``DebugInfoWriter`` writes it to
``$TORCH_FR_DUMP_TEMP_FILE<rank>`` (default ``${XDG_CACHE_HOME:-~/.cache}/torch/comm_lib_trace_rank_<rank>``),
and only ProcessGroupNCCL's watchdog calls it, on a collective's timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``,
on by default there). A gloo process group records into the same recorder but dumps nothing on its
timeout: a job on gloo writes the same bytes itself, ``torch._C._distributed_c10d._dump_fr_trace()``, to
that name.

Reading is safe for a file from anywhere: the pickle may hold plain containers and scalars only (dict,
list, tuple, set, str, bytes, int, float, bool, None). Any class, global, reduce, persistent id or
extension code is refused before a byte is unpickled, with an error that says so. JSON (the recorder's
``dump_json``) is read as well.

Each rank's dump becomes a record of the snapshot format (``probe.snapshot.record``): the rows of
``torch.flight_recorder`` (the table's own row conversion) and evidence in state ``recorded`` (no stacks,
no threads: the dump has none) whose Flight Recorder summary is what ``diagnose``'s rules read, so that
the rank that did not issue a collective is named from the sequence numbers alone.
"""

import io
import json
import os
import pickle
import pickletools
import re
from typing import Any, Dict, List, Optional, Tuple

from probe.errors import UsageError

__all__ = ["MAX_DUMP_BYTES", "load_dump", "dump_files", "looks_like_dumps", "records", "fr_summary"]

MAX_DUMP_BYTES = 256 * 1024 * 1024
"""A dump bigger than this is refused (2000 entries with their stacks take a few MB)."""
MAX_ENTRIES = 100_000
"""Entries read from one dump at most, the newest (a pickle can repeat one entry cheaply)."""
MAX_OPCODES = 3_000_000
"""Pickle opcodes read at most: each costs a step of Python to check (a 2000-entry dump with stacks has
well under 1M), so that a file made of tiny opcodes is refused in a few seconds, not read for minutes."""

REASON = "torch Flight Recorder dump"

_PLAIN_OPCODES = frozenset((
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP",
    "NONE", "NEWTRUE", "NEWFALSE", "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4",
    "FLOAT", "BINFLOAT", "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "SHORT_BINUNICODE",
    "BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8",
    "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS", "EMPTY_LIST", "LIST", "APPEND", "APPENDS",
    "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_SET", "ADDITEMS", "FROZENSET",
    "PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET", "MEMOIZE",
))
_LONGS = frozenset(("LONG", "LONG1", "LONG4"))  # INT's text past 4300 digits is Python's own ValueError
"""Opcodes that build plain values only. Left out: GLOBAL, STACK_GLOBAL, INST, OBJ, NEWOBJ(_EX), REDUCE,
BUILD, PERSID, BINPERSID, EXT1/2/4, NEXT_BUFFER, READONLY_BUFFER: each imports or calls something."""


class _PlainUnpickler(pickle.Unpickler):
    """Refuses every class and persistent id (the opcodes were checked already: a second lock)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError("it names %s.%s" % (module, name))

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent id")


def load_dump(path: str) -> Dict[str, Any]:
    """One dump file as the dict torch pickled (or wrote as JSON); UsageError, saying why, for a file that
    is not one, holds anything but plain values, or is too big."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_DUMP_BYTES + 1)
    except FileNotFoundError:
        raise UsageError("no Flight Recorder dump at %s" % path) from None
    except OSError as exc:
        raise UsageError("cannot read the Flight Recorder dump %s: %s" % (path, exc.strerror or exc)) from None
    if len(data) > MAX_DUMP_BYTES:
        raise UsageError("%s is too big for a Flight Recorder dump (over %d MB)" % (path, MAX_DUMP_BYTES >> 20))
    if data[:1] in (b"{", b" ", b"\n"):
        try:
            raw = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise UsageError("%s is not a Flight Recorder dump: not JSON (%s)" % (path, exc)) from None
    else:
        raw = _plain_unpickle(data, path)
    from probe.snapshot.bounded import check

    too_much = check(raw)
    if too_much is not None:
        raise UsageError("%s is refused: %s; a Flight Recorder dump holds plain entries" % (path, too_much),
                         hint="probe reads dumps that torch wrote; this file was made otherwise")
    if not isinstance(raw, dict) or not isinstance(raw.get("entries", []), list):
        raise UsageError("%s is not a Flight Recorder dump: no entries list" % path,
                         hint="torch writes one a rank as $TORCH_FR_DUMP_TEMP_FILE<rank>")
    return raw


def _plain_unpickle(data: bytes, path: str) -> Any:
    if data[:1] != b"\x80":
        raise UsageError("%s is not a Flight Recorder dump: neither a pickle nor JSON" % path,
                         hint="torch writes one a rank as $TORCH_FR_DUMP_TEMP_FILE<rank>")
    from probe.snapshot.bounded import MAX_INT_BITS

    try:
        for count, (opcode, arg, _) in enumerate(pickletools.genops(data)):
            if opcode.name not in _PLAIN_OPCODES:
                raise UsageError("%s is refused: its pickle uses %s, which can import or call code; a Flight "
                                 "Recorder dump holds plain values only" % (path, opcode.name),
                                 hint="probe reads dumps that torch wrote; this file was made otherwise")
            if count >= MAX_OPCODES:
                raise UsageError("%s is refused: its pickle has more than %d opcodes" % (path, MAX_OPCODES),
                                 hint="probe reads dumps that torch wrote; this file was made otherwise")
            if opcode.name in _LONGS and arg.bit_length() > MAX_INT_BITS:
                raise UsageError("%s is refused: it holds an integer of %d bits (more than %d)" % (
                    path, arg.bit_length(), MAX_INT_BITS), hint="probe reads dumps that torch wrote; this file "
                                                                  "was made otherwise")
        return _PlainUnpickler(io.BytesIO(data)).load()
    except UsageError:
        raise
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError, IndexError, KeyError, MemoryError,
            RecursionError) as exc:
        raise UsageError("%s is not a Flight Recorder dump that can be read: %s" % (path, exc or type(exc).__name__),
                         hint="a dump cut short (the job killed while torch wrote it) cannot be read") from None


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
