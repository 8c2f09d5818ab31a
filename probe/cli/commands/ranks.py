"""``probe MASTER:PORT ranks``: every rank of the job, as the host helpers see them."""

import click

from probe.cli.context import CliContext, pass_cli
from probe.cli.render import FORMATS, render_rows


@click.command("ranks")
@click.option("-f", "--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True,
              help="How to print the member list.")
@pass_cli
def ranks(cli: CliContext, fmt: str) -> None:
    """List the job's ranks: rank, host, port, pid, state (running, silent, stopped, starting, dead).

    \b
    TARGET is the master's HOST:PROBE_PORT; its launcher's host helper (port PROBE_PORT - 1) knows every
    node's ranks. The ranks share one token: stderr says where it is.
    """
    cli.all_ranks = True
    cluster = cli.cluster()
    click.echo(render_rows(cluster.ranks_rows(), fmt))
    if cluster.token_file:
        click.echo("probe: the job's token: %s (on the master's host)" % cluster.token_file, err=True)
