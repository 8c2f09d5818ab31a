"""``probe TARGET backtrace``: every thread's stack, innermost frame first."""

import json

import click

from probe.cli.context import CliContext, each_target, pass_cli
from probe.cli.render import render_backtrace


@click.command("backtrace")
@click.option("--json", "as_json", is_flag=True, help="Print the frames as JSON rows (those of python.backtrace).")
@pass_cli
def backtrace(cli: CliContext, as_json: bool) -> None:
    """Print the Python stack of every thread, like py-spy dump."""
    several = len(cli.targets) > 1
    for client, frames in each_target(cli, lambda c: c.backtrace()):
        if as_json:
            records = [f.as_row() for f in frames]
            if several:
                for record in records:
                    record["target"] = client.target.label
            click.echo(json.dumps(records))
            continue
        if several:
            click.echo("== %s ==" % client.target.label)
        click.echo("\n".join(render_backtrace(frames)))
