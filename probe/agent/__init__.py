"""The agent that runs inside the target process. ``start()`` is idempotent and never imports torch."""

import os
import threading
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from probe.agent.options import AgentOptions

__all__ = ["start", "stop", "current"]

_lock = threading.Lock()
_agent: Optional[Any] = None
_fork_hook_installed = False


def start(options: "Optional[AgentOptions]" = None, **overrides: Any) -> Any:
    """Start the agent in this process, or return the one already running.

    ``options`` (or keyword overrides such as ``listen="0.0.0.0:9700"``, ``eval_enabled=False``) take
    precedence over ``PROBE_*`` environment variables.
    """
    global _agent
    with _lock:
        if _agent is not None and _agent.pid == os.getpid():
            return _agent
        from probe.agent.agent import Agent
        from probe.agent.options import AgentOptions

        if options is None:
            options = AgentOptions.from_env(**overrides)
        elif overrides:
            options = options.with_overrides(**overrides)
        agent = Agent(options).start()
        _agent = agent
        _install_fork_hook()
        return agent


def stop() -> None:
    """Stop the agent of this process, if one runs."""
    global _agent
    with _lock:
        if _agent is not None:
            _agent.stop()
            _agent = None


def current() -> Optional[Any]:
    """The running agent of this process, or None."""
    agent = _agent
    return agent if agent is not None and agent.pid == os.getpid() else None


def _install_fork_hook() -> None:
    global _fork_hook_installed
    if not _fork_hook_installed and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _fork_hook_installed = True


def _after_fork_in_child() -> None:
    """A forked child must neither serve on nor hold the parent's sockets."""
    global _agent, _lock
    _lock = threading.Lock()  # the parent may have held it while forking
    agent, _agent = _agent, None
    if agent is not None:
        try:
            agent.forget_after_fork()
        except BaseException:
            pass
