"""The limits a client may ask for: up to a ceiling that the target's owner sets, never silently past it.

A query runs ``PROBE_QUERY_TIMEOUT`` seconds and returns ``PROBE_MAX_ROWS`` rows unless the request asks
for other values (``--query-timeout``, ``--max-rows``, ``--eval-timeout``); a request may raise them up
to the ceilings below and lower them freely. Past a ceiling the request is refused with the ceiling
named, so that every hint the client prints can work. The ceilings bound what one client can take from
the target (a DuckDB thread and a work slot for a query, a thread for a snippet); rows are bounded in
bytes anyway (``PROBE_MAX_RESULT_BYTES``). Stdlib only.
"""

import os
from typing import Mapping, NamedTuple, Optional

from probe.errors import BadRequest

__all__ = ["Ceilings", "within", "EVAL_OUTPUT"]

EVAL_OUTPUT = 1 << 20
"""Characters of stdout and of stderr one snippet keeps (``PROBE_EVAL_OUTPUT``); the rest is counted."""


class Ceilings(NamedTuple):
    query_timeout: float = 60.0
    eval_timeout: float = 300.0
    max_rows: int = 1_000_000
    eval_output: int = EVAL_OUTPUT

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "Ceilings":
        """``PROBE_QUERY_TIMEOUT_CEILING``, ``PROBE_EVAL_TIMEOUT_CEILING``, ``PROBE_MAX_ROWS_CEILING``,
        ``PROBE_EVAL_OUTPUT``; a value that does not parse keeps the default (the target must start)."""
        env = os.environ if environ is None else environ
        out = cls()
        for name, key, kind in (("PROBE_QUERY_TIMEOUT_CEILING", "query_timeout", float),
                                ("PROBE_EVAL_TIMEOUT_CEILING", "eval_timeout", float),
                                ("PROBE_MAX_ROWS_CEILING", "max_rows", int),
                                ("PROBE_EVAL_OUTPUT", "eval_output", int)):
            try:
                value = kind(env.get(name, "") or getattr(out, key))
            except ValueError:
                continue
            if value > 0:
                out = out._replace(**{key: value})  # type: ignore[arg-type]
        return out


def within(requested: Optional[float], default: float, ceiling: float, option: str, variable: str) -> float:
    """The limit to apply: ``requested`` when given and at most the ceiling (never below the default's),
    else the default. Above the ceiling the request is refused, naming it."""
    ceiling = max(ceiling, default)
    if requested is None:
        return default
    if requested > ceiling:
        raise BadRequest("%s %s is above this agent's ceiling of %s" % (option, _num(requested), _num(ceiling)),
                         hint="ask for at most %s; the target's owner sets the ceiling with %s in its environment"
                              % (_num(ceiling), variable))
    return requested


def _num(value: float) -> str:
    return "%d" % value if float(value).is_integer() else "%g" % value
