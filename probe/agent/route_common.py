"""What the agent's route modules share: the agent as a route sees it, the bounds on what a request may
ask, and the reading of a request's optional numbers.

A route knows the agent only as ``ServingAgent`` (``probe.agent.agent.Agent`` is one): the agent imports
its routes (``probe.agent.routes.Dispatcher``), never the other way round.
"""

import json
import math
from typing import Any, Callable, Dict, Optional, Protocol

from probe.agent.budget import ResultBudget
from probe.agent.http import Request, Response
from probe.agent.limits import Ceilings
from probe.agent.options import AgentOptions
from probe.errors import BadRequest

__all__ = ["ServingAgent", "Route", "result_budget", "request_ceilings", "optional_count", "optional_seconds",
           "optional_id"]


class ServingAgent(Protocol):
    """What a route reads of the agent that serves it."""

    options: AgentOptions
    started_at: float
    unix_path: Optional[str]
    tcp_address: Optional[str]
    credentials: Any

    def authorize(self, request: Request) -> Any: ...

    def sql_available(self) -> bool: ...

    def sql_here(self) -> bool: ...

    def hold_engine(self) -> Any: ...

    def let_go_engine(self) -> None: ...


Route = Callable[[ServingAgent, Request], Response]

_results: Optional[ResultBudget] = None


def result_budget(agent: ServingAgent) -> ResultBudget:
    """Bytes of results held at once, across requests: four results at the agent's bound."""
    global _results
    if _results is None:
        _results = ResultBudget(4 * agent.options.max_result_bytes)
    return _results


_ceilings_now: Optional[Ceilings] = None


def request_ceilings() -> Ceilings:
    """How far a request may raise the agent's limits (see probe.agent.limits), read once."""
    global _ceilings_now
    if _ceilings_now is None:
        _ceilings_now = Ceilings.from_env()
    return _ceilings_now


def optional_count(body: Dict[str, Any], key: str) -> Optional[int]:
    """A whole number >= 0, or None when absent; anything else is a 400."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest("%s must be a whole number >= 0, got %s" % (key, json.dumps(value)[:40]))
    return value


def optional_seconds(body: Dict[str, Any], key: str) -> Optional[float]:
    """A finite number of seconds > 0, or None when absent; the agent's own limit still caps it."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise BadRequest("%s must be a number of seconds > 0, got %s" % (key, json.dumps(value)[:40]))
    return float(value)


def optional_id(body: Dict[str, Any]) -> Optional[str]:
    """A request's own name (for a later interrupt): up to 64 letters, digits, '-' or '_'."""
    value = body.get("id")
    if value is None:
        return None
    if not isinstance(value, str) or not (0 < len(value) <= 64) or not value.replace("-", "").replace("_", "").isalnum():
        raise BadRequest("id must be 1 to 64 letters, digits, '-' or '_'")
    return value
