"""``probe TARGET backtrace``: every thread's stack, innermost frame first."""

import json
from typing import Any, Optional

from probe.cli.commands import made_on_first_use
from probe.cli.context import CliContext, each_target
from probe.cli.output import emit, say
from probe.cli.render import render_backtrace
from probe.cli.spec import TEXT_FORMATS, Param, output_params

PARAMS = [
    Param("--native", dest="native",
          help="C/C++ frames too, between the Python ones (read from outside; the process is stopped for tens of "
               "milliseconds)."),
    *output_params(*TEXT_FORMATS, json_help="the frames as JSON rows, those of python.backtrace"),
]
"""The command's options, which click and ``probe.cli.fast`` both read (``probe.cli.spec``)."""


def _command() -> Any:
    import click

    from probe.cli.context import pass_cli
    from probe.cli.options import with_params

    @click.command("backtrace")
    @with_params(PARAMS)
    @pass_cli
    def backtrace(cli: CliContext, native: bool, fmt: Optional[str]) -> None:
        """Print the Python stack of every thread, like py-spy dump.

        \b
        The agent answers when it can. When it cannot (a C call holds the GIL, the process is stopped) the
        stacks are read from outside the process within about a second, and a line on stderr says why; a
        dead process shows the last stacks its agent recorded; TARGET may be core:PATH (a core file).
        """
        run(cli, native, fmt)

    return backtrace


__getattr__ = made_on_first_use("backtrace", _command)


def run(cli: CliContext, native: bool = False, fmt: Optional[str] = None) -> None:
    """The command (``probe.cli.fast`` calls it without click)."""
    as_json = fmt == "json"
    if cli.is_cluster:
        _across_ranks(cli, as_json, native)
        return
    several = len(cli.targets) > 1
    for client, frames in each_target(cli, lambda c: c.backtrace(native=native)):
        if as_json:
            records = [f.as_row() for f in frames]
            if several:
                for record in records:
                    record["target"] = client.target.label
            emit(json.dumps(records))
            continue
        if several:
            say("== %s ==" % client.target.label)
        say("\n".join(render_backtrace(frames)))


def _across_ranks(cli: CliContext, as_json: bool, native: bool) -> None:
    """Ranks grouped by identical stack per thread; --json: every rank's rows, ungrouped."""
    from probe.cli.context import report_failures
    from probe.cli.render_cluster import RankStacks, render_grouped_backtrace
    from probe.client.cluster import backtrace_records

    cluster = cli.cluster()
    if not as_json and not native:
        from probe.client import via_helpers

        if via_helpers.through_helpers(cluster):  # grouped by each node's helper: one request a node
            _through_helpers(cli, cluster)
            return
    answers = cluster.map(lambda c: c.backtrace(native=native))
    if cluster.progress is not None:
        cluster.progress(-1, 0, [])
    if as_json:
        emit(json.dumps(backtrace_records(answers)))
    else:
        stacks = [RankStacks(a.member.rank, a.value, a.note) for a in answers]
        if stacks:  # none when no rank answered: the failures below say why
            say("\n".join(render_grouped_backtrace(stacks, len(cluster.members))))
        for answer in answers:
            if answer.note:
                say("probe: %s: %s" % (answer.member.label, answer.note.splitlines()[0]), err=True)
    report_failures(cli, cluster.failures, len(cluster.members))


def _through_helpers(cli: CliContext, cluster) -> None:  # type: ignore[no-untyped-def]
    from probe.cli.context import report_failures
    from probe.cli.render import visible
    from probe.cli.render_cluster import render_groups, sorted_groups
    from probe.client import via_helpers

    grouped = via_helpers.backtrace_groups(cluster)
    if cluster.progress is not None:
        cluster.progress(-1, 0, [])
    if grouped.threads:  # none when no rank answered: the failures below say why
        say("\n".join(render_groups(sorted_groups(grouped.threads), grouped.outside, len(cluster.members))))
    for line in cluster.asked_directly:
        say("probe: " + visible(line), err=True)
    labels = {m.rank: m.label for m in cluster.members}
    for rank, note in sorted(grouped.outside.items()):
        say("probe: %s: %s" % (labels.get(rank, "rank %d" % rank), note.splitlines()[0]), err=True)
    report_failures(cli, cluster.failures, len(cluster.members))
