"""One rooted hierarchy for every error probe reports.

Errors from sockets, DuckDB, gdb and HTTP are translated into these where they enter probe. Each class
has a stable wire ``code`` (sent in the JSON error envelope), an HTTP ``status`` and a CLI ``exit_code``;
an instance may carry a ``hint`` that tells the user what to do next. Code decides on the class or the
code, never on message text. Stdlib only: the agent imports this inside the target.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is for the checker alone: ``probe PID backtrace`` imports this (probe.cli.quick)
    from typing import Dict, Optional, Type

__all__ = [
    "ProbeError", "BadRequest", "SQLError", "SQLUnavailable", "EvalError", "EvalDisabled", "Unauthorized", "Forbidden",
    "Timeout", "TooLarge", "Busy", "InternalError", "NotFound", "ConnectError", "ConnectionRefused", "UsageError",
    "InjectError",
    "AgentBlocked", "ProcessDead", "ReaderError", "TorchNotLoaded", "error_from_code",
]


class ProbeError(Exception):
    """Base of every probe error."""

    code = "internal"
    status = 500
    exit_code = 1

    def __init__(self, message: str, hint: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if self.hint:
            return "%s (%s)" % (self.message, self.hint)
        return self.message

    def to_envelope(self) -> Dict[str, object]:
        """The JSON error body sent over the wire."""
        body: Dict[str, object] = {"code": self.code, "message": self.message}
        if self.hint:
            body["hint"] = self.hint
        return {"error": body}


class BadRequest(ProbeError):
    code, status, exit_code = "bad_request", 400, 2


class SQLError(ProbeError):
    code, status, exit_code = "sql_error", 400, 1


class SQLUnavailable(SQLError):
    """The agent's process cannot import DuckDB or pyarrow; the client runs such queries itself."""

    code, status, exit_code = "sql_unavailable", 501, 1


class EvalError(ProbeError):
    code, status, exit_code = "eval_error", 400, 1


class Unauthorized(ProbeError):
    code, status, exit_code = "unauthorized", 401, 4


class Forbidden(ProbeError):
    code, status, exit_code = "forbidden", 403, 4


class EvalDisabled(Forbidden):
    """eval was switched off in this agent (``--no-eval`` / ``PROBE_EVAL=0``)."""


class NotFound(ProbeError):
    code, status, exit_code = "not_found", 404, 2


class Timeout(ProbeError):
    code, status, exit_code = "timeout", 504, 5


class TooLarge(ProbeError):
    code, status, exit_code = "too_large", 413, 2


class Busy(ProbeError):
    """Every connection slot of the agent is taken by requests in progress."""

    code, status, exit_code = "busy", 503, 5


class InternalError(ProbeError):
    code, status, exit_code = "internal", 500, 1


class TorchNotLoaded(ProbeError):
    """A torch.* table or the checkpoint was asked of a process that has not imported torch (probe never does)."""

    code, status, exit_code = "torch_not_loaded", 409, 2


class ConnectError(ProbeError):
    """No agent answers at the target (client side only)."""

    code, status, exit_code = "connect_error", 503, 3


class ConnectionRefused(ConnectError):
    """Nothing listens at the target's address (client side only): the CLI says how a job comes to serve there."""


class UsageError(ProbeError):
    """The command line or API call itself is wrong (client side only)."""

    code, status, exit_code = "usage", 400, 2


class InjectError(ProbeError):
    """The injector could not start an agent in the target (client side only)."""

    code, status, exit_code = "inject_error", 500, 6


class AgentBlocked(ProbeError):
    """The agent cannot run Python now (a C call holds the GIL, the process is stopped), so what needs
    the agent is refused at once rather than after a long wait (client side only)."""

    code, status, exit_code = "agent_blocked", 503, 5


class ProcessDead(ConnectError):
    """The target process is dead or is a core file: nothing runs there to answer (client side only)."""

    code, status, exit_code = "process_dead", 503, 3


class ReaderError(ProbeError):
    """Reading the stacks from outside the process failed: permission, no reader installed, not a
    Python process, an unreadable core file (client side only)."""

    code, status, exit_code = "reader_error", 500, 3


_BY_CODE: Dict[str, Type[ProbeError]] = {
    cls.code: cls
    for cls in (BadRequest, SQLError, SQLUnavailable, EvalError, Unauthorized, Forbidden, NotFound, Timeout, TooLarge,
                Busy, InternalError, TorchNotLoaded)
}


def error_from_code(code: str, message: str, hint: Optional[str] = None) -> ProbeError:
    """Rebuild the typed error that an agent sent as ``{"code": ..., "message": ...}``."""
    return _BY_CODE.get(code, InternalError)(message, hint)
