"""The ``probe`` command. ``main()`` is the console script; it turns probe errors into one-line messages."""

import os
import sys
from typing import List, Optional

__all__ = ["main", "INTERRUPTED"]

INTERRUPTED = 130  # the shell's code for a command ended by Ctrl-C (128 + SIGINT)


def main(argv: Optional[List[str]] = None) -> int:
    import click

    from probe.cli.app import cli, normalise_argv
    from probe.cli.context import CliContext
    from probe.cli.output import say
    from probe.errors import ProbeError

    args = normalise_argv(list(sys.argv[1:] if argv is None else argv))
    try:
        with cli.make_context("probe", args) as ctx:
            cli.invoke(ctx)
        code = ctx.obj.exit_code if isinstance(ctx.obj, CliContext) else 0
    except ProbeError as exc:
        message = exc.message + (" -- %s" % exc.hint if exc.hint else "")
        say("probe: error: " + message, err=True)  # the message may quote a target: no escape reaches the terminal
        code = exc.exit_code
    except click.exceptions.Exit as exc:
        code = exc.exit_code
    except click.ClickException as exc:
        exc.show()
        code = exc.exit_code
    except (click.exceptions.Abort, KeyboardInterrupt) as exc:
        # Ctrl-C: one line, not a traceback; the command already told the agent to stop what it could.
        start = "\n" if sys.stderr.isatty() else ""  # after the terminal's "^C", on a line of its own
        say("%sprobe: %s" % (start, str(exc) or "interrupted (Ctrl-C)"), err=True)
        code = INTERRUPTED
    except BrokenPipeError:
        code = 0
    if argv is None:
        _exit(code)
    return code


def _exit(code: int) -> None:
    """Exit with ``code``. Where fan-out threads still wait on targets that never answered (they are
    daemons, left to their socket timeouts), skip the interpreter's teardown: it would destroy what
    they still hold, such as a DuckDB connection of the client's, and DuckDB's bindings print a page of
    "leaked instance" lines on the user's terminal. Exit handlers still run, and output is flushed."""
    import threading

    if not any(t.name == "probe-fanout" and t.is_alive() for t in threading.enumerate()):
        sys.exit(code)
    import atexit

    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    os._exit(code)
