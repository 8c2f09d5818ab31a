"""The commands people run in loops, started without click.

``probe PID backtrace`` races py-spy, and importing click takes longer than the rest of the command's own
imports: about 20 ms on a small machine, before any work. So the plain command lines of ``backtrace``,
``query``, ``health``, ``list`` and ``ranks`` are read here and run by each command's click-free ``run``,
with the ``CliContext`` the click group would have made. Plain means: the global options ``--target``/``-t``,
``--timeout``, ``--wait``, ``--token``, ``--token-file`` and ``--executable`` (each followed by its value), and
the command's own flags and formats below. Anything else (help, ``--version``, the options across ranks, an
option written ``--opt=value``, a value click would refuse, an option not listed here) is left to click:
:func:`run` returns None, and the command runs as it always did, with click's words for any error. A
command line read here runs exactly as through click (tests compare both, byte for byte).

``PROBE_CLI_FAST=0`` in the environment sends every command line to click.
"""

import math
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

from probe.cli.app import COMMANDS

__all__ = ["run", "ran"]

ran = False
"""True once :func:`run` took a command line (the command may have failed since): ``probe.cli.main`` then
exits without the interpreter's teardown."""

_TEXT = ("text", "json")
_TABLE = ("table", "json", "csv")

_Spec = Tuple[Dict[str, str], Dict[str, Tuple[str, Callable[[str], Any]]], Dict[str, Any], bool]
"""(flags: option -> keyword, valued options: option -> (keyword, conversion), defaults, takes SQL)."""


def _choice(*choices: str) -> Callable[[str], Any]:
    def convert(value: str) -> Any:
        if value not in choices:
            raise ValueError(value)
        return value
    return convert


def _seconds(minimum: float) -> Callable[[str], float]:
    """As ``probe.cli.options.Seconds(minimum)`` accepts (the rest is left to it, and its words)."""
    def convert(value: str) -> float:
        number = float(value)
        if not math.isfinite(number) or not minimum <= number <= 1e6:
            raise ValueError(value)
        return number
    return convert


def _count(value: str) -> int:
    number = int(value)  # as click.IntRange(min=0)
    if number < 0:
        raise ValueError(value)
    return number


def _memory(value: str) -> int:
    """As ``query --max-memory`` takes it (``probe.cli.commands.query.memory_size``)."""
    from probe.cli.commands.query import memory_size

    return memory_size(value)


def _formats(choices: Tuple[str, ...], older_f: bool) -> Dict[str, Tuple[str, Callable[[str], Any]]]:
    out = {"-F": ("fmt_given", _choice(*choices)), "--format": ("fmt_given", _choice(*choices))}
    if older_f:
        out["-f"] = ("fmt_older", _choice(*choices))
    return out


_COMMANDS: Dict[str, _Spec] = {
    "backtrace": ({"--json": "as_json", "--native": "native"}, _formats(_TEXT, False), {"native": False}, False),
    "health": ({"--json": "as_json"}, _formats(_TEXT, False), {}, False),
    "ranks": ({"--json": "as_json"}, _formats(_TABLE, True), {}, False),
    "list": ({"--json": "as_json", "--agents-only": "agents_only", "-x": "vertical", "--vertical": "vertical",
              "--wide": "wide", "--all": "show_all"},
             _formats(("table", "json"), False),
             {"agents_only": False, "vertical": False, "wide": False, "show_all": False}, False),
    "query": ({"--json": "as_json", "-x": "vertical", "--vertical": "vertical", "--wide": "wide",
               "--native": "native"},
              dict(_formats(_TABLE, True), **{"--max-rows": ("max_rows", _count),
                                             "--query-timeout": ("query_timeout", _seconds(0.001)),
                                             "--max-memory": ("max_memory", _memory)}),
              {"vertical": False, "wide": False, "native": False, "max_rows": None, "query_timeout": None,
               "max_memory": None}, True),
}
"""Each command's options read here: what click declares for it in its module, less what is left to click."""

_GLOBAL: Dict[str, Tuple[str, Callable[[str], Any]]] = {
    "--target": ("targets", str), "-t": ("targets", str), "--timeout": ("timeout", _seconds(0.01)),
    "--wait": ("wait", _seconds(0.0)), "--token": ("token", str), "--token-file": ("token_file", str),
    "--executable": ("executable", str),
}


def run(args: List[str]) -> Optional[int]:
    """Run the command line ``args`` (as ``normalise_argv`` gave it) without click, and return its exit code;
    None, having done nothing, where click must read it."""
    if os.environ.get("PROBE_CLI_FAST") == "0":
        return None
    parsed = _parse(args)
    if parsed is None:
        return None
    name, options, kwargs = parsed
    global ran
    ran = True
    from probe.cli.context import CliContext
    from probe.cli.output import chosen_format
    from probe.client.wording import use_cli_words

    use_cli_words()  # as the click group does
    cli = CliContext(options["targets"], options["token"], options["token_file"], options["timeout"],
                     wait=options["wait"], executable=options["executable"])
    cli.via = options["via"]
    cli.timeout_given = options["timeout"] is not None
    if options["timeout"] is None:
        cli.timeout = 30.0
    kwargs["fmt"] = chosen_format(kwargs.pop("fmt_given", None), kwargs.pop("fmt_older", None),
                                  kwargs.pop("as_json", False))
    import importlib

    module = importlib.import_module("probe.cli.commands." + COMMANDS[name][0])
    if name == "list":
        module.run(**kwargs)
    else:
        module.run(cli, **kwargs)
    return cli.exit_code


def _parse(args: List[str]) -> Optional[Tuple[str, Dict[str, Any], Dict[str, Any]]]:
    """(command, global options, the command's keyword arguments), or None where click must read ``args``."""
    options: Dict[str, Any] = {"targets": [], "token": None, "token_file": None, "timeout": None, "wait": None,
                               "executable": None}
    i = 0
    while i < len(args) and args[i] not in _COMMANDS:
        if args[i] not in _GLOBAL or i + 1 >= len(args):
            return None
        key, convert = _GLOBAL[args[i]]
        value = _value(args[i + 1], convert)
        if value is None:
            return None
        if key == "targets":
            options[key].append(value)
        else:
            options[key] = value
        i += 2
    if i >= len(args):
        return None
    name = args[i]
    if not _environment(options):
        return None
    flags, valued, defaults, takes_sql = _COMMANDS[name]
    kwargs = dict(defaults)
    sql: List[str] = []
    rest = args[i + 1:]
    j = 0
    while j < len(rest):
        arg = rest[j]
        if arg in flags:
            kwargs[flags[arg]] = True
            j += 1
        elif arg in valued and j + 1 < len(rest):
            key, convert = valued[arg]
            value = _value(rest[j + 1], convert)
            if value is None:
                return None
            kwargs[key] = value
            j += 2
        elif takes_sql and not arg.startswith("-"):
            sql.append(arg)
            j += 1
        else:  # help, an option written --opt=value, one left to click, a word where none is taken
            return None
    if takes_sql:
        if len(sql) != 1:
            return None
        kwargs["sql"] = sql[0]
    return name, options, kwargs


def _value(text: str, convert: Callable[[str], Any]) -> Any:
    """An option's value as click would read it, or None where click must say what is wrong with it."""
    if text.startswith("-"):  # click may read it as a value or as an option: left to it
        return None
    try:
        return convert(text)
    except ValueError:
        return None


_LEFT_TO_CLICK_ENV = ("PROBE_CACERT", "PROBE_CERT", "PROBE_KEY")
"""Variables of global options not read here (TLS): where one is set, click reads the command line."""


def _environment(options: Dict[str, Any]) -> bool:
    """The global options click reads from the environment, as it reads them; False where click must."""
    if any(os.environ.get(variable) for variable in _LEFT_TO_CLICK_ENV):
        return False
    for key, variable in (("token", "PROBE_TOKEN"), ("token_file", "PROBE_TOKEN_FILE")):
        if options[key] is None and os.environ.get(variable):  # click takes an empty variable as unset
            options[key] = os.environ[variable]
    for key in ("token_file", "executable"):  # click.Path(dir_okay=False) refuses a directory
        if options[key] is not None and os.path.isdir(options[key]):
            return False
    via = os.environ.get("PROBE_VIA") or "auto"
    if via not in ("auto", "helpers", "direct"):
        return False
    options["via"] = via
    return True
