"""Imports torch once, then runs scripts in fresh forked children of itself: a test module with many short
torch scripts pays the torch import (5-20 s on a loaded 2-core box) once, not once a script.

Prints ``READY <pid>`` once torch is imported. Then each line on stdin is JSON ``{"code", "argv", "out",
"err"}``: a child is forked that sends its stdout and stderr to the files ``out`` and ``err``, runs ``code``
as ``python -c`` would (``__name__`` is "__main__", ``sys.argv`` is ``["-c", *argv]``) and exits as it would
(0; 1 with the traceback on an exception; ``sys.exit``'s code). The line ``DONE <exit status>`` answers it
(a signal's death as its negative number, as subprocess says it). No agent (no PROBE): the scripts under
test start what they need themselves. Ends when stdin closes."""

import json
import os
import sys
import traceback

import torch  # noqa: F401 -- the reason for this process: every child has it imported already

os.chdir(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo, as cwd=REPO


def _die_with(parent: int) -> None:
    """The kernel kills this child once the forker is gone (the test kills the forker, not its children:
    a script still running then must not outlive it)."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the forker died before the line above: go now
        os._exit(1)


def _child(request: dict, parent: int) -> None:
    """Runs in the forked child: never returns."""
    code = 1
    try:
        _die_with(parent)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd, path in ((1, request["out"]), (2, request["err"])):
            handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(handle, fd)
            os.close(handle)
        sys.argv = ["-c", *request["argv"]]
        try:
            exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            code = 0
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main() -> None:
    print("READY", os.getpid(), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        parent = os.getpid()
        child = os.fork()
        if child == 0:
            _child(request, parent)
        _, status = os.waitpid(child, 0)
        code = os.waitstatus_to_exitcode(status)
        print("DONE", code, flush=True)


if __name__ == "__main__":
    main()
