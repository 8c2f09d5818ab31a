"""``cluster.stack_history``: where each rank has been, as its node helper sampled it (``probe.host.history``).

The table is the job's, not a rank's: like ``cluster.ranks`` it is read here, from the node helpers
(``GET /v1/stack_history`` of each distinct helper the member list names), or from a snapshot's records,
and never joined with a rank's tables. A helper sends each distinct stack once with the rows that refer to
it (``stacks``: id -> [func, frames]; ``rows``: [time, rank, pid, thread, stack id, source]); the rows are
joined here. ``current`` asks only each thread's current run: its newest samples back to the first whose
stack differs in shape (functions and files, lines aside), which is what ``diagnose`` says "since" from.

Rows here are plain lists in ``COLUMNS`` order, ``time`` as epoch seconds (a ``TIMESTAMP``, UTC, in SQL).
"""

import datetime
import json
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

__all__ = ["COLUMNS", "TABLE", "names_history", "fetch", "current_or_none", "rows_of_answer", "to_arrow", "current_runs",
           "since_lines", "carry", "from_records", "shape_of", "innermost_own"]

TABLE = "cluster.stack_history"
COLUMNS: Tuple[Tuple[str, str], ...] = (
    ("time", "TIMESTAMP"), ("rank", "INTEGER"), ("host", "VARCHAR"), ("pid", "INTEGER"), ("thread", "VARCHAR"),
    ("stack_id", "VARCHAR"), ("source", "VARCHAR"), ("func", "VARCHAR"), ("frames", "VARCHAR"))
"""``frames``: the JSON text of [[func, file, line], ...], innermost first; ``func`` its innermost function;
``source``: ``agent``, or ``outside`` where the rank's agent could not answer and its helper read it."""
ASK_S = 5.0  # one helper's answer
MIN_SAMPLES = 2  # a run of fewer says nothing of "since"
_MAX_ROWS = 2_000_000  # rows taken from all the helpers together
_LIBRARY = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen ")


def names_history(sql: str) -> bool:
    """Whether ``sql`` reads ``cluster.stack_history`` (the text mentions it; the engine decides the rest)."""
    import re

    return re.search(r'\b"?cluster"?\s*\.\s*"?stack_history"?(?![A-Za-z0-9_])', sql, re.IGNORECASE) is not None


# -- from the helpers -----------------------------------------------------------------------------------------


def fetch(cluster: Any, current: bool = False, deadline: float = ASK_S) -> List[List[Any]]:
    """The job's history: from a snapshot (a cluster with ``stack_history_rows``), else from every node helper
    the member list names, asked at once; a helper that cannot answer leaves its ranks out (none is an error:
    ``probe.errors.ProbeError`` saying why, where no helper answered)."""
    own = getattr(cluster, "stack_history_rows", None)
    if own is not None:
        return own(current)  # type: ignore[no-any-return]
    import probe.client.transport as transport
    from probe.client.fanout import fan_out
    from probe.client.members import _host_of
    from probe.errors import ProbeError

    members = list(getattr(cluster, "members", ()))
    helpers = sorted({m.helper for m in members if m.helper})
    if not helpers:
        raise ProbeError("%s is kept by the node helpers, and this job's member list names none" % TABLE,
                         hint="address the job by its master's HOST:PROBE_PORT (or slurm:JOBID)")
    hosts = {m.helper: m.host for m in members if m.helper}
    token = getattr(cluster, "_token", None)
    path = "/v1/stack_history" + ("?current=1" if current else "")

    def ask(helper: str) -> List[List[Any]]:
        address = transport.TcpAddress(_host_of(helper), int(helper.rpartition(":")[2]))
        answer = transport.request(address, "GET", path, None, None, deadline, token=token)
        body = json.loads(bytes(answer.body).decode("utf-8"))
        if answer.status != 200:
            error = body.get("error") if isinstance(body, dict) else None
            raise ProbeError("the node helper at %s: %s" % (helper, (error or {}).get("message") or answer.status))
        return rows_of_answer(body, hosts.get(helper, helper.rpartition(":")[0]))

    outcomes = fan_out(helpers, ask, 16, deadline + 1.0)
    rows: List[List[Any]] = []
    errors = []
    for helper, outcome in zip(helpers, outcomes):
        if outcome.error is not None:
            errors.append("%s: %s" % (helper, outcome.error.message))
        else:
            rows.extend(outcome.value[:_MAX_ROWS - len(rows)])
    if errors and len(errors) == len(helpers):
        raise ProbeError("no node helper gave %s: %s" % (TABLE, "; ".join(errors[:3])),
                         hint="an older helper keeps no history; PROBE_STACK_EVERY=0 turns it off")
    rows.sort(key=lambda r: (r[1], r[4], r[0]))
    return rows


def current_or_none(cluster: Any, deadline: float = 2.0, whole: bool = False) -> Optional[List[List[Any]]]:
    """Each thread's current run (for ``diagnose``; ``whole``: the whole history, for a snapshot), or None
    where there is no history to ask; never raises."""
    if getattr(cluster, "stack_history_rows", None) is None and not any(
            getattr(m, "helper", None) for m in getattr(cluster, "members", ())):
        return None
    try:
        return fetch(cluster, not whole, deadline)
    except Exception:  # noqa: BLE001 -- no history: the verdicts say no "since"
        return None


def rows_of_answer(body: Any, host: str) -> List[List[Any]]:
    """A helper's answer as rows (``COLUMNS``), each checked: a row or stack that is not what a helper sends is
    left out."""
    if not isinstance(body, dict) or not isinstance(body.get("rows"), list) or not isinstance(body.get("stacks"), dict):
        return []
    stacks: Dict[str, Tuple[str, str]] = {}
    for key, value in body["stacks"].items():
        if isinstance(key, str) and isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
            stacks[key] = (value[0], value[1])
    out = []
    for row in body["rows"]:
        if not (isinstance(row, list) and len(row) == 6):
            continue
        at, rank, pid, thread, stack_id, source = row
        if not (isinstance(at, (int, float)) and isinstance(rank, int) and isinstance(thread, str)
                and stack_id in stacks and (pid is None or isinstance(pid, int)) and isinstance(source, str)):
            continue
        func, frames = stacks[stack_id]
        out.append([float(at), rank, host, pid, thread, stack_id, source, func, frames])
    return out


def to_arrow(rows: Sequence[Sequence[Any]]) -> Any:
    """The rows as a ``pyarrow.Table`` of ``COLUMNS`` (time as UTC ``TIMESTAMP``)."""
    from probe.tables.arrow import to_arrow as _to_arrow

    return _to_arrow(COLUMNS, [[_utc(r[0])] + list(r[1:]) for r in rows])


def _utc(at: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(at, datetime.timezone.utc).replace(tzinfo=None)


# -- runs: since when -----------------------------------------------------------------------------------------


def shape_of(frames: Sequence[Sequence[Any]]) -> Tuple[Tuple[str, str], ...]:
    """A stack's shape: its functions and files, lines aside (a loop that polls moves between lines)."""
    return tuple((str(f[0]), str(f[1])) for f in frames)


def current_runs(rows: Iterable[Sequence[Any]], shape: Callable[[Any], Any], thread_at: int = 4,
                 stack_at: int = 5) -> List[List[Any]]:
    """Of rows whose [0] is the time, [1] the rank, [``thread_at``] the thread and [``stack_at``] the stack id
    (``COLUMNS``' places by default), each (rank, thread)'s current run: its newest rows back to the first
    whose stack's ``shape(stack id)`` differs; oldest first."""
    by_thread: Dict[Tuple[Any, Any], List[Sequence[Any]]] = {}
    for row in rows:
        by_thread.setdefault((row[1], row[thread_at]), []).append(row)
    out: List[List[Any]] = []
    for seq in by_thread.values():
        seq.sort(key=lambda r: r[0])
        newest = shape(seq[-1][stack_at])
        start = len(seq) - 1
        while start > 0 and shape(seq[start - 1][stack_at]) == newest:
            start -= 1
        out.extend(list(r) for r in seq[start:])
    return out


def innermost_own(frames: Sequence[Sequence[Any]]) -> Optional[str]:
    """The innermost frame's function that is the program's own (not an installed package's nor the standard
    library's); the innermost's where none is."""
    for frame in frames:
        if not any(marker in str(frame[1]) for marker in _LIBRARY):
            return str(frame[0])
    return str(frames[0][0]) if frames else None


def since_lines(rows: Optional[Sequence[Sequence[Any]]], ranks: Sequence[int],
                thread: str = "MainThread") -> List[Tuple[int, str, str]]:
    """(rank, "rank N has been in FUNC since HH:MM:SS, K samples", the query that shows it) for each of
    ``ranks`` whose ``thread`` has a current run of at least ``MIN_SAMPLES`` samples (the time on this
    machine's clock): ``diagnose`` adds them to a stuck verdict's evidence."""
    out = []
    for rank in ranks:
        mine = [r for r in rows or () if r[1] == rank and r[4] == thread]
        if not mine:
            continue
        shapes: Dict[str, Any] = {}

        def shape(stack_id: str) -> Any:
            if stack_id not in shapes:
                shapes[stack_id] = shape_of(_frames(next(r[8] for r in mine if r[5] == stack_id)))
            return shapes[stack_id]

        run = current_runs(mine, shape)
        if len(run) < MIN_SAMPLES:
            continue
        func = innermost_own(_frames(run[-1][8])) or run[-1][7]
        out.append((rank, "rank %d has been in %s since %s, %d samples" % (
            rank, func, time.strftime("%H:%M:%S", time.localtime(run[0][0])), len(run)),
                    'query "SELECT time, thread, func, stack_id FROM %s WHERE rank = %d ORDER BY time"' % (TABLE, rank)))
    return out


def _frames(text: Any) -> List[List[Any]]:
    try:
        frames = json.loads(text) if isinstance(text, str) else []
    except ValueError:
        return []
    return [f for f in frames if isinstance(f, list) and len(f) == 3] if isinstance(frames, list) else []


# -- snapshots ------------------------------------------------------------------------------------------------


_STORED = COLUMNS[:7]  # a record's rows: without func and frames, which its stacks hold once each
STACK_BYTES = 1 << 20  # of one rank's stacks in its record: its oldest rows go where more would be needed


def carry(records: Sequence[Dict[str, Any]], rows: Sequence[Sequence[Any]]) -> None:
    """Put each rank's rows into its record, deduplicated as the helper keeps them:
    ``tables["cluster.stack_history"]`` = {"columns", "rows": [time (ISO text, UTC), rank, host, pid, thread,
    stack id, source], "stacks": {id: [func, frames]}}; the newest rows whose stacks fit in ``STACK_BYTES``."""
    by_rank: Dict[int, List[Sequence[Any]]] = {}
    for row in rows:
        by_rank.setdefault(row[1], []).append(row)
    for record in records:
        mine = sorted(by_rank.get(record.get("rank"), ()), key=lambda r: -r[0])  # type: ignore[arg-type]
        if not mine or not isinstance(record.get("tables"), dict):
            continue
        stacks: Dict[str, List[str]] = {}
        kept: List[List[Any]] = []
        size = 0
        for row in mine:
            if row[5] not in stacks:
                size += len(row[7]) + len(row[8])
                if size > STACK_BYTES:
                    break
                stacks[row[5]] = [row[7], row[8]]
            kept.append([_utc(row[0]).isoformat()] + list(row[1:7]))
        kept.reverse()
        record["tables"][TABLE] = {"columns": [list(c) for c in _STORED], "rows": kept, "stacks": stacks,
                                   "truncated": len(kept) < len(mine)}


def from_records(records: Iterable[Dict[str, Any]], current: bool = False) -> List[List[Any]]:
    """The rows the records carry (``COLUMNS``, time as epoch seconds), each checked: what :func:`carry` did
    not write is left out (a record is read as hostile)."""
    out: List[List[Any]] = []
    for record in records:
        table = (record.get("tables") or {}).get(TABLE) if isinstance(record.get("tables"), dict) else None
        if not isinstance(table, dict) or not isinstance(table.get("rows"), list) or \
                not isinstance(table.get("stacks"), dict):
            continue
        stacks = {k: v for k, v in table["stacks"].items()
                  if isinstance(v, list) and len(v) == 2 and all(isinstance(x, str) for x in v)}
        for row in table["rows"]:
            if not (isinstance(row, list) and len(row) == len(_STORED) and isinstance(row[0], str)
                    and isinstance(row[1], int) and isinstance(row[4], str) and isinstance(row[5], str)
                    and row[5] in stacks):
                continue
            try:
                at = datetime.datetime.fromisoformat(row[0]).replace(tzinfo=datetime.timezone.utc).timestamp()
            except ValueError:
                continue
            out.append([at] + [v if isinstance(v, (int, str)) or v is None else str(v) for v in row[1:]]
                       + stacks[row[5]])
    if current:
        shapes: Dict[str, Any] = {}
        for row in out:
            if row[5] not in shapes:  # each distinct stack's frames read once
                shapes[row[5]] = shape_of(_frames(row[8]))
        out = current_runs(out, shapes.__getitem__)
    out.sort(key=lambda r: (r[1], r[4], r[0]))
    return out
