"""The ``probe`` command. ``main()`` is the console script; it turns probe errors into one-line messages."""

import os
import sys
from typing import List, Optional

__all__ = ["main", "INTERRUPTED"]

INTERRUPTED = 130  # the shell's code for a command ended by Ctrl-C (128 + SIGINT)


def main(argv: Optional[List[str]] = None) -> int:
    from probe.cli.app import normalise_argv
    from probe.cli.output import say
    from probe.errors import ProbeError

    args = normalise_argv(list(sys.argv[1:] if argv is None else argv))
    try:
        code = _run(args)
    except ProbeError as exc:
        message = exc.message + (" -- %s" % exc.hint if exc.hint else "")
        say("probe: error: " + message, err=True)  # the message may quote a target: no escape reaches the terminal
        code = exc.exit_code
    except KeyboardInterrupt as exc:
        code = _interrupted(exc)
    except BrokenPipeError:
        code = 0
    except Exception as exc:  # click's own: imported only where click read the command line
        click = sys.modules.get("click")
        if click is None:
            raise
        if isinstance(exc, click.exceptions.Exit):
            code = exc.exit_code
        elif isinstance(exc, click.ClickException):
            exc.show()
            code = exc.exit_code
        elif isinstance(exc, click.exceptions.Abort):
            code = _interrupted(exc)
        else:
            raise
    if argv is None:
        _exit(code)
    return code


def _run(args: List[str]) -> int:
    """Run the command line: the commands people run in loops without click where it is a plain one
    (``probe.cli.fast``), else through the click group."""
    from probe.cli import fast

    code = fast.run(args)
    if code is not None:
        return code
    from probe.cli.app import cli
    from probe.cli.context import CliContext

    with cli.make_context("probe", args) as ctx:
        cli.invoke(ctx)
    return ctx.obj.exit_code if isinstance(ctx.obj, CliContext) else 0


def _interrupted(exc: BaseException) -> int:
    """Ctrl-C: one line, not a traceback; the command already told the agent to stop what it could."""
    from probe.cli.output import say

    start = "\n" if sys.stderr.isatty() else ""  # after the terminal's "^C", on a line of its own
    say("%sprobe: %s" % (start, str(exc) or "interrupted (Ctrl-C)"), err=True)
    return INTERRUPTED


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
