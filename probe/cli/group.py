"""The click group of the ``probe`` command: its global options, its help and completion (every command
with its summary), and each command imported from the list in ``probe.cli.app`` on first use."""

import difflib
import importlib
from typing import Any, List, Optional, Tuple

import click

import probe
from probe.cli.app import _NO_TARGET, COMMANDS
from probe.cli.context import CliContext
from probe.cli.options import Seconds

__all__ = ["cli"]


class _Commands(click.Group):
    """A group whose commands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> List[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> Optional[click.Command]:
        if name not in COMMANDS:
            return None
        module, attr = COMMANDS[name]
        command: Any = getattr(importlib.import_module("probe.cli.commands." + module), attr)
        if name not in _NO_TARGET:
            _usage_shows_target(command)
        return command

    def resolve_command(self, ctx: click.Context, args: List[str]) -> Any:
        """A command misspelt (``backtrac``) is named with the command meant, not only refused."""
        name = args[0] if args else ""
        if name and name not in COMMANDS and not name.startswith("-"):
            meant = command_meant(name)
            if meant:
                ctx.fail("No such command %r. Did you mean %r?" % (name, meant))
        return super().resolve_command(ctx, args)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Each command's first sentence whole (click cuts it at the terminal's width), wrapped."""
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(limit=400)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def _usage_shows_target(command: click.Command) -> None:
    """Make ``probe query --help`` say ``probe TARGET query [OPTIONS] SQL`` (and so for a group's commands);
    a command that takes the target as its own argument (``probe mcp [TARGET]``) says it there, once."""
    if any(isinstance(p, click.Argument) and p.name in ("target", "targets") for p in command.params):
        return

    def format_usage(ctx: click.Context, formatter: click.HelpFormatter) -> None:
        root = ctx.find_root().info_name or "probe"
        formatter.write_usage(root + " TARGET" + ctx.command_path[len(root):], " ".join(command.collect_usage_pieces(ctx)))

    command.format_usage = format_usage  # type: ignore[method-assign]
    for sub in getattr(command, "commands", {}).values():
        _usage_shows_target(sub)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]}, invoke_without_command=True,
             no_args_is_help=True)
@click.option("-t", "--target", "targets", multiple=True, metavar="TARGET",
              help="A pid, HOST:PORT, unix:PATH or core:PATH (repeatable). Default: $PROBE_TARGET.")
@click.option("--token", envvar="PROBE_TOKEN", help="Token for TCP targets (or $PROBE_TOKEN).")
@click.option("--token-file", envvar="PROBE_TOKEN_FILE", type=click.Path(dir_okay=False),
              help="File holding the token for TCP targets (or $PROBE_TOKEN_FILE).")
@click.option("--timeout", type=Seconds(0.01), default=None,
              help="Seconds to wait for each target's answer, a long query's or snippet's too; inject's time "
                   "limit. Default: 30, or a query's or snippet's own time limit and 5 s more.")
@click.option("--wait", type=Seconds(0.0), default=None,
              help="Wait this long for a local agent before reading the process from outside. "
                   "Default: decide in about a second whether it can answer (GIL held, stopped).")
@click.option("--executable", type=click.Path(dir_okay=False), metavar="PATH",
              help="For a core:PATH target: the Python executable that made the core (default: as the core says).")
@click.option("--all-ranks", is_flag=True,
              help="Every rank of the job whose master is TARGET (HOST:PROBE_PORT, under any launcher; or "
                   "slurm:JOBID[:PORT]), at once; answers grouped.")
@click.option("--ranks", metavar="LIST", help="Only these ranks, e.g. 0-3,8 (implies --all-ranks).")
@click.option("--hosts", type=click.Path(dir_okay=False), metavar="FILE",
              help="Every target listed in FILE (one per line), at once, numbered by the ranks they say they are "
                   "(else by line: 0, 1, ...).")
@click.option("--deadline", type=Seconds(0.01),
              help="Across ranks: answer with what arrived after this long (default 10, at most --timeout); "
                   "several -t: none unless given.")
@click.option("--max-in-flight", type=click.IntRange(min=1), default=32, show_default=True,
              help="Across ranks: requests in flight at once; one unanswered after 0.25 s stops counting "
                   "(up to 512 open).")
@click.option("--via", type=click.Choice(["auto", "helpers", "direct"]), default="auto", show_default=True,
              envvar="PROBE_VIA", help="Across ranks: ask each node's helper once, which asks its ranks (helpers), or "
                                       "every rank from here (direct); auto: through the helpers past 1024 ranks.")
@click.option("--cacert", envvar="PROBE_CACERT", type=click.Path(dir_okay=False), metavar="PEM",
              help="Speak TLS to TCP targets and helpers, trusting the certificates this CA signed (or $PROBE_CACERT).")
@click.option("--cert", envvar="PROBE_CERT", type=click.Path(dir_okay=False), metavar="PEM",
              help="Client certificate for agents that ask for one (mutual TLS; or $PROBE_CERT).")
@click.option("--key", envvar="PROBE_KEY", type=click.Path(dir_okay=False), metavar="PEM",
              help="The client certificate's key, where not in its file (or $PROBE_KEY).")
@click.version_option(probe.__version__, prog_name="probe")
@click.pass_context
def cli(ctx: click.Context, targets: Tuple[str, ...], token: Optional[str], token_file: Optional[str],
        timeout: float, wait: Optional[float], executable: Optional[str], all_ranks: bool, ranks: Optional[str],
        hosts: Optional[str], deadline: Optional[float], max_in_flight: int, via: str = "auto",
        cacert: Optional[str] = None, cert: Optional[str] = None, key: Optional[str] = None) -> None:
    """Ask a live Python process questions in SQL, and run Python in it.

    \b
      PROBE=1 python train.py &                      start any script with an agent
      probe list                                     local processes with an agent
      probe PID backtrace                            every thread's stack
      probe PID query "SELECT * FROM process.info"   SQL over live state
      probe PID eval "print(model)"                  Python in the target
      probe PID inject                               attach to a running process
      probe HOST:PORT --token-file tok tables        a remote agent over TCP
      probe MASTER:PORT --all-ranks backtrace        every rank of a job, grouped
      probe MASTER:PORT diagnose                     what is wrong, which rank, where
    """
    from probe.client.wording import use_cli_words

    use_cli_words()  # the library's errors name this command's flags, not its API's parameters
    if cacert or cert or key:
        from probe.client import transport

        transport.use_tls(cacert, cert, key)  # every TCP connection of this command, helpers' too
    ctx.obj = CliContext(list(targets), token, token_file, timeout, wait=wait, executable=executable,
                         all_ranks=all_ranks, ranks=ranks, hosts=hosts, deadline=deadline, max_in_flight=max_in_flight)
    ctx.obj.via = via
    ctx.obj.timeout_given = timeout is not None
    if timeout is None:
        ctx.obj.timeout = 30.0
    if ctx.invoked_subcommand is None:  # `probe 4242` alone: say what could follow
        raise click.UsageError(_missing_command(ctx, targets), ctx)


def command_meant(word: str) -> Optional[str]:
    """The command ``word`` is a slip of (``backtrac``, ``diagnsoe``, ``Query``), or None."""
    close = difflib.get_close_matches(word.lower(), list(COMMANDS), n=1, cutoff=0.7)
    return close[0] if close else None


def _missing_command(ctx: click.Context, targets: Tuple[str, ...]) -> str:
    """The message for a command line with no command: how to write one, and every command with its summary.
    A lone word that is a slip of a command's name (``probe backtrac``) is answered with that command."""
    if len(targets) == 1 and not targets[0][:1].isdigit() and ":" not in targets[0] and command_meant(targets[0]):
        return "%r is not a command or a target. Did you mean `probe TARGET %s`?" % (targets[0],
                                                                                  command_meant(targets[0]))
    group = ctx.command
    assert isinstance(group, _Commands)
    formatter = ctx.make_formatter()
    rows = []
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if command is not None and not command.hidden and not (targets and name in _NO_TARGET):
            rows.append((name, command.get_short_help_str(limit=formatter.width - 16)))  # one line each
    with formatter.indentation():
        formatter.write_dl(rows)
    example = "probe %s COMMAND" % " ".join(targets) if targets else "probe TARGET COMMAND"
    return "Missing command: write `%s`, where COMMAND is one of:\n%s" % (example, formatter.getvalue().rstrip())
