"""What a torch trace records: sampling, a module filter, backward spans, the anomaly check, the buffer size.

The same options come from ``PROBE_TORCH_TRACE_*`` variables (tracing from the first step) and from
``probe T trace start --every N --modules GLOB --backward --anomalies`` (a JSON body). Stdlib only.
"""

import os
from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, Mapping, Optional

from probe.errors import BadRequest

__all__ = ["TraceOptions", "DEFAULT_SIZE", "MAX_SIZE"]

DEFAULT_SIZE = 10_000
"""Spans held by default: 1.3 MB of preallocated arrays; 500 steps of a 20-module model, forward only."""
MAX_SIZE = 5_000_000

_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class TraceOptions:
    every: int = 1
    """Trace one step in ``every`` (steps whose number is a multiple of it); the others cost nothing."""
    modules: str = "*"
    """A glob over module names (``encoder.*``, ``*attn*``); modules that do not match are not recorded."""
    backward: bool = False
    """Also time each module's backward, through autograd graph hooks (not module backward hooks)."""
    anomalies: bool = False
    """Check every traced output (and, with ``backward``, every input gradient) for NaN and Inf."""
    size: int = DEFAULT_SIZE
    """Spans the ring buffer holds; the oldest are dropped first."""

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise BadRequest("every must be a whole number >= 1, got %r" % (self.every,))
        if not isinstance(self.modules, str) or not self.modules.strip() or len(self.modules) > 1000:
            raise BadRequest("modules must be a glob such as 'encoder.*', got %r" % (self.modules,))
        if isinstance(self.size, bool) or not isinstance(self.size, int) or not 100 <= self.size <= MAX_SIZE:
            raise BadRequest("size must be a whole number of spans from 100 to %d, got %r" % (MAX_SIZE, self.size))
        for name in ("backward", "anomalies"):
            if not isinstance(getattr(self, name), bool):
                raise BadRequest("%s must be true or false" % name)

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "TraceOptions":
        env = os.environ if environ is None else environ
        values: Dict[str, Any] = {}
        try:
            if env.get("PROBE_TORCH_TRACE_EVERY"):
                values["every"] = int(env["PROBE_TORCH_TRACE_EVERY"])
            if env.get("PROBE_TORCH_TRACE_SIZE"):
                values["size"] = int(env["PROBE_TORCH_TRACE_SIZE"])
        except ValueError as exc:
            raise BadRequest("PROBE_TORCH_TRACE_EVERY and PROBE_TORCH_TRACE_SIZE take whole numbers: %s" % exc)
        if env.get("PROBE_TORCH_TRACE_MODULES"):
            values["modules"] = env["PROBE_TORCH_TRACE_MODULES"]
        for key, name in (("PROBE_TORCH_TRACE_BACKWARD", "backward"), ("PROBE_TORCH_TRACE_ANOMALIES", "anomalies")):
            if key in env:
                values[name] = env[key].strip().lower() not in _FALSE
        return cls(**values)

    @classmethod
    def from_request(cls, body: Mapping[str, Any]) -> "TraceOptions":
        """Options of ``POST /v1/torch/trace``; absent ones take their defaults, unknown ones are refused."""
        known = set(asdict(cls()))
        unknown = sorted(k for k in body if k not in known and k != "action")
        if unknown:
            raise BadRequest("unknown trace options: %s" % ", ".join(unknown)[:200],
                             hint="known: %s" % ", ".join(sorted(known)))
        return cls(**{k: v for k, v in body.items() if k in known and v is not None})

    def with_changes(self, **changes: Any) -> "TraceOptions":
        return replace(self, **changes)

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)
