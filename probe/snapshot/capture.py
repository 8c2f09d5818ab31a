"""A rank's record taken from the live target: what ``diagnose`` reads, twice, and a few bounded tables.

Only reads, as ``diagnose`` does: no eval, no collective, no device synchronisation. A rank whose agent
cannot answer (a C call holds its GIL, it is stopped, dead) is read from outside by the same evidence
code; its ``python.backtrace`` is made from those stacks, and the tables that need the agent are said
missing, with why. Nothing here raises: what failed is written in the record.
"""

import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from probe.errors import ProbeError, TorchNotLoaded
from probe.snapshot.record import evidence_to_json, new_record

__all__ = ["capture_rank", "capture_members", "TABLES", "failed_record"]

TABLE_BYTES = 512 * 1024
"""Each table's rows, as JSON, at most (the whole record is bounded again when written)."""

TABLES: Tuple[Tuple[str, str, int], ...] = (
    ("python.threads", "SELECT * FROM python.threads", 2000),
    ("python.locals", "SELECT * FROM python.locals WHERE depth < 3", 3000),
    ("torch.flight_recorder", "SELECT * FROM torch.flight_recorder", 4000),
    ("python.torch_trace", "SELECT * FROM (SELECT * FROM python.torch_trace ORDER BY time DESC, seq DESC "
                           "LIMIT 2000) ORDER BY time, seq", 2000),
    ("torch.steps", "SELECT * FROM torch.steps", 200),
    ("torch.anomalies", "SELECT * FROM torch.anomalies", 500),
    ("process.info", "SELECT * FROM process.info", 10),
)
"""(table, the SQL that reads it, rows at most): read from a rank whose agent answers. python.backtrace
is made from the evidence's own stacks (also for a rank read from outside)."""

_TORCH = ("torch.flight_recorder", "python.torch_trace", "torch.steps", "torch.anomalies")


def capture_rank(client: Any, rank: int, host: str, pid: Optional[int], reason: str, job: str,
                 gap: float = 1.0, secrets: Sequence[str] = ()) -> Dict[str, Any]:
    """One rank's record: ``diagnose``'s evidence twice, ``gap`` seconds apart (once, kept as both looks,
    where the rank cannot answer: it is not read from outside twice), then the tables. Never raises.
    ``secrets``: text that must not be written (the job's token): replaced by the mask wherever it shows."""
    start = time.monotonic()
    recorded_at = time.time()
    try:
        from probe.diagnose.gather import collect, forget

        forget(host, pid, rank)  # a record holds its own looks only, not an earlier stall's
        first = collect(client, rank, host, pid)
        last = first
        if first.state == "answering":
            wait = gap - (time.monotonic() - first.at)
            if wait > 0:
                time.sleep(wait)
            last = collect(client, rank, host, pid)
            last = _longer_look(client, rank, host, pid, first, last)
        looks = [_look(first, start), _look(last, start)]
    except Exception as exc:  # collect never raises; a bug here must not cost the other ranks their records
        return failed_record(job, rank, host, pid, reason, "%s: %s" % (type(exc).__name__, exc), recorded_at)
    record = new_record(job, rank, host, pid, reason, recorded_at, looks)
    try:
        _tables(client, last, record)
    except Exception as exc:
        record["missing"]["tables"] = "%s: %s" % (type(exc).__name__, exc)
    if last.state == "dead":
        record["crash"] = _crash_text(client, pid)
    record["seconds"] = round(time.monotonic() - start, 3)
    return _scrub(record, [s for s in (list(secrets) + [getattr(client, "_token", None) or ""]) if len(s) >= 6])


def _longer_look(client: Any, rank: int, host: str, pid: Optional[int], first: Any, last: Any) -> Any:
    """As diagnose does: where the rank showed no sign of life in the second (a stuck rank and a slow one
    look alike for a second; the rules call a wait a hang or a lock wait only over 2 s), look again at 3 s
    from the first look and keep that look instead."""
    from probe.diagnose.engine import LONGER_S
    from probe.diagnose.evidence import Sample
    from probe.diagnose.gather import collect
    from probe.diagnose.rules import needs_longer_look

    if last.state != "answering" or not needs_longer_look(Sample({rank: first}, 1), Sample({rank: last}, 1)):
        return last
    wait = LONGER_S - (time.monotonic() - first.at)
    if wait > 0:
        time.sleep(wait)
    return collect(client, rank, host, pid)


def _look(ev: Any, since: Optional[float] = None) -> Dict[str, Any]:
    """A look as the record keeps it; ``since``: RSS readings older than this capture are left out (a process
    that records again and again, the node helper's watch, keeps each rank's readings between records)."""
    out = evidence_to_json(ev)
    out["wall_at"] = time.time() - (time.monotonic() - ev.at)
    memory = out.get("memory")
    if since is not None and isinstance(memory, dict) and isinstance(memory.get("readings"), list):
        memory["readings"] = [r for r in memory["readings"] if isinstance(r, list) and r and r[0] >= since]
    return out


def _tables(client: Any, last: Any, record: Dict[str, Any]) -> None:
    from probe.tables.python_backtrace import COLUMNS

    tables, missing = record["tables"], record["missing"]
    if last.frames is not None:
        rows = [[frame.as_row()[c.name] for c in COLUMNS] for frame in last.frames]
        tables["python.backtrace"] = _bounded([[c.name, c.type] for c in COLUMNS], rows, False, "python.backtrace")
    else:
        missing["python.backtrace"] = last.why or "no stacks could be read"
    if last.state != "answering":
        why = "its agent cannot answer (%s)" % last.state.replace("_", " ")
        for name, _, _ in TABLES:
            missing[name] = why
        _copied_recorder(last, tables, missing)
        return
    torch_missing: Optional[str] = "torch is not loaded" if last.fr_why == "torch is not loaded" else None
    for name, sql, max_rows in TABLES:
        if name in _TORCH and torch_missing:
            missing[name] = torch_missing
            continue
        try:
            answer = client.query_rows(sql, max_rows=max_rows, timeout=5.0)
        except TorchNotLoaded:
            torch_missing = missing[name] = "torch is not loaded"
            continue
        except ProbeError as exc:
            missing[name] = exc.message
            continue
        if client.note:  # answered from stacks read from outside: the agent stopped answering meanwhile
            missing[name] = "the agent stopped answering: %s" % client.note.splitlines()[0]
            continue
        rows = [list(r) for r in answer.rows]
        if name == "python.locals":
            rows = _masked_locals(answer.columns, rows)
        elif name == "process.info":  # masked by the agent, unless it was told to show secrets: not on disk
            rows = _masked_column(answer.columns, rows, "cmdline")
        tables[name] = _bounded([[n, t] for n, t in answer.columns], rows, bool(answer.truncated), name)


def _copied_recorder(last: Any, tables: Dict[str, Any], missing: Dict[str, Any]) -> None:
    """A rank that cannot answer: ``torch.flight_recorder`` from the copy its agent kept while it ran, the
    record saying that it is a copy and of when (``missing`` holds the words, ``fr_copy`` the times)."""
    copy = last.fr_copy if isinstance(last.fr_copy, dict) else None
    if copy is None or not isinstance(copy.get("pid"), int):
        if last.fr_why:
            missing["torch.flight_recorder"] = last.fr_why
        return
    from probe.diagnose.fr_copy import copy_words, kept_rows
    from probe.tables.torch.flight_recorder import COLUMNS

    kept, bad = kept_rows(last)
    rows = [list(r) for r in kept[-4000:]]
    if rows:
        tables["torch.flight_recorder"] = _bounded([[c.name, c.type] for c in COLUMNS], rows, False,
                                                   "torch.flight_recorder")
        missing["torch.flight_recorder"] = "live rows missing: %s; these are %s" % (
            missing.get("torch.flight_recorder"), copy_words(last))
    elif bad or last.fr_why:
        missing["torch.flight_recorder"] = bad or last.fr_why


def _masked_locals(columns: Sequence[Tuple[str, str]], rows: List[List[Any]]) -> List[List[Any]]:
    """A local whose name looks secret shows the mask; credentials inside any value are masked (the rules of
    process.env's values, probe.tables.redact)."""
    from probe.tables.redact import mask_local

    names = [n for n, _ in columns]
    if "name" not in names or "value" not in names:
        return rows
    at_name, at_value = names.index("name"), names.index("value")
    for row in rows:
        if isinstance(row[at_value], str):
            row[at_value] = mask_local(str(row[at_name]), row[at_value])
    return rows


def _masked_column(columns: Sequence[Tuple[str, str]], rows: List[List[Any]], column: str) -> List[List[Any]]:
    from probe.tables.redact import mask_text

    names = [n for n, _ in columns]
    if column in names:
        at = names.index(column)
        for row in rows:
            if isinstance(row[at], str):
                row[at] = mask_text(row[at])
    return rows


def _bounded(columns: List[List[str]], rows: List[List[Any]], truncated: bool, name: str) -> Dict[str, Any]:
    from probe.snapshot.record import _dump

    while rows and len(_dump(rows)) > TABLE_BYTES:
        keep = len(rows) // 2
        rows = rows[len(rows) - keep:] if name in ("python.torch_trace", "torch.flight_recorder") else rows[:keep]
        truncated = True
    from probe.snapshot.record import _plain

    return {"columns": columns, "rows": _plain(rows), "truncated": truncated}


def _crash_text(client: Any, pid: Optional[int]) -> Optional[str]:
    """A dead rank's crash record (what faulthandler wrote at the signal), where this host has it."""
    if pid is None or not getattr(client.target, "is_local", False):
        return None
    try:
        from probe.reader import crash

        found = crash.dead_record(pid)
        if found is None:
            return None
        from probe.tables.redact import mask_text

        with open(found.path, "r", encoding="utf-8", errors="replace") as handle:
            return mask_text(handle.read(256 * 1024))  # its command line, as process.info shows it
    except Exception:  # no record, or one that cannot be read: nothing to copy
        return None


def _scrub(value: Any, secrets: Sequence[str]) -> Any:
    from probe.tables.redact import MASK

    if not secrets:
        return value
    if isinstance(value, str):
        for secret in secrets:
            if secret in value:
                value = value.replace(secret, MASK)
        return value
    if isinstance(value, dict):
        return {k: _scrub(v, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(v, secrets) for v in value]
    return value


def failed_record(job: str, rank: int, host: str, pid: Optional[int], reason: str, why: str,
                  recorded_at: Optional[float] = None) -> Dict[str, Any]:
    """The record of a rank that could not be recorded: its evidence says so (no answer, and why)."""
    from probe.diagnose.evidence import RankEvidence

    ev = RankEvidence(rank, host, pid, state="no_answer", why=why, source="none", threads_why="no answer",
                      fr_why="no answer", trace_why="no answer")
    record = new_record(job, rank, host, pid, reason, time.time() if recorded_at is None else recorded_at,
                        [_look(ev), _look(ev)])
    record["missing"]["evidence"] = why
    return record


def capture_members(clients_and_members: Sequence[Tuple[Any, Any]], reason: str, job: str, deadline: float,
                    gap: float = 1.0, secrets: Sequence[str] = (), max_in_flight: int = 32) -> List[Dict[str, Any]]:
    """A record of every rank, concurrently (``probe.client.fanout``), within about ``deadline`` seconds:
    a rank still being recorded then gets a record that says it gave none in time. ``clients_and_members``:
    (client, member) pairs, a member having ``rank``, ``host`` and ``pid``. In the order given."""
    from probe.client.fanout import fan_out

    pairs = list(clients_and_members)

    def one(pair: Tuple[Any, Any]) -> Dict[str, Any]:
        client, member = pair
        return capture_rank(client, member.rank, member.host, member.pid, reason, job, gap, secrets)

    outcomes = fan_out(pairs, one, max_in_flight, deadline)
    out = []
    for (_, member), outcome in zip(pairs, outcomes):
        if outcome.error is None and isinstance(outcome.value, dict):
            out.append(outcome.value)
        else:
            why = outcome.error.message if outcome.error is not None else "no record"
            out.append(failed_record(job, member.rank, member.host, member.pid, reason, why))
    return out
