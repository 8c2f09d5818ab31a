"""``probe TARGET tables`` and ``probe TARGET schema NAME``: what can be queried."""

import json
from typing import Any, Callable, Optional

import click

from probe.cli.context import CliContext, each_target, pass_cli
from probe.cli.options import TEXT, output_format
from probe.cli.output import emit, say
from probe.cli.render import render_schema, render_tables


@click.command("tables")
@output_format(*TEXT, json_help="the table specs")
@pass_cli
def tables(cli: CliContext, fmt: Optional[str]) -> None:
    """List every table with its description (across ranks: once for the ranks that agree)."""
    _show(cli, lambda c: c.tables(), lambda specs: [s.to_json() for s in specs],
          lambda specs: "\n".join(render_tables(specs)), fmt == "json")


@click.command("schema")
@click.argument("name")
@output_format(*TEXT, json_help="the spec")
@pass_cli
def schema(cli: CliContext, name: str, fmt: Optional[str]) -> None:
    """Show a table's columns, their types and descriptions (across ranks: once for the ranks that agree)."""
    _show(cli, lambda c: c.schema(name), lambda spec: spec.to_json(), lambda spec: "\n".join(render_schema(spec)),
          fmt == "json")


def _show(cli: CliContext, work: Callable[[Any], Any], as_data: Callable[[Any], Any], as_text: Callable[[Any], str],
          as_json: bool) -> None:
    """One target's answer as it is; across ranks, one JSON line per rank (with ``rank`` and ``host``) or
    the text once per group of ranks that gave the same."""
    if not cli.is_cluster:
        for _, answer in each_target(cli, work):
            emit(json.dumps(as_data(answer))) if as_json else say(as_text(answer))
        return
    from probe.cli.render_cluster import render_grouped_text

    texts = []
    for client, answer in each_target(cli, work):
        member: Any = cli.cluster_member(client)  # always known across ranks
        if as_json:
            emit(json.dumps({"rank": member.rank, "host": member.host, "answer": as_data(answer)}))
        else:
            texts.append((member.rank, as_text(answer)))
    for line in render_grouped_text(texts):
        say(line)
