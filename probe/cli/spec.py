"""The options and arguments of a command, declared once as plain data that imports no click.

Both readers of a command line are built from these declarations: ``probe.cli.options.with_params`` makes
the click options (help, completion, every command line), and ``probe.cli.fast`` the parser that runs the
commands people run in loops without importing click (about 20 ms of every command). An option added to
a command's ``PARAMS`` is therefore read by both, with the same name, default and conversion.

A value's kind says how it is read: ``FLAG`` (no value), ``STRING``, ``PATH`` (a file, not a directory),
``choice(...)``, ``seconds(minimum)``, ``count(minimum)``, ``converted(function, words)``, and ``ARGUMENT``
for a positional one. ``fast=False`` leaves a command line that gives the option to click (the options
across ranks and the TLS ones, whose work the fast path does not do).
"""

import math
from typing import Any, Callable, List, Optional, Sequence, Tuple

__all__ = ["Param", "FLAG", "STRING", "PATH", "ARGUMENT", "UNSET", "choice", "seconds", "count", "converted",
           "output_params", "GLOBAL_PARAMS", "MAX_SECONDS", "TEXT_FORMATS", "TABLE_FORMATS", "read_seconds"]

MAX_SECONDS = 1e6
"""The longest time limit or wait an option takes (11.6 days); longer ones only overflow the clocks."""

TEXT_FORMATS = ("text", "json")
TABLE_FORMATS = ("table", "json", "csv")

Kind = Tuple[Any, ...]
FLAG: Kind = ("flag",)
STRING: Kind = ("text",)
PATH: Kind = ("path",)
ARGUMENT: Kind = ("argument",)


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()
"""No default given: click's own (None for a value, False for a flag)."""


def choice(*choices: str) -> Kind:
    return ("choice", choices)


def seconds(minimum: float, maximum: float = MAX_SECONDS) -> Kind:
    """A finite number of seconds from ``minimum`` to ``maximum`` (``probe.cli.options.Seconds``)."""
    return ("seconds", minimum, maximum)


def count(minimum: int) -> Kind:
    """A whole number, ``minimum`` or more (click.IntRange)."""
    return ("count", minimum)


def converted(convert: Callable[[str], Any], words: str) -> Kind:
    """A value that ``convert`` reads (ValueError where it cannot); ``words % value`` says why not."""
    return ("converted", convert, words)


class Param:
    """One option (``decls``: its spellings) or positional argument of a command, and the keyword ``dest``
    its value is passed as. A plain class: ``dataclasses`` would cost every command's start-up ~5 ms."""

    __slots__ = ("decls", "dest", "kind", "help", "metavar", "hidden", "default", "envvar", "multiple",
                 "show_default", "fast")

    def __init__(self, *decls: str, dest: str, kind: Kind = FLAG, help: Optional[str] = None,
                 metavar: Optional[str] = None, hidden: bool = False, default: Any = UNSET,
                 envvar: Optional[str] = None, multiple: bool = False, show_default: bool = False,
                 fast: bool = True) -> None:
        self.decls, self.dest, self.kind, self.help, self.metavar = decls, dest, kind, help, metavar
        self.hidden, self.default, self.envvar, self.multiple = hidden, default, envvar, multiple
        self.show_default, self.fast = show_default, fast

    def __repr__(self) -> str:
        return "Param(%s -> %s)" % ("/".join(self.decls), self.dest)

    def fast_default(self) -> Any:
        """The value the command receives where the option is not given (as click gives it)."""
        if self.default is not UNSET:
            return self.default
        if self.multiple:
            return ()
        return False if self.kind is FLAG else None


def read_seconds(text: str, minimum: float, maximum: float = MAX_SECONDS) -> float:
    """A number of seconds within bounds; ValueError for anything else (``inf``, ``nan``, ``1e309``)."""
    number = float(text)
    if not math.isfinite(number) or not minimum <= number <= maximum:
        raise ValueError(text)
    return number


def output_params(*formats: str, json_help: str = "", older_f: bool = False) -> List[Param]:
    """``--json`` and ``-F/--format`` (``formats``, the first the default), given to the command as ``as_json``
    and ``fmt_given``; ``older_f``: ``-f FORMAT`` too (hidden: the spelling ``query`` and ``ranks`` had
    before), as ``fmt_older``. ``probe.cli.output.chosen_format`` makes the one ``fmt`` of them."""
    exact = " and ".join(f for f in formats if f in ("json", "csv"))
    params = [Param("--json", dest="as_json", help="The same as -F json%s." % ("; " + json_help if json_help else ""))]
    if older_f:
        params.append(Param("-f", dest="fmt_older", kind=choice(*formats), default=None, hidden=True))
    params.append(Param("-F", "--format", dest="fmt_given", kind=choice(*formats), default=None,
                        help="How to print the result: %s (default %s). %s keep%s what the target sent exactly, "
                             "for scripts; %s shows its control characters as escapes (ESC as \\x1b)."
                             % (", ".join(formats), formats[0], exact, "" if " and " in exact else "s", formats[0])))
    return params


def _global_params() -> Sequence[Param]:
    tls = "Speak TLS to TCP targets and helpers, trusting the certificates this CA signed (or $PROBE_CACERT)."
    return (
        Param("-t", "--target", dest="targets", kind=STRING, multiple=True, metavar="TARGET",
              help="A pid, HOST:PORT, unix:PATH or core:PATH (repeatable). Default: $PROBE_TARGET."),
        Param("--token", dest="token", kind=STRING, envvar="PROBE_TOKEN", help="Token for TCP targets (or $PROBE_TOKEN)."),
        Param("--token-file", dest="token_file", kind=PATH, envvar="PROBE_TOKEN_FILE",
              help="File holding the token for TCP targets (or $PROBE_TOKEN_FILE)."),
        Param("--timeout", dest="timeout", kind=seconds(0.01), default=None,
              help="Seconds to wait for each target's answer, a long query's or snippet's too; inject's time "
                   "limit. Default: 30, or a query's or snippet's own time limit and 5 s more."),
        Param("--wait", dest="wait", kind=seconds(0.0), default=None,
              help="Wait this long for a local agent before reading the process from outside. "
                   "Default: decide in about a second whether it can answer (GIL held, stopped)."),
        Param("--executable", dest="executable", kind=PATH, metavar="PATH",
              help="For a core:PATH target: the Python executable that made the core (default: as the core says)."),
        Param("--all-ranks", dest="all_ranks", fast=False,
              help="Every rank of the job whose master is TARGET (HOST:PROBE_PORT, under any launcher; or "
                   "slurm:JOBID[:PORT]), at once; answers grouped."),
        Param("--ranks", dest="ranks", kind=STRING, metavar="LIST", fast=False,
              help="Only these ranks, e.g. 0-3,8 (implies --all-ranks)."),
        Param("--hosts", dest="hosts", kind=PATH, metavar="FILE", fast=False,
              help="Every target listed in FILE (one per line), at once, numbered by the ranks they say they are "
                   "(else by line: 0, 1, ...)."),
        Param("--deadline", dest="deadline", kind=seconds(0.01), fast=False,
              help="Across ranks: answer with what arrived after this long (default 10, at most --timeout); "
                   "several -t: none unless given."),
        Param("--max-in-flight", dest="max_in_flight", kind=count(1), default=32, show_default=True, fast=False,
              help="Across ranks: requests in flight at once; one unanswered after 0.25 s stops counting "
                   "(up to 512 open)."),
        Param("--via", dest="via", kind=choice("auto", "helpers", "direct"), default="auto", show_default=True,
              envvar="PROBE_VIA",
              help="Across ranks: ask each node's helper once, which asks its ranks (helpers), or "
                   "every rank from here (direct); auto: through the helpers past 1024 ranks."),
        Param("--cacert", dest="cacert", kind=PATH, envvar="PROBE_CACERT", metavar="PEM", fast=False, help=tls),
        Param("--cert", dest="cert", kind=PATH, envvar="PROBE_CERT", metavar="PEM", fast=False,
              help="Client certificate for agents that ask for one (mutual TLS; or $PROBE_CERT)."),
        Param("--key", dest="key", kind=PATH, envvar="PROBE_KEY", metavar="PEM", fast=False,
              help="The client certificate's key, where not in its file (or $PROBE_KEY)."),
    )


GLOBAL_PARAMS: Sequence[Param] = _global_params()
"""The ``probe`` group's own options (``probe.cli.group``), before the command. A command line that gives
a ``fast=False`` one, or an environment that sets its variable, is left to click."""
