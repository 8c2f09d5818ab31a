"""The one entry point through which an agent is started from outside the user's code.

The injector runs a single line in the target that imports this module and calls
:func:`start_from_injector`; the ``PROBE=1`` start-up hook calls :func:`start_from_environment`. Both
end in ``probe.agent.start``, which is idempotent: a second call finds the running agent. Neither may
ever raise into the target: a failure is written to stderr and swallowed.
"""

import sys
from typing import Optional

__all__ = ["start_from_injector", "start_from_environment"]


def start_from_injector(options_json: str = "") -> None:
    """Start (or find) the agent with the options the injector sent as JSON; never raises.

    The injector runs this on the target's main thread (between two bytecodes, or on a parked
    thread), so it only starts a daemon thread: importing the agent and opening its sockets happen
    there, and the main thread goes back to its own work at once.
    """
    try:
        import threading

        threading.Thread(target=_start_injected, args=(options_json,), name="probe-start", daemon=True).start()
    except BaseException as exc:  # the target must survive whatever happens here
        _report(exc)


def _start_injected(options_json: str) -> None:
    try:
        from probe.agent import start
        from probe.agent.options import AgentOptions

        start(options=AgentOptions.from_env().with_overrides(**_explicit(options_json)))
    except BaseException as exc:
        _report(exc)


def start_from_environment() -> Optional[object]:
    """Start the agent as ``PROBE=1`` / ``PROBE_LISTEN`` asks, unless this process is a launcher."""
    try:
        if _is_launcher():
            return None
        from probe.agent import start

        return start()
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


def _is_launcher() -> bool:
    """torchrun's own agent process starts the ranks; only the ranks are probed.

    At interpreter start (the ``.pth`` hook) ``__main__`` is not loaded yet, so the command line is
    what tells: ``torchrun ...`` or ``python -m torch.distributed.run ...``.
    """
    argv = list(getattr(sys, "orig_argv", None) or sys.argv or [])
    if argv and argv[0].endswith("torchrun"):
        return True
    if sys.argv and sys.argv[0].endswith(("torchrun", "torch/distributed/run.py")):
        return True
    for i, arg in enumerate(argv[:-1]):
        if arg == "-m" and argv[i + 1] in ("torch.distributed.run", "torch.distributed.launch"):
            return True
    return False


def _report(exc: BaseException) -> None:
    try:
        sys.stderr.write("probe: could not start the agent: %s: %s\n" % (type(exc).__name__, exc))
    except BaseException:
        pass
