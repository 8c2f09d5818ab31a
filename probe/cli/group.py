"""The click group of the ``probe`` command: its global options, its help and completion (every command
with its summary), and each command imported from the list in ``probe.cli.app`` on first use."""

import difflib
import importlib
from typing import Any, List, Optional, Tuple

import click

import probe
from probe.cli.app import _NO_TARGET, COMMANDS
from probe.cli.context import CliContext
from probe.cli.options import with_params
from probe.cli.spec import GLOBAL_PARAMS

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
@with_params(GLOBAL_PARAMS)
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
