"""``snapshot:PATH`` as a target: the ranks as they were recorded, answering the read commands as the
live job did.

PATH is a snapshot (``DIR/<id>``, or one rank file, or a directory of snapshots: its newest; see
``probe.snapshot.store.resolve``), or torch's own Flight Recorder dump files (a directory of
``<prefix><rank>`` files, or the prefix; see ``probe.snapshot.torch_dump``).

:class:`RecordClient` stands for one rank (the client of ``probe snapshot:PATH COMMAND``: the lowest rank
recorded, as ``probe MASTER:PORT COMMAND`` speaks to rank 0); :class:`RecordCluster` for every rank
(``--all-ranks``, ``--ranks``, ``--merge``, ``ranks``), through the same fan-out as a live job. SQL runs
here, in probe's locked-down engine, over the rows the record kept. What needs a live process (eval,
checkpoint, trace, debug, lr) is refused with a clear error: the ranks may be gone.
"""

import datetime
import json
import os
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from probe._words import span
from probe.client.cluster import DEFAULT_DEADLINE, DEFAULT_IN_FLIGHT, Cluster, Member
from probe.client.results import Frame, Rows, TableInfo, ColumnInfo
from probe.client.sources import LIVE_ONLY, SourceKind, register_kind
from probe.client.targets import Target
from probe.client.transport import UnixAddress
from probe.errors import NotFound, UsageError

__all__ = ["PREFIX", "Snapshot", "RecordClient", "RecordCluster", "open_snapshot", "connect_record",
           "connect_record_all"]

PREFIX = "snapshot:"

_GONE = "a snapshot is a record of ranks that may be gone"


class Snapshot:
    """The records a ``snapshot:PATH`` names, by rank, read once."""

    def __init__(self, path_text: str) -> None:
        from probe.snapshot import store, torch_dump
        from probe.snapshot.record import read_rank

        self.path = path_text
        self.torch = torch_dump.looks_like_dumps(path_text)
        files = list(torch_dump.dump_files(path_text).values()) if self.torch else store.resolve(path_text)
        _warn_foreign(files, with_directory=not self.torch)
        if self.torch:
            found = torch_dump.records(path_text)
        else:
            found = [read_rank(f) for f in files]
        self.records: Dict[int, Dict[str, Any]] = {}
        for record in found:
            self.records.setdefault(int(record["rank"]), record)
        if not self.records:
            raise UsageError("no rank's record at %s" % path_text)

    @property
    def ranks(self) -> List[int]:
        return sorted(self.records)

    def evidence(self, rank: int) -> Tuple[Any, Any]:
        from probe.snapshot.record import evidence_from_json

        first, last = self.records[rank]["evidence"]
        return evidence_from_json(first), evidence_from_json(last)

    # -- diagnose --------------------------------------------------------------------------------

    def samples(self, ranks: Optional[Sequence[int]] = None) -> Tuple[Any, Any, int]:
        """The two looks as ``diagnose`` samples (first, last) and how many looks there were (1 where every
        rank was looked at once: a rank that could not answer, a torch dump)."""
        from probe.diagnose.evidence import Sample

        chosen = [r for r in self.ranks if ranks is None or r in ranks]
        firsts, lasts, window, looks = {}, {}, 0.0, 1
        for rank in chosen:
            first, last = self.evidence(rank)
            for ev in (first, last):
                if ev.state == "recorded":  # a torch dump's rank holds its Flight Recorder alone: the rules
                    ev.state = "answering"  # read it as a rank whose evidence is that (no stacks, no threads)
            firsts[rank], lasts[rank] = first, last
            if last.at > first.at:  # the same host's monotonic clock for one rank's two looks
                window = max(window, last.at - first.at)
                looks = 2
        single = len(chosen) == 1 and str(self.records[chosen[0]].get("job") or "").startswith("pid")  # one process
        from probe.client.stack_history import from_records

        history = from_records([self.records[r] for r in chosen], current=True) or None
        return (Sample(firsts, len(chosen), single, 0.0, recorded=True),
                Sample(lasts, len(chosen), single, window, recorded=True, history=history), looks)

    def judge(self, command: Any, ranks: Optional[Sequence[int]] = None) -> Any:
        """``diagnose``'s report on the recorded looks, judged by the same rules as a live job."""
        from probe.diagnose.rules import judge

        first, last, looks = self.samples(ranks)
        report = judge(first, last, lambda rs, rest: _LIVE + command(rs, rest) if _needs_live(rest, self.torch)
                       else command(rs, rest))
        report.samples = looks
        if self.torch and report.status == "healthy":  # one look, no stacks: say what the dumps do show
            report.verdicts = [_dumps_verdict(last, command)]
            report.status = report.verdicts[0].status
        locals_kept = any("python.locals" in (r.get("tables") or {}) for r in self.records.values())
        for verdict in report.verdicts:  # what only a live process can do is left out of a record's advice
            if self.torch:  # no stacks in a dump: where each rank last issued a collective, from its recorder
                verdict.evidence = [p for p in verdict.evidence if not p.text.endswith("(no stack)")]
                verdict.evidence += _call_sites(last, verdict.culprits + verdict.victims)
            for piece in verdict.evidence:
                if piece.command and piece.command.startswith(_LIVE):
                    piece.command = None
            dropped = [step for step in verdict.next if _LIVE in step]
            verdict.next = [step for step in verdict.next if _LIVE not in step]
            if dropped and verdict.culprits and locals_kept:
                verdict.next.append("its locals as they were (innermost frames): %s" % command(
                    verdict.culprits[:1], "query \"SELECT thread_name, depth, func, name, value FROM python.locals "
                                          "ORDER BY thread_name, depth\""))
        return report

    def about(self) -> Dict[str, Any]:
        """When it was recorded, why, of which job and ranks."""
        records = [self.records[r] for r in self.ranks]
        when = min(float(r.get("recorded_at") or 0.0) for r in records)
        reasons = sorted({str(r.get("reason") or "") for r in records} - {""})
        return {"path": self.path, "torch_dump": self.torch, "job": records[0].get("job"), "recorded_at": when,
                "recorded_utc": _utc(when), "reasons": reasons, "ranks": self.ranks}

    def about_line(self) -> str:
        about = self.about()
        from probe.client.cluster import compact_ranks

        ago = max(0.0, time.time() - about["recorded_at"])
        what = ("torch Flight Recorder dumps of rank%s %s (no stacks in them)" if self.torch else
                "a record of rank%s %s") % ("" if len(self.ranks) == 1 else "s", compact_ranks(self.ranks))
        record = self.records[self.ranks[0]]
        if len(self.ranks) == 1 and str(record.get("job") or "").startswith("pid") and record.get("pid"):
            what = "a record of process %s" % record["pid"]
        why = "" if self.torch else ", %s" % "; ".join(about["reasons"] or ["reason not said"])
        return ("RECORD: %s, written %s (%s ago)%s; the ranks may be gone since: this is what they were then"
                % (what, about["recorded_utc"], _ago(ago), why))


_LIVE = "\0live\0"  # marks the commands that need a live process in the rules' advice


def _needs_live(rest: str, no_stacks: bool = False) -> bool:
    words = rest.split()
    return bool(words) and (words[0] in ("eval", "checkpoint", "trace", "debug", "lr", "inject", "repl")
                            or "--native" in words or no_stacks and words[0] == "backtrace")


def _call_sites(sample: Any, ranks: Sequence[int]) -> List[Any]:
    """Evidence: where each rank issued its last collective (the recorder keeps the call's stack)."""
    from probe.diagnose.verdict import Evidence

    out = []
    for rank in ranks:
        ev = sample.ranks.get(rank)
        for row in (ev.fr or ()) if ev is not None else ():
            frames = [f.strip() for f in str(row.get("call_site") or "").split(";") if f.strip()]
            own = [f for f in frames if "site-packages/" not in f and "/lib/python3" not in f]
            if own:
                out.append(Evidence("rank %d issued its last collective, #%s (%s), at %s" % (
                    rank, row.get("last_seq"), row.get("last_op"), own[0]), None, [rank]))
    return out


def _dumps_verdict(sample: Any, command: Any) -> Any:
    """Where no rank of torch's dumps is behind another: each group's last collective issued by every rank
    and finished (no hang in them), or finished by none (the collective itself hangs)."""
    from probe.diagnose.verdict import Evidence, Verdict, ranks_word

    groups: Dict[str, Dict[int, Dict[str, Any]]] = {}
    for rank, ev in sample.ranks.items():
        for row in ev.fr or ():
            groups.setdefault(str(row.get("pg")), {})[rank] = row
    fr_cmd = command(None, "query \"SELECT pg, max(collective_seq_id) AS last FROM torch.flight_recorder GROUP BY 1\"")
    ranks = sorted(sample.ranks)
    for pg, rows in sorted(groups.items()):
        seqs = {int(r["last_seq"]) for r in rows.values()}
        if len(rows) < 2 or len(seqs) != 1 or any(r.get("last_done") for r in rows.values()):
            continue
        row = rows[min(rows)]
        desc = " (%s)" % row["pg_desc"] if row.get("pg_desc") else ""
        ages = [float(r["last_age"]) for r in rows.values() if r.get("last_age") is not None]
        summary = ("collective stuck in process group %s%s: %s issued %s #%d and none finished it; no rank is "
                   "missing from it: the collective itself hangs (the network, a device), or a rank without a dump"
                   % (pg, desc, ranks_word(sorted(rows)), row.get("last_op"), seqs.pop()))
        evidence = [Evidence("Flight Recorder dumps, group %s: not done on any rank%s" % (
            pg, ", issued %s before each dump" % span(min(ages), max(ages), "%.1f", "s") if ages else ""), fr_cmd, sorted(rows))]
        return Verdict("collective_stuck", "stuck", summary, [], sorted(rows), None, evidence, [])
    lasts = ", ".join("group %s #%s" % (pg, max(int(r["last_seq"]) for r in rows.values()))
                      for pg, rows in sorted(groups.items()))
    if len(ranks) < 2:
        return Verdict("unknown", "degraded", "only %s's dump: its last collectives are %s; the other ranks' dumps tell "
                       "whether one of them did not issue it" % (ranks_word(ranks), lasts or "none"), [], [], None,
                       [Evidence("Flight Recorder dump", fr_cmd, ranks)],
                       ["read every rank's dump at once: snapshot:DIR (the directory) or snapshot:PREFIX"])
    summary = "no rank behind another in the dumps of %s%s" % (
        ranks_word(ranks), " (last collectives: %s, finished)" % lasts if lasts else ": they hold no collective")
    return Verdict("healthy", "healthy", summary, [], [], None, [Evidence("Flight Recorder dumps", fr_cmd, ranks)], [])


def _utc(when: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(when))


def _ago(seconds: float) -> str:
    if seconds < 120:
        return "%d s" % seconds
    if seconds < 7200:
        return "%d min" % (seconds // 60)
    if seconds < 172800:
        return "%.1f h" % (seconds / 3600)
    return "%d days" % (seconds // 86400)


def _warn_foreign(files: Sequence[str], with_directory: bool) -> None:
    """One line on stderr where another user wrote what is about to be read (asked for by its path: a
    listing leaves such records out): a record in a shared directory can be planted. ``with_directory``:
    a snapshot's directory too (probe made it; a torch dump's directory may be anyone's, /tmp)."""
    from probe._stderr import say
    from probe.snapshot.store import foreign_owner

    for path in (sorted({os.path.dirname(f) for f in files}) if with_directory else []) + list(files):
        owner = foreign_owner(path)
        if owner is not None:
            say("probe: warning: %s was written by %s, not by you: anyone who can write there could have planted "
                "it, so take what it says as that user's word" % (path, owner))
            return


def open_snapshot(target_text: str) -> Snapshot:
    text = target_text.strip()
    path = text[len(PREFIX):] if text.startswith(PREFIX) else text
    if not path:
        raise UsageError("snapshot: target needs a path", hint="e.g. snapshot:DIR/<id> (`probe snapshots DIR` "
                                                               "lists them), or a directory of torch FR dumps")
    return Snapshot(path)


# -- one rank -------------------------------------------------------------------------------------------


class RecordClient:
    """One rank of a snapshot, answering the read commands of :class:`probe.client.Client` from its record."""

    def __init__(self, snapshot: Snapshot, rank: int, label: Optional[str] = None, every_rank: bool = False) -> None:
        self.snapshot = snapshot
        self.rank = rank
        self.every_rank = every_rank
        """SQL over every rank's rows at once, ``rank`` and ``host`` first (the client of the plain target)."""
        self.record = snapshot.records[rank]
        self.pid: Optional[int] = self.record.get("pid") if isinstance(self.record.get("pid"), int) else None
        # pid None in the target: nothing here is a process of this host to read from outside
        self.target = Target(label or "%s%s" % (PREFIX, snapshot.path), UnixAddress(os.devnull), None, None,
                             snapshot.path)
        self.note: Optional[str] = None
        self.timeout = 30.0
        self.helper = None
        self.remote_pid = None
        self._token = None

    refuses = LIVE_ONLY  # a record's ranks may be gone: what needs a live process is refused (see _refuse)

    def __repr__(self) -> str:
        return "<probe.RecordClient rank %d of %s>" % (self.rank, self.snapshot.path)

    # -- reads ------------------------------------------------------------------------------------

    def health(self, fallback: bool = True) -> Dict[str, Any]:
        """Who the rank was; ``state`` ``record`` (no agent answers a record)."""
        record = self.record
        last = record["evidence"][-1] or {}
        when = float(record.get("recorded_at") or 0.0)
        return {"agent": "none: a record", "state": "record", "pid": self.pid, "host": record.get("host"),
                "rank": self.rank, "recorded_at": when, "reason": record.get("reason"),
                "recorded_state": last.get("state"),
                "why": "recorded %s (%s), state then: %s; the process may be gone" % (
                    _utc(when), record.get("reason") or "reason not said", last.get("state") or "unknown"),
                "tables": sorted(record.get("tables") or {})}

    def tables(self) -> List[TableInfo]:
        return [self.schema(name) for name in sorted(self.record.get("tables") or {})]

    def schema(self, name: str) -> TableInfo:
        from probe.tables.registry import get_table

        table = self._table(name)
        spec = get_table(name)
        described = {c.name: c.description for c in spec.columns} if spec is not None else {}
        columns = tuple(ColumnInfo(n, t, described.get(n, "")) for n, t in _columns(name, table["columns"]))
        description = (spec.description if spec is not None else "") + " (as recorded%s)" % (
            ", cut: the record is bounded" if table.get("truncated") else "")
        return TableInfo(name, description.strip(), columns, spec.example if spec is not None else None)

    def table_rows(self, name: str, max_rows: Optional[int] = None, columns: Optional[List[str]] = None) -> Rows:
        """The table's rows as recorded (timestamps as ISO text, as the agent sends them); at most
        ``max_rows``, only ``columns`` where given (as :meth:`probe.client.Client.table_rows`)."""
        table = self._table(name)
        kept = _columns(name, table["columns"])
        rows = Rows(tuple(kept), [_coerced(kept, row) for row in table["rows"]], bool(table.get("truncated")))
        if columns is not None:
            wanted = [i for i, (n, _) in enumerate(kept) if n in columns] or [0]
            rows = Rows(tuple(kept[i] for i in wanted), [[r[i] for i in wanted] for r in rows.rows], rows.truncated)
        if max_rows is not None and len(rows.rows) > max_rows:
            rows = Rows(rows.columns, rows.rows[:max_rows], True)
        return rows

    def _table(self, name: str) -> Dict[str, Any]:
        table = (self.record.get("tables") or {}).get(name)
        if isinstance(table, dict):
            return table
        why = (self.record.get("missing") or {}).get(name)
        kept = ", ".join(sorted(self.record.get("tables") or {})) or "none"
        if why:
            raise NotFound("%s was not recorded for rank %d: %s" % (name, self.rank, why),
                           hint="the record holds: %s" % kept)
        raise NotFound("%s is not in the record of rank %d" % (name, self.rank),
                       hint="a record keeps only some tables: %s" % kept)

    def backtrace(self, native: bool = False, fallback: bool = True) -> List[Frame]:
        """The rank's stacks as recorded (from its agent, or read from outside then: ``note`` says so)."""
        if native:
            raise UsageError("a record holds no native frames", hint="leave out --native")
        self.note = None
        _, last = self.snapshot.evidence(self.rank)
        if last.frames:
            if last.state != "answering":
                self.note = "stacks %s (the rank's state then: %s)" % (last.source, last.state.replace("_", " "))
            return list(last.frames)
        if "python.backtrace" in (self.record.get("tables") or {}):
            rows = self.table_rows("python.backtrace").as_dicts()
            return [Frame(*(row.get(n) for n in Frame._fields[:-1]), row.get("frame_type") or "python") for row in rows]
        self._table("python.backtrace")  # raises, saying why there are no stacks
        return []

    def query_rows(self, sql: str, max_rows: Optional[int] = None, timeout: Optional[float] = None,
                   native: bool = False, query_id: Optional[str] = None) -> Rows:
        from probe.client.local_sql import rows_of

        return rows_of(self.query(sql, max_rows=max_rows, timeout=timeout, native=native))

    def query(self, sql: str, max_rows: Optional[int] = None, timeout: Optional[float] = None,
              native: bool = False, query_id: Optional[str] = None) -> Any:
        """SQL over the recorded tables, in probe's locked-down engine (as for an agent without DuckDB)."""
        from probe.client.local_sql import _revive, run_here
        from probe.tables.arrow import to_arrow

        if native:
            raise UsageError("a record holds no native frames", hint="leave out --native")
        self.note = None

        left_out: List[str] = []

        def one(client: "RecordClient", name: str) -> Any:
            rows = client.table_rows(name)
            return to_arrow(rows.columns, [_revive(rows.columns, r) for r in rows.rows])

        def fetch(name: str) -> Any:
            if not self.every_rank:
                try:
                    return one(self, name)
                except NotFound:
                    if name not in (self.record.get("missing") or {}) and not _known(name):
                        return None  # not a table at all: the engine says so
                    raise
            return self._union(name, one, left_out)


        result = run_here(sql, fetch, max_rows, timeout)  # in the client's SQL worker, under its memory ceiling
        if left_out:
            self.note = "not in the record of %s" % "; ".join(left_out)
        return result.table.replace_schema_metadata({"probe.truncated": "true" if result.truncated else "false"})

    def _union(self, name: str, one: Any, left_out: List[str]) -> Any:
        """Every rank's rows of ``name``, with ``rank`` and ``host`` first (as --all-ranks rows have them)."""
        import pyarrow as pa

        from probe.client.cluster import compact_ranks

        tables, missing, first_error = [], {}, None
        for rank in self.snapshot.ranks:
            client = self if rank == self.rank else RecordClient(self.snapshot, rank)
            try:
                table = one(client, name)
            except NotFound as exc:
                first_error = first_error or exc
                why = (client.record.get("missing") or {}).get(name) or "not recorded"
                missing.setdefault(str(why), []).append(rank)
                continue
            n = table.num_rows
            table = table.add_column(0, "host", pa.array([str(client.record.get("host") or "")] * n, pa.string()))
            tables.append(table.add_column(0, "rank", pa.array([rank] * n, pa.int64())))
        if not tables:
            if not missing or first_error is None or (not _known(name) and all(
                    name not in (self.snapshot.records[r].get("missing") or {}) for r in self.snapshot.ranks)):
                return None  # not a table at all: the engine says so
            raise first_error
        for why, ranks in missing.items():
            left_out.append("%s for rank%s %s: %s" % (name, "" if len(ranks) == 1 else "s", compact_ranks(ranks), why))
        return pa.concat_tables(tables, promote_options="permissive")

    def interrupt_query(self, query_id: str) -> str:
        return "finished"  # a record's query runs here, and is over once it returns

    # -- what needs a live process ----------------------------------------------------------------

    def _refuse(self, what: str) -> UsageError:
        return UsageError("%s: %s needs a live process" % (_GONE, what),
                          hint="run it against the live job (probe HOST:PORT %s ...); a snapshot answers backtrace, "
                               "query, tables, schema, ranks, health and diagnose" % what.split()[0])

    def eval(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse("eval")

    def interrupt_eval(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse("eval")

    def interrupt_eval_detail(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse("eval")

    def complete(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse("repl")

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse("checkpoint")

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse("trace")

    trace_start = trace_stop = trace_status = trace_export = trace

    def debug_start(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse("debug")

    debug_stop = debug_start

    def _json(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse("this request")

    def _answer_wait(self, *args: Any, **kwargs: Any) -> Any:  # how lr and other snippets start
        raise self._refuse("lr")


_SQL_TYPES = {"bool": "BOOLEAN", "double": "DOUBLE", "float": "DOUBLE", "halffloat": "DOUBLE", "string": "VARCHAR",
              "large_string": "VARCHAR"}


def _known(name: str) -> bool:
    from probe.tables.registry import get_table

    return get_table(name) is not None


def _columns(table: str, columns: Any) -> List[Tuple[str, str]]:
    """(name, SQL type) of a recorded table: the table's own spec where it declares the column, else the
    recorded type (an agent's answer says Arrow's: int64, string, timestamp[us]...) in SQL's words."""
    from probe.tables.registry import get_table
    from probe.tables.spec import COLUMN_TYPES

    spec = get_table(table)
    declared = {c.name: c.type for c in spec.columns} if spec is not None else {}
    out = []
    for item in columns or ():
        name, given = str(item[0]), str(item[1]) if len(item) > 1 else "VARCHAR"
        if name in declared:
            sql = declared[name]
        elif given in COLUMN_TYPES:
            sql = given
        elif given.startswith(("int", "uint")):
            sql = "BIGINT"
        elif given.startswith("timestamp"):
            sql = "TIMESTAMP"
        elif given.startswith(("list<", "large_list<")) and "string" in given:
            sql = "VARCHAR[]"
        else:
            sql = _SQL_TYPES.get(given, "VARCHAR")
        out.append((name, sql))
    return out


def _coerced(columns: Sequence[Tuple[str, str]], row: Sequence[Any]) -> List[Any]:
    """A recorded row with each value of its column's type (a value that is not becomes NULL, or text)."""
    out = []
    for (_, sql), value in zip(columns, row):
        if value is None:
            out.append(None)
        elif sql in ("BIGINT", "INTEGER"):
            out.append(value if isinstance(value, int) and not isinstance(value, bool) else _number(value, int))
        elif sql == "DOUBLE":
            out.append(float(value) if isinstance(value, (int, float)) and not isinstance(value, bool)
                       else _number(value, float))
        elif sql == "BOOLEAN":
            out.append(value if isinstance(value, bool) else None)
        elif sql == "TIMESTAMP":
            out.append(value if isinstance(value, (str, datetime.datetime)) and _timestamp_ok(value) else None)
        elif sql == "VARCHAR[]":
            out.append([None if v is None else str(v) for v in value] if isinstance(value, list) else None)
        else:
            out.append(value if isinstance(value, str) else json.dumps(value, default=str))
    out.extend([None] * (len(columns) - len(out)))
    return out


def _number(value: Any, kind: Any) -> Any:
    try:
        return kind(value)
    except (TypeError, ValueError, OverflowError):
        return None


def _timestamp_ok(value: Any) -> bool:
    if isinstance(value, datetime.datetime):
        return True
    try:
        datetime.datetime.fromisoformat(value)
        return True
    except ValueError:
        return False


# -- every rank -----------------------------------------------------------------------------------------


class RecordCluster(Cluster):
    """Every rank of a snapshot, as :class:`probe.client.cluster.Cluster` (the same fan-out, grouping and
    failures), each rank's client a :class:`RecordClient`."""

    def __init__(self, snapshot: Snapshot, ranks: Optional[Sequence[int]] = None, deadline: float = DEFAULT_DEADLINE,
                 max_in_flight: int = DEFAULT_IN_FLIGHT) -> None:
        self.snapshot = snapshot
        members = []
        for rank in snapshot.ranks if ranks is None else ranks:
            record = snapshot.records[rank]
            state = (record["evidence"][-1] or {}).get("state")
            members.append(Member(rank, str(record.get("host") or "?"), str(record.get("host") or "?"), None,
                                  record.get("pid") if isinstance(record.get("pid"), int) else None,
                                  "recorded" if state in ("answering", "recorded") else state,
                                  world_size=len(snapshot.records)))
        super().__init__(members, None, deadline=deadline, max_in_flight=max_in_flight)
        self.via = "direct"

    def __repr__(self) -> str:
        return "<probe.RecordCluster %d ranks of %s>" % (len(self.members), self.snapshot.path)

    def _client(self, member: Member) -> Any:
        return RecordClient(self.snapshot, member.rank, "%s%s" % (PREFIX, self.snapshot.path))

    def select(self, ranks: Sequence[int]) -> "RecordCluster":
        from probe.client.cluster import compact_ranks

        missing = set(ranks) - set(self.snapshot.records)
        if missing:
            raise UsageError("no rank %s in this snapshot (ranks %s)" % (compact_ranks(sorted(missing)),
                                                                         compact_ranks(self.snapshot.ranks)))
        chosen = RecordCluster(self.snapshot, sorted(set(ranks)), self.deadline, self.max_in_flight)
        chosen.progress = self.progress
        return chosen

    def interrupt(self, kind: str, run_id: str, deadline: float = 3.0,
                  ranks: Optional[Sequence[int]] = None) -> Dict[int, str]:
        return {m.rank: "finished" for m in self.members if ranks is None or m.rank in ranks}

    def stack_history_rows(self, current: bool = False) -> List[List[Any]]:
        """``cluster.stack_history`` as these ranks' records carry it (``probe.client.stack_history``)."""
        from probe.client.stack_history import from_records

        return from_records([self.snapshot.records[m.rank] for m in self.members], current)

    @property
    def recorded(self) -> "RecordCluster":
        """``diagnose`` judges the looks these ranks recorded (:meth:`judge`) instead of sampling."""
        return self

    def judge(self, command: Any) -> Any:
        return self.snapshot.judge(command, [m.rank for m in self.members])

    def about(self) -> Dict[str, Any]:
        return self.snapshot.about()

    def about_line(self) -> str:
        return self.snapshot.about_line()


def connect_record(target_text: str) -> RecordClient:
    """The client of ``probe snapshot:PATH COMMAND``: the lowest rank recorded (rank 0 of a whole job)."""
    snapshot = open_snapshot(target_text)
    return RecordClient(snapshot, snapshot.ranks[0], target_text.strip(), every_rank=True)


def connect_record_all(target_text: str, deadline: float = DEFAULT_DEADLINE,
                       max_in_flight: int = DEFAULT_IN_FLIGHT) -> RecordCluster:
    """Every rank of ``snapshot:PATH``, for commands across ranks."""
    return RecordCluster(open_snapshot(target_text), None, deadline, max_in_flight)


# The client opens snapshot:PATH through this (probe.client.sources): it never imports this module.
register_kind(PREFIX, SourceKind(connect_record, connect_record_all, "a snapshot record"))
