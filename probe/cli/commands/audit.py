"""``probe TARGET audit``: who asked this process to do what (its audit trail), live or after it died."""

import datetime
import json
from typing import Any, Dict, List, Optional

import click

from probe.cli.context import CliContext, each_target, pass_cli
from probe.cli.options import TEXT, output_format
from probe.cli.output import emit, say
from probe.cli.render import visible
from probe.errors import ConnectError, ProbeError, UsageError

_FIELDS = ("time", "seq", "pid", "scope", "granted_by", "peer", "command", "detail", "code", "code_sha256",
           "code_bytes", "outcome", "error", "elapsed_ms", "count")


@click.command("audit")
@click.option("-n", "last", type=click.IntRange(min=1), default=50, show_default=True, metavar="N",
              help="Show the last N actions.")
@output_format(*TEXT, json_help="one JSON object per action")
@pass_cli
def audit(cli: CliContext, last: int, fmt: Optional[str]) -> None:
    """Show who made the target run what: its audit trail, live or after it died.

    Every eval snippet and REPL input, checkpoint, debug start and stop, trace change and lr change made in
    it (and every one refused), with when, who (uid on the unix socket, address on TCP), the scope it
    needed, the snippet and its outcome (ok, error, interrupted, refused).

    \b
    The trail is a file beside the agent's socket (audit-PID-TICKS.jsonl in the runtime directory, owner
    only, rotated at 1 MB); for a process that has died, or whose agent cannot answer, probe PID audit reads
    that file. SQL: SELECT * FROM probe.audit.
    """
    for client, actions in each_target(cli, _actions):
        if len(cli.targets) > 1 or cli.is_cluster:
            say("== %s ==" % cli.label(client))
        shown = actions[-last:]
        if fmt == "json":
            for entry in shown:
                emit(json.dumps(entry, default=str))
            continue
        if not shown:
            say("no action recorded yet")
        for entry in shown:
            for line in _lines(entry):
                say(visible(line))


def _actions(client: Any) -> List[Dict[str, Any]]:
    """The target's actions, from its agent; from the trail's file where the agent cannot answer (a local pid)."""
    try:
        rows = client.table_rows("probe.audit")
    except (ConnectError, ProbeError) as exc:
        pid = client.target.pid
        if pid is None or exc.code in ("unauthorized", "forbidden", "bad_request"):
            raise
        from probe.agent import audit as trail

        files = trail.trail_files(pid)
        if not files:
            raise UsageError("no audit trail of process %d here (%s)" % (pid, exc.message),
                             hint="the trail is in the runtime directory of the host the process ran on") from exc
        client.note = "the agent did not answer (%s); read from %s" % (exc.message, files[-1])
        return [_from_file(e) for e in trail.actions(files)]
    return [dict(zip(rows.column_names, row)) for row in rows.rows]


def _from_file(entry: Dict[str, Any]) -> Dict[str, Any]:
    when = entry.get("time")
    out = dict(entry, granted_by=entry.get("by"),
               time=datetime.datetime.fromtimestamp(when, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")
               if isinstance(when, (int, float)) else None,
               detail=json.dumps(entry["detail"]) if entry.get("detail") else None)
    if out.get("outcome") is None:
        out["outcome"] = "unknown"  # the process ended before the action did
    return {k: out.get(k) for k in _FIELDS}


def _lines(entry: Dict[str, Any]) -> List[str]:
    when = str(entry.get("time") or "?")[:23]
    what = entry.get("command") or "?"
    outcome = entry.get("outcome") or "running"
    took = "" if entry.get("elapsed_ms") is None else " %.0f ms" % entry["elapsed_ms"]
    if (entry.get("count") or 1) > 1:
        took += " x%d in that minute" % entry["count"]
    head = "%s  %-8s %-22s %-11s by %s (%s)%s" % (when, outcome, what, "[%s]" % entry.get("scope"),
                                                   entry.get("peer"), entry.get("granted_by"), took)
    extra = []
    if entry.get("detail"):
        extra.append("    %s" % entry["detail"])
    if entry.get("code"):
        code = str(entry["code"])
        lines = code.splitlines() or [""]
        more = " ... (%d lines, %d bytes, sha256 %s)" % (len(lines), entry.get("code_bytes") or len(code),
                                                       str(entry.get("code_sha256"))[:16]) if len(lines) > 1 else ""
        extra.append("    code: %s%s" % (lines[0][:200], more))
    if entry.get("error"):
        extra.append("    error: %s" % str(entry["error"])[:300])
    return [head] + extra
