"""``probe TARGET tables`` and ``probe TARGET schema NAME``: what can be queried."""

import json

import click

from probe.cli.context import CliContext, each_target, pass_cli
from probe.cli.render import render_schema, render_tables


@click.command("tables")
@click.option("--json", "as_json", is_flag=True, help="Print the table specs as JSON.")
@pass_cli
def tables(cli: CliContext, as_json: bool) -> None:
    """List every table with its description."""
    for _, specs in each_target(cli, lambda c: c.tables()):
        if as_json:
            click.echo(json.dumps([s.to_json() for s in specs]))
        else:
            click.echo("\n".join(render_tables(specs)))


@click.command("schema")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print the spec as JSON.")
@pass_cli
def schema(cli: CliContext, name: str, as_json: bool) -> None:
    """Show a table's columns, their types and descriptions."""
    for _, spec in each_target(cli, lambda c: c.schema(name)):
        click.echo(json.dumps(spec.to_json()) if as_json else "\n".join(render_schema(spec)))
