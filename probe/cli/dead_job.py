"""``probe HOST:PORT diagnose`` where nothing answers any more: the record of the job that died there.

A launcher ends the whole job within a second of a rank's death, so the address the user watched the job
at refuses connections by the time they ask. Where the node helper's watch recorded that death
(``probe.snapshot.recent``), the verdict is read from that record, said to be a record, with when it was
written and how to read it again; the exit status is 12 (a rank is dead)."""

import json
import os
import shlex
import time
from typing import Any, Callable, List, Optional

from probe.cli.output import emit, say
from probe.cli.render import visible

__all__ = ["snapshot_roots", "diagnose_dead_job", "died_here", "DEAD_EXIT"]

DEAD_EXIT = 12


def snapshot_roots(explicit: Optional[str]) -> List[str]:
    """Where records may be: ``--snapshot-dir``, else ``$PROBE_SNAPSHOT_DIR`` and the runtime directory's
    ``snapshots/`` (the job may have had the variable where this shell has not)."""
    from probe.snapshot.store import snapshot_root

    if explicit:
        return [snapshot_root(explicit)]
    roots = [snapshot_root(None)]
    if os.environ.get("PROBE_SNAPSHOT_DIR"):
        from probe import _paths

        roots.append(os.path.join(_paths.runtime_dir(), "snapshots"))
    return roots


def diagnose_dead_job(cli: Any, error: Any, as_json: bool, explicit_dir: Optional[str],
                      render: Callable[[Any], List[str]]) -> bool:
    """Where the one target is HOST:PORT and a record of a job that died there is found: its verdict said
    (``render``: diagnose's), the exit status set, and True; False where there is none (the caller reports
    ``error``)."""
    from probe._words import age_text
    from probe.client.targets import parse_target
    from probe.snapshot.recent import find_dead_job
    from probe.snapshot.target import Snapshot

    port = cli.master_port()
    if port is None:
        return False
    written_as = (cli.targets[0] if cli.targets else os.environ["PROBE_TARGET"]).strip()
    host = parse_target(written_as).address.host
    found = find_dead_job(host, port, snapshot_roots(explicit_dir))
    if found is None:
        return False
    snapshot = Snapshot(found.info.path)
    shown = "snapshot:" + found.info.path

    def command(ranks: Any, rest: str) -> str:
        from probe.client.cluster import compact_ranks

        return "probe %s%s %s" % (shlex.quote(shown), " --ranks %s" % compact_ranks(ranks) if ranks else "", rest)

    report = snapshot.judge(command)
    ago = max(0.0, time.time() - found.written)
    words = ("the job that served at %s has died: nothing answers there now (%s). What follows is probe's record "
             "of it, not a live look: %s, written %s (%s) by its node's watch"
             % (written_as, error.message, shown,
                time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(found.written)), age_text(ago)))
    if as_json:
        emit(json.dumps(dict(report.as_json(), target=written_as, single=False,
                             changes=None, record=snapshot.about(), dead_job={
                                 "address": written_as, "snapshot": found.info.path,
                                 "written": found.written, "reason": found.info.reason, "said": words})))
    else:
        say("DEAD JOB: " + visible(words))
        say(visible(snapshot.about_line()))
        say("\n".join(render(report)))
    cli.exit_code = DEAD_EXIT
    return True


def died_here(host: str, port: int, explicit_dir: Optional[str] = None) -> Optional[str]:
    """Where a job that served at ``host:port`` died within the hour and its node's watch recorded it: a
    hint that says so and how to read the record (instead of "start the job with PROBE_PORT", which it was);
    None where there is no such record."""
    from probe._words import age_text
    from probe.snapshot.recent import find_dead_job

    try:
        found = find_dead_job(host, port, snapshot_roots(explicit_dir))
    except (OSError, ValueError):
        return None
    if found is None:
        return None
    return ("a job served here and died (%s, written %s, %s): `probe %s diagnose` reads probe's record of it"
            % (found.info.reason or "its node's watch recorded it",
               time.strftime("%H:%M:%S UTC", time.gmtime(found.written)), age_text(time.time() - found.written),
               shlex.quote("snapshot:" + found.info.path)))
