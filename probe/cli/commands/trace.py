"""``probe TARGET trace start|stop|status|export``: the target's torch trace (python.torch_trace)."""

import json
from typing import Any, Dict, Iterator, List, Optional

import click

from probe.cli.context import CliContext, each_target, pass_cli
from probe.cli.options import TEXT, output_format
from probe.cli.output import emit, say
from probe.cli.render import visible
from probe.cli.render_cluster import render_grouped_text

__all__ = ["trace", "status_lines"]


@click.group("trace")
def trace() -> None:
    """Time every module's forward (and backward) and the optimizer step of a PyTorch job.

    \b
      probe PID trace start [--every N] [--modules 'encoder.*'] [--backward] [--anomalies]
      probe PID trace status | stop
      probe PID query "SELECT module, stage, SUM(duration) FROM python.torch_trace GROUP BY ALL"
      probe PID trace export -o trace.json      # open in ui.perfetto.dev or chrome://tracing
    """


@trace.command("start")
@click.option("--every", type=click.IntRange(min=1), help="Trace one step in N (the others cost nothing). Default 1.")
@click.option("--modules", metavar="GLOB", help="Record only modules whose name matches, e.g. 'encoder.*'.")
@click.option("--backward", is_flag=True, default=None, help="Also time each module's backward (autograd graph hooks).")
@click.option("--anomalies", is_flag=True, default=None,
              help="Check traced outputs (and input gradients) for NaN/Inf: see torch.anomalies.")
@click.option("--size", type=click.IntRange(min=100), help="Spans the ring buffer holds (default 10000).")
@output_format(*TEXT, json_help="the agent's answer")
@pass_cli
def start(cli: CliContext, every: Optional[int], modules: Optional[str], backward: Optional[bool],
          anomalies: Optional[bool], size: Optional[int], fmt: Optional[str]) -> None:
    """Start tracing (a running trace is replaced, its rows dropped). Refused by a read-only (--no-eval) agent."""
    _show(cli, lambda c: c.trace_start(every=every, modules=modules, backward=backward, anomalies=anomalies,
                                       size=size), fmt)


@trace.command("stop")
@output_format(*TEXT, json_help="the agent's answer")
@pass_cli
def stop(cli: CliContext, fmt: Optional[str]) -> None:
    """Stop tracing and take the hooks out; the rows stay queryable until the next start."""
    _show(cli, lambda c: c.trace_stop(), fmt)


@trace.command("status")
@output_format(*TEXT, json_help="the agent's answer")
@pass_cli
def status(cli: CliContext, fmt: Optional[str]) -> None:
    """On or off, options, rows held, steps seen, time spent in the hooks, and why a trace failed."""
    _show(cli, lambda c: c.trace_status(), fmt)


@trace.command("export")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, writable=True),
              help="The Chrome trace-event JSON file to write (one process per rank, one track per thread).")
@pass_cli
def export(cli: CliContext, output: str) -> None:
    """Write the trace for Perfetto (ui.perfetto.dev) or chrome://tracing; several targets go into one file."""
    events: List[Dict[str, Any]] = []
    for _, answer in each_target(cli, lambda c: c.trace_export()):
        events.extend(answer.get("traceEvents", []))
    if not events and cli.failures:
        return
    with open(output, "w") as handle:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, handle)
    spans = sum(1 for e in events if e.get("ph") == "X" and e.get("cat") != "step")
    say("wrote %d spans to %s" % (spans, output), err=True)


def _show(cli: CliContext, work: Any, fmt: Optional[str]) -> None:
    """Each target's answer; across ranks, the ranks whose status reads the same share one block."""
    several = cli.is_cluster or len(cli.targets) > 1
    grouped = []
    for client, answer in each_target(cli, work):
        member = cli.cluster_member(client)
        if fmt == "json":
            where = dict(rank=member.rank, host=member.host) if member is not None else dict(target=client.target.label)
            emit(json.dumps(dict(answer, **where) if several else answer))
        elif member is not None:
            grouped.append((member.rank, "\n".join(status_lines(answer))))
        else:
            for line in status_lines(answer):
                say(("%s: " % client.target.label if several else "") + line)
    for line in render_grouped_text(grouped):
        say(line)


def status_lines(status: Dict[str, Any]) -> Iterator[str]:
    """A trace status (the agent's answer) as lines for a person."""
    state = status.get("state", "?")
    if state == "off":
        yield "trace: off (never started in this process); anomalies recorded: %s" % status.get("anomalies", 0)
        return
    options = status.get("options") or {}
    parts = ["every %s" % options.get("every", 1), "modules %s" % visible(str(options.get("modules", "*")))]
    parts += [name for name in ("backward", "anomalies") if options.get(name)]
    yield "trace: %s (%s), memory from %s" % (state, ", ".join(parts), status.get("device", "?"))
    if status.get("failure"):
        yield "  switched off by an error in a hook: %s" % visible(str(status["failure"]))
    dropped = status.get("spans_dropped_unread")
    yield "  rows held: %s of %s (%s spans recorded%s)" % (
        status.get("rows"), status.get("size"), status.get("spans_recorded"),
        "; about %s older ones dropped before any read, unbuilt" % dropped if dropped else "")
    yield "  step: %s (%s steps seen)" % (status.get("step"), status.get("steps_seen"))
    yield "  overhead: %.3f%% of wall time inside the hooks (%.3f s; %s us per step)" % (
        status.get("overhead_percent", 0.0), status.get("hook_seconds", 0.0), status.get("hook_us_per_step"))
    if status.get("append_only_calls"):
        yield ("    incl. %s append-only hook calls at an estimated %.1f us each (not timed: that would double "
               "their cost)" % (status["append_only_calls"], status.get("append_ns", 0) / 1e3))
    if state != "on" and status.get("hooks_left"):
        yield "  hooks still registered: %s (the optimizer's leave at the next forward)" % status["hooks_left"]
    yield "  anomalies recorded: %s" % status.get("anomalies", 0)
