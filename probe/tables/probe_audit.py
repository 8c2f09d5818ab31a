"""``probe.audit``: this process's audit trail as a table, and the reading of a trail's files.

The agent writes the trail (``probe.agent.audit``: who asked for what, before it runs and with its outcome
after); this module only reads the files it leaves in the runtime directory, so that the table, the CLI's
``probe PID audit`` after the process died, and the trail's own pruning agree on one file format.
Stdlib only.
"""

import json
import os
import re
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from probe import _paths
from probe.tables.spec import Column

__all__ = ["NAME", "DESCRIPTION", "COLUMNS", "EXAMPLE", "rows", "before_read", "trail_files", "records", "actions",
           "ACTIONS", "READS", "REFUSED", "KINDS"]

ACTIONS, READS, REFUSED = "", "reads", "refused"
KINDS = (ACTIONS, READS, REFUSED)
_NAME = re.compile(r"^audit-(\d+)-(\d+)(?:\.(reads|refused))?\.jsonl(\.\d+)?$")


# -- reading ----------------------------------------------------------------------------------------

def trail_files(pid: int, directory: Optional[str] = None) -> List[str]:
    """The files of the newest trail of process ``pid`` in ``directory`` (the runtime directory): its
    refusals and reads, then its actions, each kind oldest first (the current file of actions last);
    [] when there is none."""
    directory = directory or _paths.runtime_dir()
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    trails: Dict[int, List[Tuple[int, int, str]]] = {}
    for name in names:
        match = _NAME.match(name)
        if match and int(match.group(1)) == pid:
            order = KINDS.index(match.group(3) or ACTIONS)
            trails.setdefault(int(match.group(2)), []).append((-order, -int((match.group(4) or ".0")[1:]), name))
    if not trails:
        return []
    newest = trails[max(trails)]
    return [os.path.join(directory, name) for _, _, name in sorted(newest)]


def records(paths: List[str]) -> Iterator[Dict[str, Any]]:
    """The records of the files ``paths`` (in order); a line that is not a JSON object is skipped."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            with os.fdopen(fd, "rb") as handle:
                data = handle.read(64 << 20)
        except OSError:
            continue
        for line in data.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                yield record


def actions(paths: List[str]) -> List[Dict[str, Any]]:
    """One entry per action: its start record with the outcome of its end (``running`` where none came
    yet, ``unknown`` when the process is gone), in the order they began."""
    out: List[Dict[str, Any]] = []
    by_seq: Dict[Tuple[Any, Any], Dict[str, Any]] = {}
    for record in records(paths):
        key = (record.get("pid"), record.get("seq"))
        phase = record.get("phase")
        if phase == "refused" and key in by_seq:  # a window's count again: keep the highest
            entry = by_seq[key]
            if _number(record.get("count")) > _number(entry.get("count")):
                entry.update(count=record.get("count"), last=record.get("last"))
        elif phase in ("start", "refused"):
            entry = dict(record)
            entry.pop("phase", None)
            entry.setdefault("outcome", None)
            if phase == "refused":
                entry.setdefault("count", 1)  # a trail written before refusals were counted
            by_seq[key] = entry
            out.append(entry)
        elif phase == "end" and key in by_seq:
            entry = by_seq[key]
            entry.update(outcome=record.get("outcome"), error=record.get("error"), elapsed_ms=record.get("elapsed_ms"),
                         ended=record.get("time"))
    out.sort(key=lambda e: _number(e.get("time")))  # the kinds' files interleaved, in the order they began
    return out


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


# -- the table probe.audit --------------------------------------------------------------------------

NAME = "probe.audit"
DESCRIPTION = ("This process's audit trail: every control and eval request (eval and REPL input, checkpoint, debug "
               "start/stop, trace start/stop/export, lr change, interrupts) and every refused one, with who asked "
               "and what came of it; reads too where the target set PROBE_AUDIT_READS=1. Also `probe T audit`.")


def _columns() -> Tuple[Any, ...]:
    return (
        Column("time", "TIMESTAMP", "When the request was taken (UTC), before it ran."),
        Column("seq", "BIGINT", "The action's number in this process's trail."),
        Column("pid", "BIGINT", "The process that served it."),
        Column("scope", "VARCHAR", "The scope the request needed: read, control or eval."),
        Column("granted_by", "VARCHAR", "What gave the asker a scope: full token, control token, read token, "
                                        "unix socket owner."),
        Column("peer", "VARCHAR", "Who asked: 'uid U pid P' on the unix socket, HOST:PORT on TCP."),
        Column("command", "VARCHAR", "eval, repl, checkpoint, debug start, trace start, lr, ..."),
        Column("detail", "VARCHAR", "The request's options as JSON (path, thread, port, trace options, ...)."),
        Column("code", "VARCHAR", "The snippet or expressions, cut at 4 KB."),
        Column("code_sha256", "VARCHAR", "sha256 of the whole snippet (hex)."),
        Column("code_bytes", "BIGINT", "Length of the whole snippet in bytes."),
        Column("outcome", "VARCHAR", "ok, error, interrupted, refused; NULL while it runs."),
        Column("error", "VARCHAR", "What went wrong (the error's first words)."),
        Column("elapsed_ms", "DOUBLE", "How long it ran."),
        Column("count", "BIGINT", "Refusals: how many this row stands for (one asker, what gave it its scope, the "
                                  "command, one minute; peer is the first of them); NULL for an action."),
    )


COLUMNS = _columns()
EXAMPLE = "SELECT time, peer, command, outcome, code FROM probe.audit ORDER BY time DESC LIMIT 20"


def before_read(flush: Callable[[], None]) -> None:
    """What to run before the table is read: the agent's trail, when it is made, hands its ``flush`` (the
    refusal counts it holds in memory are written out first)."""
    _before_read[:] = [flush]


_before_read: List[Callable[[], None]] = []


def rows() -> Iterator[Tuple[Any, ...]]:
    import datetime

    for flush in list(_before_read):
        flush()
    for entry in actions(trail_files(os.getpid())):
        when = entry.get("time")
        stamp = (datetime.datetime.fromtimestamp(when, datetime.timezone.utc).replace(tzinfo=None)
                 if isinstance(when, (int, float)) else None)
        detail = entry.get("detail")
        yield (stamp, entry.get("seq"), entry.get("pid"), entry.get("scope"), entry.get("by"), entry.get("peer"),
               entry.get("command"), json.dumps(detail) if detail else None, entry.get("code"),
               entry.get("code_sha256"), entry.get("code_bytes"), entry.get("outcome"), entry.get("error"),
               entry.get("elapsed_ms"), entry.get("count"))
