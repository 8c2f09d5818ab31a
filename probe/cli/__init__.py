"""The ``probe`` command. ``main()`` is the console script; it turns probe errors into one-line messages."""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is for the checker alone: ``probe PID backtrace`` must not pay for it (probe.cli.quick)
    from typing import List, Optional

__all__ = ["main", "INTERRUPTED"]

INTERRUPTED = 130  # the shell's code for a command ended by Ctrl-C (128 + SIGINT)


def main(argv: Optional[List[str]] = None) -> int:
    if argv is None:  # the command itself: its plain backtrace is answered before the rest is imported
        code = _quick(sys.argv[1:])
        if code is not None:
            _exit(code, quick=True)
            return code
    from probe.cli.app import normalise_argv
    from probe.cli.output import say
    from probe.errors import ProbeError

    args = normalise_argv(list(sys.argv[1:] if argv is None else argv))
    try:
        code = _run(args)
    except ProbeError as exc:
        address = getattr(exc, "job_address", None)
        if address is not None:  # nothing serves the job's address: had a job there died?
            from probe.cli.dead_job import died_here

            exc.hint = died_here(*address) or exc.hint
        from probe._words import for_target

        message = for_target(exc.message + (" -- %s" % exc.hint if exc.hint else ""), _one_target(args))
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


def _quick(args: List[str]) -> Optional[int]:
    """``probe.cli.quick``'s exit code, with the usual words for Ctrl-C and a closed pipe; None where the usual
    path runs the command line."""
    try:
        from probe.cli import quick

        return quick.run(args)
    except KeyboardInterrupt as exc:
        return _interrupted(exc)
    except BrokenPipeError:
        return 0


def _one_target(args: List[str]) -> Optional[str]:
    """The one target of a normalised command line (``--target X``), which hints then name; None for several."""
    found = [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("-t", "--target")]
    found += [a.split("=", 1)[1] for a in args if a.startswith("--target=")]
    return found[0] if len(found) == 1 else None


def _run(args: List[str]) -> int:
    """Run the command line: the commands people run in loops without click where it is a plain one
    (``probe.cli.fast``), else through the click group."""
    from probe.cli import fast

    code = fast.run(args)
    if code is not None:
        return code
    from probe.cli.group import cli
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


def _exit(code: int, quick: bool = False) -> None:
    """Exit with ``code``, skipping the interpreter's teardown where it has nothing to do that matters.
    Exit handlers still run, and output is flushed; threads that are no daemons are waited for as always.

    * A command run without click (``probe.cli.fast``: the ones people run in loops) leaves no file open
      and nothing to tear down but its own modules, which takes the interpreter some 5 ms.
    * ``quick``: ``probe.cli.quick`` answered, which starts no thread and imports not even threading.
    * Where fan-out threads still wait on targets that never answered (they are daemons, left to their
      socket timeouts), the teardown would destroy what they still hold, such as a DuckDB connection of
      the client's, and DuckDB's bindings print a page of "leaked instance" lines on the user's terminal.
    """
    if quick:
        _exit_now(code, True)
        return
    import threading

    from probe.cli import fast

    others = [t for t in threading.enumerate() if t is not threading.current_thread() and t.is_alive()]
    if any(not t.daemon for t in others):
        sys.exit(code)
    if not fast.ran and not any(t.name == "probe-fanout" for t in others):
        sys.exit(code)
    _exit_now(code, fast.ran)


def _exit_now(code: int, ran_here: bool) -> None:
    """Run the exit handlers, flush, and end the process without the interpreter's teardown."""
    import atexit

    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        if ran_here:
            sys.exit(code)  # as Python would have it: its words, and its exit status, for output it cannot flush
    os._exit(code)
