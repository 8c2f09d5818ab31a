"""The ``probe`` command line: ``probe [OPTIONS] [TARGET] COMMAND [ARGS]``.

Commands are registered in one explicit list below. A target written before the command
(``probe 4242 backtrace``) is the same as ``-t 4242``; ``-t`` may be repeated to run against several
targets in turn.
"""

from typing import List, Optional, Tuple

import click

import probe
from probe.cli.commands.backtrace import backtrace
from probe.cli.commands.eval_ import eval_
from probe.cli.commands.health import health
from probe.cli.commands.list_ import list_
from probe.cli.commands.query import query
from probe.cli.commands.tables import schema, tables
from probe.cli.context import CliContext

__all__ = ["cli", "COMMANDS", "normalise_argv"]

COMMANDS = [list_, query, eval_, backtrace, tables, schema, health]
_GLOBAL_WITH_VALUE = {"-t", "--target", "--token", "--token-file", "--timeout"}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-t", "--target", "targets", multiple=True, metavar="TARGET",
              help="A pid, HOST:PORT or unix:PATH (repeatable). Default: $PROBE_TARGET.")
@click.option("--token", envvar="PROBE_TOKEN", help="Token for TCP targets (or $PROBE_TOKEN).")
@click.option("--token-file", envvar="PROBE_TOKEN_FILE", type=click.Path(dir_okay=False),
              help="File holding the token for TCP targets (or $PROBE_TOKEN_FILE).")
@click.option("--timeout", type=click.FloatRange(min=0.01), default=30.0, show_default=True,
              help="Seconds to wait for each target's answer.")
@click.version_option(probe.__version__, prog_name="probe")
@click.pass_context
def cli(ctx: click.Context, targets: Tuple[str, ...], token: Optional[str], token_file: Optional[str],
        timeout: float) -> None:
    """Ask a live Python process questions in SQL, and run Python in it.

    \b
      PROBE=1 python train.py &                      start any script with an agent
      probe list                                     local processes with an agent
      probe PID backtrace                            every thread's stack
      probe PID query "SELECT * FROM process.info"   SQL over live state
      probe PID eval "print(model)"                  Python in the target
      probe HOST:PORT --token-file tok tables        a remote agent over TCP
    """
    ctx.obj = CliContext(list(targets), token, token_file, timeout)


for _command in COMMANDS:
    cli.add_command(_command)


def _add_inject() -> None:
    """``inject`` comes with the injector; the CLI works without it."""
    try:
        from probe.cli.commands.inject import inject
    except ImportError:
        return
    cli.add_command(inject)
    COMMANDS.append(inject)


_add_inject()


def normalise_argv(argv: List[str]) -> List[str]:
    """Turn ``probe 4242 backtrace`` into ``probe -t 4242 backtrace`` (also after other global options)."""
    names = set(cli.commands)
    out = list(argv)
    i = 0
    while i < len(out):
        arg = out[i]
        if arg in _GLOBAL_WITH_VALUE:
            i += 2
            continue
        if arg.startswith("-"):
            i += 1
            continue
        if arg not in names:
            out[i:i + 1] = ["-t", arg]
            i += 2
            continue
        break
    return out
