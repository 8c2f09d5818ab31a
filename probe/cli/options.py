"""Options that several commands share, defined once: how output is printed, and a number of seconds.

One output convention for every command that prints a result: ``--json`` is short for ``-F json``, and
``-F/--format FORMAT`` names the format (``text`` or ``json``; ``query`` and ``ranks``: ``table``, ``json``
or ``csv``). ``-f FORMAT``, the older spelling of ``query`` and ``ranks``, still works there; ``eval -f
FILE`` reads the snippet from a file, as it always did.
"""

import functools
import math
from typing import Any, Callable, Optional

import click

from probe.cli.output import chosen_format

__all__ = ["Seconds", "MAX_SECONDS", "output_format", "TEXT", "TABLE"]

MAX_SECONDS = 1e6
"""The longest time limit or wait an option takes (11.6 days); longer ones only overflow the clocks below."""

TEXT = ("text", "json")
TABLE = ("table", "json", "csv")


class Seconds(click.ParamType):
    """A finite number of seconds within bounds: ``inf``, ``nan`` and ``1e309`` are refused by name, not
    carried to a socket timeout that cannot hold them."""

    name = "seconds"

    def __init__(self, minimum: float, maximum: float = MAX_SECONDS) -> None:
        self.minimum, self.maximum = minimum, maximum

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail("%r is not a number of seconds" % (value,), param, ctx)
        if not math.isfinite(number) or not self.minimum <= number <= self.maximum:
            self.fail("%s is not a number of seconds from %g to %d" % (value, self.minimum, self.maximum), param, ctx)
        return number

    def get_metavar(self, param: click.Parameter, ctx: Optional[click.Context] = None) -> str:
        return "SECONDS"


def output_format(*formats: str, json_help: str = "", older_f: bool = False) -> Callable[[Callable[..., Any]], Any]:
    """Give a command ``--json`` and ``-F/--format`` (``formats``, the first the default); the command
    receives ``fmt``: the format asked for, or None when none was. ``older_f``: ``-f FORMAT`` works too
    (hidden: the spelling ``query`` and ``ranks`` had before)."""
    def decorate(command: Callable[..., Any]) -> Any:
        @functools.wraps(command)
        def run(*args: Any, **kwargs: Any) -> Any:
            kwargs["fmt"] = chosen_format(kwargs.pop("fmt_given"), kwargs.pop("fmt_older", None), kwargs.pop("as_json"))
            return command(*args, **kwargs)

        exact = " and ".join(f for f in formats if f in ("json", "csv"))
        run = click.option("-F", "--format", "fmt_given", type=click.Choice(formats), default=None,
                           help="How to print the result: %s (default %s). %s keep%s what the target sent "
                                "exactly, for scripts; %s shows its control characters as escapes (ESC as \\x1b)."
                                % (", ".join(formats), formats[0], exact, "" if " and " in exact else "s",
                                   formats[0]))(run)
        if older_f:
            run = click.option("-f", "fmt_older", type=click.Choice(formats), default=None, hidden=True)(run)
        return click.option("--json", "as_json", is_flag=True,
                            help="The same as -F json%s." % ("; " + json_help if json_help else ""))(run)
    return decorate
