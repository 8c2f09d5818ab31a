"""The one entry point through which an agent is started from outside the user's code.

The injector runs a single line in the target that imports this module and calls
:func:`start_from_injector`; the ``PROBE=1`` start-up hook calls :func:`start_from_environment`. Both
end in ``probe.agent.start``, which is idempotent: a second call finds the running agent. Neither may
ever raise into the target: a failure is written to stderr and swallowed.
"""

import os
import sys
from typing import List, Optional, Tuple

from probe._threads import daemon_thread

__all__ = ["start_from_injector", "start_from_environment"]


def start_from_injector(options_json: str = "") -> None:
    """Start (or find) the agent with the options the injector sent as JSON; never raises.

    The injector runs this on the target's main thread (between two bytecodes, or on a parked
    thread), so it only starts a daemon thread: importing the agent and opening its sockets happen
    there, and the main thread goes back to its own work at once.
    """
    try:

        daemon_thread(_start_injected, "probe-start", (options_json,)).start()
    except BaseException as exc:  # the target must survive whatever happens here
        _report(exc)


def _start_injected(options_json: str) -> None:
    try:
        from probe.agent import start
        from probe.agent.options import AgentOptions

        start(options=AgentOptions.from_env().with_overrides(**_explicit(options_json)))
    except BaseException as exc:
        _report(exc)


_tried_in = 0  # the pid that already ran start_from_environment (a pid, so a forked child is not fooled)


def start_from_environment() -> Optional[object]:
    """Start the agent as ``PROBE=1`` / ``PROBE_LISTEN`` / ``PROBE_PORT`` asks, unless this process is a
    launcher or the probe command itself (``PROBE=1`` exported in a shell must not put an agent into
    ``probe list``). A launcher with ``PROBE_PORT`` gets the host helper (``probe.host``) instead.

    Once per process: in a virtual environment whose ``lib64`` links to ``lib``, site runs every
    ``.pth`` file twice, and a start that failed must say so once, not try and complain again.
    """
    global _tried_in
    if _tried_in == os.getpid():
        return None
    _tried_in = os.getpid()
    try:
        argv = _command_line()
        if _is_launcher(argv):
            if os.environ.get("PROBE_PORT"):  # the node's host helper: lists the ranks, reads them from outside
                from probe.host.helper import start_in_launcher

                start_in_launcher(os.environ["PROBE_PORT"])
            return None
        if _is_probe_cli(argv):
            return None
        from probe.agent import start

        agent = start()
        if os.environ.get("PROBE_PORT"):  # a rank of a job: its node's helper lists it, under any launcher
            from probe.agent import registration

            registration.start(agent, os.environ["PROBE_PORT"])
        if os.environ.get("PROBE_TORCH_TRACE"):  # trace from the first step, once the program imports torch
            from probe.tables.torch.trace_autostart import arm_from_environment

            arm_from_environment()
        return agent
    except BaseException as exc:
        _report(exc)
        return None


def _explicit(options_json: str) -> dict:
    from probe.agent.options import AgentOptions

    if not options_json:
        return {}
    defaults = AgentOptions()
    given = AgentOptions.from_json(options_json)
    # Only options the injector set differently from the defaults override the environment.
    return {k: v for k, v in given.__dict__.items() if getattr(defaults, k) != v}


def _command_line() -> List[str]:
    """This interpreter's command line as it was typed, also at interpreter start (the ``.pth`` hook),
    where ``sys.argv`` is not set yet: ``sys.orig_argv`` (3.10+), else ``/proc/self/cmdline``."""
    orig = getattr(sys, "orig_argv", None)
    if orig:
        return list(orig)
    try:
        with open("/proc/self/cmdline", "rb") as handle:
            raw = handle.read()
        return [a.decode("utf-8", "surrogateescape") for a in raw.split(b"\0")[:-1]]
    except OSError:
        return list(getattr(sys, "argv", None) or [])


def _is_launcher(argv: List[str]) -> bool:
    """torchrun's own agent process starts the ranks; only the ranks are probed.

    At interpreter start (the ``.pth`` hook) ``__main__`` is not loaded yet, so the command line is
    what tells: ``torchrun ...`` or ``python -m torch.distributed.run ...``.
    """
    if argv and argv[0].endswith("torchrun"):
        return True
    if sys.argv and sys.argv[0].endswith(("torchrun", "torch/distributed/run.py")):
        return True
    kind, name = _what_runs(argv)
    if kind == "module":
        return name in ("torch.distributed.run", "torch.distributed.launch")
    return kind == "script" and name.endswith(("torchrun", "torch/distributed/run.py"))


def _is_probe_cli(argv: List[str]) -> bool:
    """Whether this interpreter runs the probe command (``python -m probe ...``, the ``probe`` script) or a
    node helper (``python -m probe.host``, which a rank starts with the job's environment)."""
    if argv and os.path.basename(argv[0]) == "probe":
        return True
    kind, name = _what_runs(argv)
    if kind == "module":
        return name in ("probe", "probe.cli", "probe.host")
    return kind == "script" and os.path.basename(name) == "probe"


_OPTIONS_WITH_VALUE = ("-W", "-X", "--check-hash-based-pycs")


def _what_runs(argv: List[str]) -> Tuple[str, str]:
    """From an interpreter's command line: ("module", NAME) for ``-m NAME``, ("script", PATH), or
    ("other", "") for ``-c``, stdin or an interactive interpreter."""
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            return ("module", argv[i + 1]) if i + 1 < len(argv) else ("other", "")
        if arg.startswith("-m"):
            return "module", arg[2:]
        if arg.startswith("-c") or arg in ("-", "--"):
            return "other", ""
        if not arg.startswith("-"):
            return "script", arg
        i += 2 if arg in _OPTIONS_WITH_VALUE else 1
    return "other", ""


def _report(exc: BaseException) -> None:
    """One line on stderr: a probe error as its message and fix, anything else with its type."""
    try:
        from probe.errors import ProbeError

        if isinstance(exc, ProbeError):
            why = exc.message + (" -- %s" % exc.hint if exc.hint else "")
        else:
            why = "%s: %s" % (type(exc).__name__, exc)
        sys.stderr.write("probe: could not start the agent in process %d: %s\n" % (os.getpid(), why))
        sys.stderr.flush()
    except BaseException:
        pass
