"""``probe TARGET diagnose``: what is wrong with a process or a whole job, which rank, and where."""

import json
import shlex
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import click

from probe.cli.context import CliContext, pass_cli
from probe.cli.options import TEXT, Seconds, output_format
from probe.cli.output import emit, say
from probe.cli.render import visible
from probe.errors import UsageError


@click.command("diagnose")
@click.option("--watch", type=Seconds(0.5), metavar="SECONDS", default=None,
              help="Diagnose again every SECONDS, each time saying what changed (steps made or not, the verdict); "
                   "Ctrl-C ends it.")
@click.option("--snapshot-dir", "snapshot_dir", type=click.Path(file_okay=False), metavar="DIR", default=None,
              help="Where nothing answers at HOST:PORT, look for the record of the job that died there in DIR "
                   "(default: $PROBE_SNAPSHOT_DIR and the runtime directory's snapshots/).")
@output_format(*TEXT, json_help="the verdicts with their evidence rows and every rank's evidence (one object a line "
                                "with --watch)")
@pass_cli
def diagnose(cli: CliContext, watch: Optional[float], snapshot_dir: Optional[str], fmt: Optional[str]) -> None:
    """Say what is wrong with a process or a job, which rank, and where, with the evidence.

    \b
    TARGET: a pid (one process), or a job: the master's HOST:PROBE_PORT, slurm:JOBID, --hosts FILE, -t
    several times. Every rank's stacks (read from outside where it cannot answer), threads' CPU, the
    optimizer step counter, the Flight Recorder's last collectives, the trace's steps, anomalies and RSS are
    read twice, a second apart (and again after 3 s where a rank showed no sign of life or its memory
    rose), within --deadline; nothing is run in the program, no collective. The verdict comes first: a dead
    rank (the OOM killer where the kernel says so), one that cannot answer (GIL held in C, stopped), a
    collective hang (the ranks that did not issue it, apart from those waiting in it), a rank that makes no
    step, a data loader stall (which worker), a stall, a lock wait, a NaN (where it came in), memory that
    grows, a straggler, or healthy (steps a second). Then the evidence, each with the probe command that
    shows it in full, then what to do.
    Where nothing answers at HOST:PORT any more and the node's watch recorded the death of the job that
    served there (within the last hour), that record is read instead, and said to be one (exit 12).
    \b
    Exit status: 0 healthy, 10 degraded (a straggler, a NaN, memory growth, a rank that gave no evidence),
    11 stuck (a hang, a rank that cannot run), 12 a rank is dead; probe's own codes (2, 3, 4...) where no
    diagnosis could be made.
    """
    from probe.diagnose.engine import diagnose as run, sampler_for
    from probe.errors import ConnectError

    try:
        target, single, command = _target(cli)
    except ConnectError as exc:
        if not _dead_job(cli, exc, watch, fmt, snapshot_dir):
            raise
        return
    recorded = getattr(target, "recorded", None)  # snapshot:PATH: the looks it recorded are the samples
    if recorded is not None and watch is not None:
        raise UsageError("--watch looks again and again, and a snapshot does not change", hint="leave out --watch")
    deadline = cli.deadline or min(10.0, cli.timeout)
    as_json = fmt == "json"
    previous = None
    code = 0
    try:
        while True:
            report = recorded.judge(command) if recorded is not None else run(sampler_for(target, single), deadline,
                                                                              command)
            if single and cli.judged_alone:
                _alone(report, cli.judged_alone)
            code = report.exit_code if not (single and cli.judged_alone) else max(report.exit_code, 10)
            if as_json:
                emit(json.dumps(dict(report.as_json(), target=_shown_target(cli), single=single,
                                     changes=_changes(previous, report) if previous is not None else None,
                                     judged_alone=cli.judged_alone if single else None, exit_code=code,
                                     **({"record": recorded.about()} if recorded is not None else {}))))
            else:
                if recorded is not None:
                    say(visible(recorded.about_line()))
                if watch is not None:
                    say("== %s  %s" % (time.strftime("%H:%M:%S"), visible(_shown_target(cli))))
                    if previous is not None:
                        for line in _changes(previous, report):
                            say("since the last look: " + line)
                say("\n".join(render(report)))
            if watch is None:
                break
            previous = report
            time.sleep(watch)
            if not as_json:
                say("")
    except KeyboardInterrupt:
        cli.exit_code = 130
        return
    except ConnectError as exc:
        if previous is not None or recorded is not None or not _dead_job(cli, exc, watch, fmt, snapshot_dir):
            raise
        return
    cli.exit_code = code


def _dead_job(cli: CliContext, exc: Any, watch: Optional[float], fmt: Optional[str], snapshot_dir: Optional[str]) -> bool:
    """Nothing answers at HOST:PORT: where the job that served there died and its node recorded it, that
    record's verdict (probe.cli.dead_job)."""
    from probe.cli.dead_job import diagnose_dead_job

    return watch is None and diagnose_dead_job(cli, exc, fmt == "json", snapshot_dir, render)


def _alone(report: Any, alone: Dict[str, Any]) -> None:
    """Say, among what could not be known, that the process is one rank of several judged alone: a hang or
    a straggler on another rank does not show in its answer (so no verdict of it is "healthy": exit 10)."""
    rank = alone.get("rank")
    line = ("the job's other ranks: this process is %s of a job of %d, judged alone (%s); a hang or a straggler "
            "on another rank does not show here. Start the job with its host helper (PROBE=1 under the launcher) "
            "or name every rank (-t HOST:PORT several times, or --hosts FILE)"
            % ("rank %d" % rank if isinstance(rank, int) else "a rank", alone["world_size"], alone.get("why") or
               "no host helper answered"))
    if line not in report.unavailable:
        report.unavailable.append(line)


def _shown_target(cli: CliContext) -> str:
    if cli.hosts:
        return "--hosts %s" % cli.hosts
    return " ".join(cli.targets) or "$PROBE_TARGET"


def _target(cli: CliContext) -> Tuple[Any, bool, Callable[[Optional[Sequence[int]], str], str]]:
    """The job (a Cluster) or the one process (a Client), whether it is one process, and how to write a
    probe command that reaches the same ranks."""
    from probe.client.cluster import compact_ranks

    targets = list(cli.targets)
    quoted = " ".join(shlex.quote(t) for t in targets)
    job = cli.is_cluster or len(targets) > 1 or (len(targets) == 1 and
                                                 targets[0].strip().startswith(("slurm:", "snapshot:")))
    if not job and len(targets) == 1:
        job = cli.try_job_at_master()
    if job:
        cli.all_ranks = cli.all_ranks or not cli.hosts and cli.ranks is None
        cluster = cli.cluster()
        cluster.progress = None  # the samples are short; a progress line would only flicker
        if cli.hosts:
            prefix = "probe --hosts %s%s" % (shlex.quote(cli.hosts), "".join(" -t " + shlex.quote(t) for t in targets))
        elif len(targets) > 1:
            prefix = "probe" + "".join(" -t " + shlex.quote(t) for t in targets)
        else:
            prefix = "probe %s" % quoted

        def command(ranks: Optional[Sequence[int]], rest: str) -> str:
            scope = " --ranks %s" % compact_ranks(ranks) if ranks else (" --all-ranks" if not cli.hosts else "")
            return "%s%s %s" % (prefix, scope, rest)

        return cluster, False, command
    clients = cli.clients()
    client = clients[0]

    def single(ranks: Optional[Sequence[int]], rest: str) -> str:
        return "probe %s %s" % (quoted or client.target.label, rest)

    return client, True, single


def render(report: Any) -> List[str]:
    """The verdict first (worst first), its place, its evidence with the command that shows each in full,
    what to do next; then what could not be known."""
    out: List[str] = []
    for i, verdict in enumerate(report.verdicts):
        if i:
            out.append("")
        out.append("%s: %s" % (verdict.status.upper(), visible(verdict.summary)))
        if verdict.where and verdict.where.get("func"):
            from probe.diagnose.verdict import where_text

            out.append("  where: %s" % visible(where_text(verdict.where)))
        elif verdict.where and verdict.where.get("module"):
            out.append("  where: module %s" % visible(str(verdict.where["module"])))
        if verdict.victims and verdict.kind != "straggler":
            from probe.diagnose.verdict import ranks_word

            out.append("  waiting (not to blame): %s" % ranks_word(verdict.victims))
        if verdict.evidence:
            out.append("  evidence:")
            for piece in verdict.evidence:
                out.append("    - %s" % visible(piece.text))
                if piece.command:
                    out.append("        %s" % visible(piece.command))
        if verdict.next:
            out.append("  next:")
            for step in verdict.next:
                out.append("    - %s" % visible(step))
    if report.unavailable:
        out.append("")
        out.append("not known (evidence that could not be had):")
        for line in report.unavailable:
            out.append("  - %s" % visible(line))
    out.append("")
    out.append("(%d look%s over %.1f s; exit %d: %s)" % (report.samples, "" if report.samples == 1 else "s", report.window,
                                                        report.exit_code, report.status))
    return out


def _changes(before: Any, now: Any) -> List[str]:
    """What changed between two diagnoses of --watch: the verdict, and the steps each rank made."""
    lines = []
    def gist(report: Any) -> List[Any]:  # what a verdict says, not its numbers (a rate differs every look)
        return [(v.kind, v.culprits, v.victims) for v in report.verdicts]

    if before.status != now.status or gist(before) != gist(now):
        summary = now.verdicts[0].summary if now.verdicts else ""
        if summary.startswith(now.status + ": "):  # the summary may begin with its status: said once
            summary = summary[len(now.status) + 2:]
        change = ("still %s" % now.status if before.status == now.status
                  else "%s -> %s" % (before.status, now.status))
        lines.append("%s: %s" % (change, summary) if summary else change)
    else:
        lines.append("the same verdict (%s)" % now.status)
    from probe._words import span
    from probe.diagnose.verdict import ranks_word

    moved, still = [], []
    for rank, p in sorted(now.progress.items()):
        old = before.progress.get(rank, {})
        for key in ("step", "optimizer_step"):  # the trace's step, else the step counter's (no trace needed)
            if p.get(key) is not None and old.get(key) is not None:
                (moved if p[key] > old[key] else still).append((rank, p[key] - old[key]))
                break
    if moved:
        steps = [d for _, d in moved]
        lines.append("%s made %s" % (ranks_word([r for r, _ in moved]), span(min(steps), max(steps),
                                                                             unit="step" if steps == [1] else "steps")))
    if still:
        lines.append("no step on %s (no progress)" % ranks_word([r for r, _ in still]))
    if not moved and not still:
        lines.append("steps unknown: no rank has made an optimizer step that probe saw")
    return lines
