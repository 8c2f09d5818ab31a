"""``probe snapshots [DIR]``: what was recorded: job, when, why, ranks, size, complete or not."""

import json
import time
from typing import Any, List, Optional

import click

from probe.cli.context import CliContext, pass_cli
from probe.cli.options import TEXT, output_format
from probe._words import age_text
from probe.cli.output import emit, say


@click.command("snapshots")
@click.argument("directory", required=False, metavar="[DIR]")
@output_format(*TEXT, json_help="one object a snapshot")
@pass_cli
def snapshots(cli: CliContext, directory: Optional[str], fmt: Optional[str]) -> None:
    """List the snapshots recorded in DIR: id, job, when (UTC, and how long ago), why, ranks, size, complete.

    \b
    DIR: default $PROBE_SNAPSHOT_DIR, else the runtime directory's snapshots/. Read one with
    `probe snapshot:DIR/ID diagnose` (or backtrace, query ...). A snapshot is incomplete while a node is
    still writing it, or where a node died before it finished. In a shared DIR, what another user wrote is
    listed apart with its owner and not read (by path only, with a warning: it could be planted); a file
    that cannot be read is named, and the rest listed.
    """
    from probe.snapshot.store import list_snapshots, snapshot_root

    root = snapshot_root(directory)
    found = list_snapshots(root)
    if fmt == "json":
        for info in found:
            emit(json.dumps(info.as_json()))
        return
    yours = [info for info in found if info.owner is None]
    if not yours:
        say("no snapshot%s in %s" % (" of yours" if found else "", root))
        say("(snapshots go to --dir DIR, else $PROBE_SNAPSHOT_DIR, else the runtime directory's snapshots/; "
            "`probe TARGET snapshot` records one now)")
    else:
        for line in render(yours, root, time.time()):
            say(line)
    for line in render_others([info for info in found if info.owner is not None], root):
        say(line)
    for line in render_problems(found):
        say(line)


def size_text(size: int) -> str:
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if size >= scale:
            return "%.1f %s" % (size / scale, unit)
    return "%d B" % size


def ranks_text(info: Any, compact_ranks: Any) -> str:
    """The ranks a snapshot holds a record of, then those of them whose stacks could not be read (a rank
    killed without a word, one read from outside in vain), then those its nodes named but wrote no file of."""
    held = sorted(getattr(info, "held", ()) or info.ranks)
    text = compact_ranks(held) if held else "none"
    without = sorted(r for r in info.failed if r in held)
    missing = sorted(r for r in info.failed if r not in held)
    if without:
        text += " (no stacks: %s)" % compact_ranks(without)
    if missing:
        text += " (no record: %s)" % compact_ranks(missing)
    return text


def render(found: List[Any], root: str, now: float) -> List[str]:
    """A table: newest last, as they were recorded."""
    from probe.client.cluster import compact_ranks

    rows = [("ID", "JOB", "WHEN (UTC)", "AGE", "RANKS", "SIZE", "STATE", "WHY")]
    for info in found:
        ranks = ranks_text(info, compact_ranks)
        rows.append((info.id, info.job, time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(info.when)),
                     age_text(now - info.when), ranks, size_text(info.bytes),
                     "complete" if info.complete else "incomplete", info.reason or "?"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in rows]
    out.append("(%d snapshot%s in %s; read one: probe snapshot:%s/ID diagnose)" % (
        len(found), "" if len(found) == 1 else "s", root, root))
    return out


def render_others(found: List[Any], root: str) -> List[str]:
    """Other users' directories: never read, so only their ids (their names: a newline in one is written
    out, so that it cannot forge a line), owners and sizes."""
    from probe.cli.render import visible

    if not found:
        return []
    out = ["", "written by other users (not read: their records could be planted; a path reads one, with a warning):"]
    rows = [("ID", "OWNER", "WHEN (UTC)", "SIZE")]
    for info in found:
        rows.append((visible(info.id), info.owner or "?", time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(info.when)),
                     size_text(info.bytes)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return out


def render_problems(found: List[Any]) -> List[str]:
    """The files that could not be read, one line each (the listing goes on without them)."""
    problems = [p for info in found for p in info.problems]
    if not problems:
        return []
    from probe.cli.render import visible

    return ["", "could not be read (left out):"] + ["  %s" % visible(p) for p in problems]
