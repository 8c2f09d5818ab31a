"""Options that several commands share, defined once: how output is printed, and a number of seconds; and
the click options of a command made from its declaration (``probe.cli.spec``).

One output convention for every command that prints a result: ``--json`` is short for ``-F json``, and
``-F/--format FORMAT`` names the format (``text`` or ``json``; ``query`` and ``ranks``: ``table``, ``json``
or ``csv``). ``-f FORMAT``, the older spelling of ``query`` and ``ranks``, still works there; ``eval -f
FILE`` reads the snippet from a file, as it always did.
"""

import functools
import math
from typing import Any, Callable, Optional, Sequence

import click

from probe.cli.output import chosen_format
from probe.cli.spec import (ARGUMENT, FLAG, MAX_SECONDS, PATH, STRING, TABLE_FORMATS, TEXT_FORMATS, UNSET, Param,
                            output_params)

__all__ = ["Seconds", "MAX_SECONDS", "output_format", "with_params", "TEXT", "TABLE"]

TEXT = TEXT_FORMATS
TABLE = TABLE_FORMATS


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


def with_params(params: Sequence[Param]) -> Callable[[Callable[..., Any]], Any]:
    """Give a command the click options and arguments ``params`` declare, in their order (help lists them
    so). Where they hold the output options (``output_params``) the command receives ``fmt`` instead."""
    def decorate(command: Callable[..., Any]) -> Any:
        run = _given_fmt(command) if any(p.dest == "fmt_given" for p in params) else command
        for param in reversed(params):  # click lists a command's parameters in the reverse of their decoration
            run = _click_param(param)(run)
        return run
    return decorate


def _given_fmt(command: Callable[..., Any]) -> Callable[..., Any]:
    """``command`` called with ``fmt``, the one format that ``-F``, ``-f`` and ``--json`` asked for."""
    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        kwargs["fmt"] = chosen_format(kwargs.pop("fmt_given"), kwargs.pop("fmt_older", None), kwargs.pop("as_json"))
        return command(*args, **kwargs)
    return run


def output_format(*formats: str, json_help: str = "", older_f: bool = False) -> Callable[[Callable[..., Any]], Any]:
    """Give a command ``--json`` and ``-F/--format`` (``formats``, the first the default); the command
    receives ``fmt``: the format asked for, or None when none was. ``older_f``: ``-f FORMAT`` works too
    (hidden: the spelling ``query`` and ``ranks`` had before)."""
    return with_params(output_params(*formats, json_help=json_help, older_f=older_f))


def _click_param(param: Param) -> Callable[[Callable[..., Any]], Any]:
    """The click decorator that declares ``param``."""
    if param.kind is ARGUMENT:
        return click.argument(param.dest)
    kwargs: dict = {}
    for name in ("help", "metavar", "envvar"):
        if getattr(param, name) is not None:
            kwargs[name] = getattr(param, name)
    for name in ("hidden", "multiple", "show_default"):
        if getattr(param, name):
            kwargs[name] = True
    if param.default is not UNSET:
        kwargs["default"] = param.default
    kind = param.kind[0]
    if param.kind is FLAG:
        kwargs["is_flag"] = True
    elif param.kind is PATH:
        kwargs["type"] = click.Path(dir_okay=False)
    elif kind == "choice":
        kwargs["type"] = click.Choice(param.kind[1])
    elif kind == "seconds":
        kwargs["type"] = Seconds(param.kind[1], param.kind[2])
    elif kind == "count":
        kwargs["type"] = click.IntRange(min=param.kind[1])
    elif kind == "converted":
        kwargs["callback"] = _converting(param.kind[1], param.kind[2])
    elif param.kind is not STRING:
        raise ValueError("%r: no click type for %r" % (param, param.kind))
    return click.option(*param.decls, param.dest, **kwargs)


def _converting(convert: Callable[[str], Any], words: str) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """A click callback that reads an option's value with ``convert``, in ``words`` where it cannot."""
    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is None:
            return None
        try:
            return convert(value)
        except ValueError:
            raise click.BadParameter(words % (value,)) from None
    return callback
