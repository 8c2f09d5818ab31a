"""``probe TARGET snapshot``: record a process or every rank of a job now, to read later as ``snapshot:DIR``."""

import json
import os
import shlex
import socket
import time
from typing import Any, List, NamedTuple, Optional, Tuple

import click

from probe.cli.context import PARTIAL, CliContext, pass_cli
from probe.cli.options import TEXT, output_format
from probe.cli.output import emit, say
from probe.errors import UsageError

DEFAULT_DEADLINE_S = 20.0


class _Rank(NamedTuple):
    rank: int
    host: str
    pid: Optional[int]


@click.command("snapshot")
@click.option("--dir", "directory", type=click.Path(file_okay=False), metavar="DIR",
              help="Where to write it (default: $PROBE_SNAPSHOT_DIR, else the runtime directory's snapshots/).")
@click.option("--reason", default="by hand", show_default=True, help="Why it was taken, as the listing shows it.")
@output_format(*TEXT, json_help="where it went, the ranks recorded and not, its size")
@pass_cli
def snapshot(cli: CliContext, directory: Optional[str], reason: str, fmt: Optional[str]) -> None:
    """Record a process, or every rank of a job, now: what diagnose reads, and the stacks, locals, Flight
    Recorder, trace tail, step counter and threads, to read later with `probe snapshot:DIR/ID COMMAND`.

    \b
    TARGET: a pid, or a job: the master's HOST:PROBE_PORT, slurm:JOBID, --hosts FILE. Each rank is read
    twice a second apart, within --deadline (default 20 s); a rank whose agent cannot answer is read from
    outside. Nothing is run in the program. Files are 0600 in a 0700 directory; secrets are masked as the
    tables mask them. `probe snapshots` lists what was recorded.
    \b
    Exit status: 0 every rank recorded; 7 some could not be; probe's own codes where none could.
    """
    from probe.snapshot.capture import capture_members
    from probe.snapshot.store import save_snapshot, snapshot_root

    pairs, job, secrets = _ranks(cli)
    if len(pairs) == 1 and job.startswith("pid"):
        _refuse_no_process(pairs[0][0])
    root = snapshot_root(directory)
    deadline = cli.deadline or DEFAULT_DEADLINE_S
    started = time.time()
    records = capture_members(pairs, reason, job, deadline, secrets=secrets, max_in_flight=cli.max_in_flight)
    if cli.is_cluster:  # a job: where each rank has been, as its node helpers sampled it
        from probe.client.stack_history import carry, current_or_none

        carry(records, current_or_none(cli.cluster(), whole=True) or [])
    path, meta = save_snapshot(root, job, reason, records, started)
    failed = {int(r): why for r, why in meta["failed"].items()}
    if fmt == "json":
        emit(json.dumps({"id": os.path.basename(path), "path": path, "job": job, "reason": reason,
                         "ranks": meta["ranks"], "failed": {str(r): w for r, w in sorted(failed.items())},
                         "bytes": meta["bytes"], "seconds": round(meta["ended"] - started, 3)}))
    else:
        for line in render(path, meta, len(records)):
            say(line)
    if not meta["ranks"]:
        cli.exit_code = 3
    elif failed:
        cli.exit_code = PARTIAL


def _refuse_no_process(client: Any) -> None:
    """A pid with no process and no crash record left: nothing to record, and no empty record written."""
    pid = client.target.pid
    if pid is None or not client.target.is_local or os.path.exists("/proc/%d" % pid):
        return
    from probe.errors import ConnectError
    from probe.reader import crash

    if crash.dead_record(pid) is None:
        raise ConnectError("no process with pid %d (it exited, was killed, or never was): nothing to record" % pid,
                           hint="check the pid with `probe list` or ps; `probe snapshots` lists what was recorded")


def render(path: str, meta: Any, total: int) -> List[str]:
    from probe.cli.commands.snapshots import size_text
    from probe.client.cluster import compact_ranks

    out = ["snapshot %s written to %s" % (os.path.basename(path), path)]
    ranks = meta["ranks"]
    shown = ("rank %s" if len(ranks) == 1 else "ranks %s") % compact_ranks(ranks) if ranks else "no rank"
    out.append("  recorded: %s (%d of %d)" % (shown, len(ranks), total))
    for rank, why in sorted(meta["failed"].items(), key=lambda kv: int(kv[0])):
        out.append("  not recorded: rank %s: %s" % (rank, why))
    out.append("  size: %s in %.1f s" % (size_text(meta["bytes"]), meta["ended"] - meta["started"]))
    out.append("  read it: probe %s diagnose" % shlex.quote("snapshot:" + path))
    return out


def _ranks(cli: CliContext) -> Tuple[List[Tuple[Any, _Rank]], str, List[str]]:
    """(client, rank) pairs to record, the job's name in the snapshot's id, and the secrets not to write."""
    from probe.snapshot.store import job_id

    targets = list(cli.targets) or ([os.environ["PROBE_TARGET"]] if os.environ.get("PROBE_TARGET") else [])
    job = cli.is_cluster or len(targets) > 1 or (len(targets) == 1 and targets[0].strip().startswith("slurm:"))
    port = cli.master_port() if len(targets) == 1 else None
    if not job and port is not None:
        job = cli.try_job_at_master()
    if job:
        cli.all_ranks = cli.all_ranks or not cli.hosts and cli.ranks is None
        cluster = cli.cluster()
        cluster.progress = None
        secrets = [s for s in (getattr(cluster, "_token", None),) if s]
        name = targets[0].strip()[len("slurm:"):].split(":")[0] if targets and targets[0].strip().startswith("slurm:") \
            else None
        return ([(c, _Rank(m.rank, m.host, m.pid)) for c, m in zip(cluster.clients, cluster.members)],
                job_id(slurm_job=name, port=port) if name or port else "job", secrets)
    clients = cli.clients()
    if len(clients) != 1:
        raise UsageError("snapshot records one process or one job", hint="give one target")
    client = clients[0]
    pid = client.target.pid
    host = socket.gethostname() if client.target.is_local else client.target.label
    secrets = [s for s in (getattr(client, "_token", None),) if s]
    return [(client, _Rank(0, host, pid))], job_id(port=port, pid=pid) if pid is not None or port else "process", secrets
