"""What an alert says: the fields of each rule's body (the generic JSON), and the same as Slack's lines.

Why apart: the rules decide when, the sender how; the words live here, one place for every rule, so that a
new rule's body reads like the others' (host, job, the helper's port, the record and the command that
reads it). The functions that judge a record run on the alerts' thread, never on the watch.
"""

import os
import re
import socket
import time
from typing import Any, Callable, Dict, Optional, Sequence

__all__ = ["VERDICT_LINES", "where", "death_fields", "stall_fields", "place", "slack_text"]

VERDICT_LINES = 3


def where(watch: Any, directory: Optional[str]) -> Dict[str, Any]:
    """What every alert of this node says: host, job, the helper's port, the record."""
    from probe.host.members import node_host

    out: Dict[str, Any] = {"host": node_host() or socket.gethostname(), "probe_port": watch.helper.base_port,
                           "node": watch.helper.members.node_key(), "time": time.time()}
    if directory:
        out.update(snapshot=directory, snapshot_id=os.path.basename(directory),
                   job=re.sub(r"-\d{8}T\d{6}Z(-\d+)?$", "", os.path.basename(directory)),
                   command="probe snapshot:%s diagnose" % directory)
    return out


def death_fields(at: Dict[str, Any], died: Sequence[Any]) -> Dict[str, Any]:
    """The deaths' alert, in the words known now (the launcher may have said the signal since the record)."""
    from probe.host import deaths, exits

    reason = deaths.reason(died)
    first = min(died, key=lambda d: (deaths.consequence_of_another(exits.death_words(d[2], d[3])), d[0], d[1]))
    return dict(at, rule="death", summary="%s (recorded in %s)" % (reason, at["snapshot_id"]), reason=reason,
                ranks=sorted({d[1] for d in died}), culprits=[first[1]], how=exits.death_words(first[2], first[3]))


def stall_fields(fire: Callable[..., bool], at: Dict[str, Any], directory: str, reason: str) -> Dict[str, Any]:
    """The stall's alert: the verdict of its record (judged here, on the alerts' thread), who, where; a
    NaN or Inf the verdict found is its own alert, through ``fire`` (``Alerts.fire``)."""
    out = dict(at, rule="stall", reason=reason)
    try:
        from probe.snapshot.target import Snapshot
        from probe.client.cluster import compact_ranks

        def command(ranks: Optional[Sequence[int]], rest: str) -> str:
            return "probe snapshot:%s%s %s" % (directory, " --ranks %s" % compact_ranks(ranks) if ranks else "", rest)

        report = Snapshot(directory).judge(command)
        verdicts = [v for v in report.verdicts if v.kind != "healthy"] or report.verdicts
        first = verdicts[0]
        out.update(status=report.status, verdict=first.kind,
                   verdict_lines=[v.summary for v in verdicts[:VERDICT_LINES]],
                   culprits=first.culprits, victims=first.victims, where=first.where, where_text=place(first.where))
        numeric = [v for v in report.verdicts if v.kind == "numerical"]
        if numeric:  # found in the record: its own alert too
            fire("nan", directory, lambda: dict(at, rule="nan", summary=numeric[0].summary,
                                                culprits=numeric[0].culprits, where=numeric[0].where))
    except Exception as exc:  # noqa: BLE001 -- the alert goes without its verdict
        out["verdict_error"] = "%s: %s" % (type(exc).__name__, getattr(exc, "message", exc))
    who = " (culprit: rank %s)" % ",".join(map(str, out["culprits"])) if out.get("culprits") else ""
    out["summary"] = "stall recorded in %s%s: %s" % (at["snapshot_id"], who, reason)
    return out


def place(at: Any) -> str:
    """``func (file:line) called from ...``, as ``diagnose`` says it."""
    from probe.diagnose.verdict import where_text

    if not isinstance(at, dict):
        return ""
    try:
        return where_text(at) if at.get("func") else str(at.get("module") or "")
    except (KeyError, TypeError, ValueError):
        return ""


def slack_text(fields: Dict[str, Any]) -> str:
    """The alert as the lines of one Slack message."""
    lines = ["*probe: %s* on %s (job %s, PROBE_PORT %s)" % (fields.get("rule"), fields.get("host"),
                                                         fields.get("job", "?"), fields.get("probe_port"))]
    lines.append(str(fields.get("summary") or fields.get("reason") or ""))
    lines.extend("> %s" % line for line in fields.get("verdict_lines") or [])
    if fields.get("culprits"):
        shown = fields.get("where_text") or place(fields.get("where"))
        lines.append("culprit: rank %s%s" % (",".join(map(str, fields["culprits"])), " in " + shown if shown else ""))
    if fields.get("command"):
        lines.append("%s: `%s`" % ("snapshot %s" % fields["snapshot_id"] if fields.get("snapshot_id") else "more",
                                   fields["command"]))
    return "\n".join(line for line in lines if line)
