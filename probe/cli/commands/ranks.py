"""``probe MASTER:PORT ranks``: every rank of the job, as the host helpers see them."""

from typing import Any, Optional

from probe.cli.commands import made_on_first_use
from probe.cli.context import CliContext
from probe.cli.output import print_rows, say
from probe.cli.render import render_rows
from probe.cli.spec import TABLE_FORMATS, output_params

PARAMS = output_params(*TABLE_FORMATS, json_help="the member list as JSON rows", older_f=True)
"""The command's options, which click and ``probe.cli.fast`` both read (``probe.cli.spec``)."""


def _command() -> Any:
    import click

    from probe.cli.context import pass_cli
    from probe.cli.options import with_params

    @click.command("ranks")
    @with_params(PARAMS)
    @pass_cli
    def ranks(cli: CliContext, fmt: Optional[str]) -> None:
        """List the job's ranks: rank, host, port, pid, state (running, silent, stopped, starting, dead).

        \b
        TARGET is the master's HOST:PROBE_PORT, whose node helper (port PROBE_PORT - 1) knows every node's
        ranks, under any launcher; or slurm:JOBID[:PORT], whose nodes Slurm names. The ranks share one
        token: stderr says where it is. Exit 7 where a node or a member was left out (stderr says which).
        """
        run(cli, fmt)

    return ranks


__getattr__ = made_on_first_use("ranks", _command)


def run(cli: CliContext, fmt: Optional[str] = None) -> None:
    """The command (``probe.cli.fast`` calls it without click)."""
    cli.all_ranks = True
    cluster = cli.cluster()
    fmt = fmt or "table"
    print_rows(render_rows(cluster.ranks_rows(), fmt), fmt)
    for member in cluster.members:
        if member.note:  # its port was taken (another user's process there cannot prove it holds the token)
            say("probe: rank %d: %s" % (member.rank, member.note), err=True)
    if cluster.token_file:
        say("probe: the job's token: %s (on the master's host)" % cluster.token_file, err=True)

