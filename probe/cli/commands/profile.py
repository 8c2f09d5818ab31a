"""``probe TARGET profile --steps N -o FILE``: torch.profiler on every rank (or one process) for N steps,
merged into one Chrome/Perfetto trace, one process per rank, the ranks' clocks lined up; the ops stay
queryable as ``torch.profile``."""

import json
import os
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from probe.cli.commands import made_on_first_use
from probe.cli.context import CliContext, each_target
from probe.cli.output import emit, say
from probe.cli.spec import PATH, STRING, TEXT_FORMATS, Param, count, seconds, output_params
from probe.errors import ProbeError, Timeout

PARAMS = [
    Param("--steps", dest="steps", kind=count(1), default=3, show_default=True,
          help="Optimizer steps to capture; the capture starts right after a step and stops right after one."),
    Param("-o", "--output", dest="output", kind=PATH, metavar="FILE",
          help="The Chrome trace-event JSON file to write: one process per rank (ui.perfetto.dev, "
               "chrome://tracing). Without it, only the table torch.profile is kept in each rank."),
    Param("--ranks", dest="ranks", kind=STRING, metavar="LIST", help="Only these ranks of the job, e.g. 0-3,8."),
    Param("--shapes", dest="shapes", help="Record each op's input shapes (more overhead while capturing)."),
    Param("--stacks", dest="stacks", help="Record the Python stack of each op (more overhead while capturing)."),
    Param("--timeout", dest="wait_s", kind=seconds(1.0), default=120.0, show_default=True,
          help="Seconds to wait for the steps to be captured; past them the captures are cancelled."),
    Param("--max-events", dest="max_events", kind=count(1), default=200_000, show_default=True,
          help="Trace events kept per rank, the earliest; the file says how many each rank cut."),
] + output_params(*TEXT_FORMATS,
                  json_help="what was captured: the file, ranks, events, what was cut, rows (null while being summed)")


def _command() -> Any:
    import click

    from probe.cli.context import pass_cli
    from probe.cli.options import with_params

    @click.command("profile")
    @with_params(PARAMS)
    @pass_cli
    def profile(cli: CliContext, steps: int, output: Optional[str], ranks: Optional[str], shapes: bool, stacks: bool,
                wait_s: float, max_events: int, fmt: Optional[str]) -> None:
        """Capture torch.profiler (CPU, and CUDA where used) on every rank for N steps, into one trace.

        \b
          probe MASTER:PORT profile --steps 3 -o trace.json      every rank, one process each
          probe slurm:JOBID profile --steps 3 -o trace.json      every rank of a Slurm job
          probe PID profile --steps 5 --shapes -o trace.json     one process
          probe MASTER:PORT --all-ranks query "SELECT op, kind, SUM(self_cpu_s) AS s FROM torch.profile
              GROUP BY ALL ORDER BY s DESC LIMIT 5"               top ops of each rank

        Nothing runs in the ranks before or after the capture. Where a rank cannot run Python now (GIL held,
        stopped), it is named with why and no capture starts (its exit code): the others' steps would wait
        for it in their collectives. --ranks without it profiles the others.
        """
        run(cli, steps, output, ranks, shapes, stacks, wait_s, max_events, fmt)

    return profile


__getattr__ = made_on_first_use("profile", _command)


def run(cli: CliContext, steps: int, output: Optional[str], ranks: Optional[str], shapes: bool, stacks: bool,
        wait_s: float, max_events: int, fmt: Optional[str] = None) -> None:
    """Start on every target, wait for the steps (progress on stderr), fetch, merge and write."""
    from probe.client.fanout import fan_out
    from probe.client.profile import IMPORT_PATIENCE_S, merge_traces, riding_imports, wait_for_steps

    if ranks is not None:
        cli.ranks = ranks
    if not cli.is_cluster and not cli.hosts:
        targets = cli.targets or ([os.environ["PROBE_TARGET"]] if os.environ.get("PROBE_TARGET") else [])
        if len(targets) == 1 and targets[0].strip().startswith("slurm:"):
            cli.all_ranks = True  # slurm:JOBID names every rank of the job: all of them, as at the master's address
        else:
            cli.try_job_at_master()
    if not _every_one_can_run(cli):
        return
    started: List[Tuple[Any, Any]] = []  # (client, key: its rank, or its label where it has none)
    for client, answer in each_target(cli, lambda c: riding_imports(lambda: c.profile(
            "start", steps=steps, shapes=shapes or None, stacks=stacks or None), _patience(cli))):
        started.append((client, _member_key(cli, client, answer)))
    if not started:
        return
    clients = [client for client, _ in started]
    say("probe: capturing %d step%s on %d process%s" % (steps, "" if steps == 1 else "s", len(started),
                                                        "" if len(started) == 1 else "es"), err=True)
    lost: Dict[Any, str] = {}

    def poll() -> Dict[Any, Dict[str, Any]]:
        outcomes = fan_out(clients, lambda c: riding_imports(lambda: c.profile("status")), cli.max_in_flight,
                           cli.timeout + IMPORT_PATIENCE_S)
        statuses = {}
        for (client, key), outcome in zip(started, outcomes):
            if key in lost:
                continue
            if outcome.error is not None:
                lost[key] = outcome.error.message
                continue
            statuses[key] = outcome.value
        return statuses

    shown = _Progress(steps)
    try:
        statuses = wait_for_steps(poll, wait_s, shown)
    except Timeout as exc:
        shown.clear()
        fan_out(clients, lambda c: c.profile("stop"), cli.max_in_flight, cli.timeout)
        cli.record(exc)
        return
    shown.clear()
    for key, why in lost.items():
        cli.record(ProbeError("stopped answering while profiling: %s" % why), _label(key))
    done = [(client, key) for client, key in started if statuses.get(key, {}).get("state") == "done"]
    for key, status in statuses.items():
        if status.get("state") != "done":
            cli.record(ProbeError("the capture %s%s" % (status.get("state"), ": " + status["error"]
                                                           if status.get("error") else "")), _label(key))
    if not done:
        cli.exit_code = cli.exit_code or 1
        return
    begun = time.monotonic()
    outcomes = fan_out([c for c, _ in done],
                       lambda c: riding_imports(lambda: c.profile("fetch", max_events=max_events)),
                       cli.max_in_flight, max(cli.timeout, 60.0) + IMPORT_PATIENCE_S)
    answers = []
    for (client, key), outcome in zip(done, outcomes):
        if outcome.error is not None:
            cli.record(outcome.error, _label(key))
            continue
        answers.append((key if isinstance(key, int) else len(answers), outcome.value))
    if len(answers) < len(started):
        cli.exit_code = cli.exit_code or 7
    if not answers:
        return
    counted = [a for _, a in answers if a.get("rows") is not None]
    rows = sum(int(a["rows"]) for a in counted) if len(counted) == len(answers) else None  # else being summed
    captured = [float(s.get("captured_s") or 0.0) for s in statuses.values() if s.get("state") == "done"]
    summary: Dict[str, Any] = {"ranks": [key for key, _ in answers], "steps": steps, "output": output,
                               "rows": rows, "rows_cut": sum(int(a.get("rows_cut") or 0) for _, a in answers),
                               "captured_s": max(captured) if captured else None}
    lines = []
    if output:
        merged = merge_traces(answers)
        with open(output, "w") as handle:
            json.dump(merged, handle)
        cuts = merged["otherData"]["probe"]["events_cut"]
        summary.update(events=sum(1 for e in merged["traceEvents"] if e.get("ph") != "M"), events_cut=cuts,
                       merge_s=round(time.monotonic() - begun, 3))
        lines.append("wrote %d events of %d rank%s to %s in %.1f s%s" % (
            summary["events"], len(answers), "" if len(answers) == 1 else "s", output, summary["merge_s"],
            "; cut past --max-events or the agent's result size: %s" % ", ".join(
                "rank %s: %d events" % kv for kv in cuts.items()) if cuts else ""))
    if rows is None:
        lines.append("torch.profile: the ops of %d rank%s, summed per step in each agent now (a query waits for them)"
                     % (len(answers), "" if len(answers) == 1 else "s"))
    else:
        lines.append("torch.profile holds %d rows in %d rank%s%s" % (
            rows, len(answers), "" if len(answers) == 1 else "s",
            "; %d rarer ops cut (500 a step kept)" % summary["rows_cut"] if summary["rows_cut"] else ""))
    if fmt == "json":
        emit(json.dumps(summary))
    else:
        for line in lines:
            say(line)


def _every_one_can_run(cli: CliContext) -> bool:
    """Ask every target for its capture's status before starting any: where one cannot run Python now
    (stopped, GIL held, gone) the errors name it and why, and no capture starts, since the others' steps
    would wait for it wherever they meet in a collective; ``--ranks`` without it profiles the others."""
    from probe.client.profile import riding_imports

    # A rank busy importing a module (seconds on a loaded machine) can run: it is asked again meanwhile.
    answered = [(client, answer) for client, answer in each_target(cli, lambda c: riding_imports(
        lambda: c.profile("status"), _patience(cli)))]
    if not cli.failures:
        return True
    if answered:
        from probe.cli.render_cluster import ranks_word

        ranks = [_member_key(cli, client, answer) for client, answer in answered]
        failures = cli.cluster().failures if cli.is_cluster else []
        if failures and all(isinstance(r, int) for r in ranks):
            named, others = ranks_word([f.rank for f in failures]), ranks_word(ranks)
            hint = "profile %s alone with --ranks %s, or again once %s can run" % (
                others, others.split(" ", 1)[1], named)
        else:
            named, others = "a target", "the others"
            hint = "profile the others alone (without it), or again once it can run"
        say("probe: error: no profile started: %s cannot run now (above), and %s may wait for %s where their "
            "steps meet in a collective -- %s" % (named, others, "them" if len(failures) > 1 else "it", hint), err=True)
        cli.exit_code = failures[0].exit_code if failures else cli.exit_code
    cli.exit_code = cli.exit_code or 1
    return False


def _patience(cli: CliContext) -> float:
    """How long a rank busy importing is asked again within one call across ranks: what its deadline leaves
    (the first try and the last take up to seconds each to tell why the agent is silent)."""
    from probe.client.profile import IMPORT_PATIENCE_S

    limit = cli.cluster().deadline if cli.is_cluster else cli.timeout
    return max(0.0, min(IMPORT_PATIENCE_S, limit - 4.0))


def _member_key(cli: CliContext, client: Any, answer: Dict[str, Any]) -> Any:
    member = cli.cluster_member(client)
    return member.rank if member is not None else _key(client, answer)


def _key(client: Any, answer: Dict[str, Any]) -> Any:
    rank = answer.get("rank")
    return rank if isinstance(rank, int) else client.target.label


def _label(key: Any) -> str:
    return "rank %s" % key if isinstance(key, int) else str(key)


class _Progress:
    """``probe: profile 2/3 steps (slowest: rank 1)`` on stderr, redrawn on a terminal, else every change."""

    def __init__(self, steps: int) -> None:
        self.steps, self.last, self.tty = steps, "", sys.stderr.isatty()

    def __call__(self, statuses: Dict[Any, Dict[str, Any]]) -> None:
        if not statuses:
            return
        done = [int(s.get("steps_done") or 0) if s.get("state") != "done" else self.steps for s in statuses.values()]
        waiting = sum(1 for s in statuses.values() if s.get("state") == "waiting")
        slowest = min(statuses, key=lambda k: done[list(statuses).index(k)])
        text = "probe: profile %d/%d steps captured (slowest: %s)%s" % (
            min(done), self.steps, _label(slowest), ", %d waiting for a step to begin" % waiting if waiting else "")
        if text == self.last:
            return
        self.last = text
        if self.tty:
            sys.stderr.write("\r\033[K" + text)
            sys.stderr.flush()
        else:
            say(text, err=True)

    def clear(self) -> None:
        if self.tty and self.last:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()

