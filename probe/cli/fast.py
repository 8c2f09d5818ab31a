"""The commands people run in loops, started without click.

``probe PID backtrace`` races py-spy, and importing click takes longer than the rest of the command's own
imports: about 20 ms on a small machine, before any work. So the plain command lines of ``backtrace``,
``query``, ``health``, ``list`` and ``ranks`` are read here and run by each command's click-free ``run``,
with the ``CliContext`` the click group would have made.

What is read here is what click reads: the group's options and each command's are declared once
(``probe.cli.spec``: ``GLOBAL_PARAMS`` and the command module's ``PARAMS``), and both click and this parser
are made from those declarations. Plain means: every option written as its own word followed by its value,
each value one click would take. Anything else (help, ``--version``, the options across ranks and TLS, which
are declared ``fast=False``, an option written ``--opt=value``, a value click would refuse or might read as
an option) is left to click: :func:`run` returns None, and the command runs as it always did, with click's
words for any error. A command line read here runs exactly as through click (tests compare both, byte for
byte).

``PROBE_CLI_FAST=0`` in the environment sends every command line to click.
"""

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from probe.cli.app import _NO_TARGET, COMMANDS
from probe.cli.spec import ARGUMENT, FLAG, GLOBAL_PARAMS, PATH, STRING, Param, read_seconds

__all__ = ["run", "ran", "FAST", "parse"]

FAST = ("backtrace", "query", "health", "list", "ranks")
"""The commands read here: each module has ``PARAMS`` and a click-free ``run`` (``probe.cli.commands``)."""

ran = False
"""True once :func:`run` took a command line (the command may have failed since): ``probe.cli.main`` then
exits without the interpreter's teardown."""

_LEFT = object()
"""A value click must read (and, where it is wrong, say why in its words)."""


def run(args: List[str]) -> Optional[int]:
    """Run the command line ``args`` (as ``normalise_argv`` gave it) without click, and return its exit code;
    None, having done nothing, where click must read it."""
    if os.environ.get("PROBE_CLI_FAST") == "0":
        return None
    parsed = parse(args)
    if parsed is None:
        return None
    name, module, options, kwargs = parsed
    global ran
    ran = True
    from probe.cli.context import CliContext
    from probe.cli.output import chosen_format
    from probe.client.wording import use_cli_words

    use_cli_words()  # as the click group does
    cli = CliContext(list(options["targets"]), options["token"], options["token_file"], options["timeout"],
                     wait=options["wait"], executable=options["executable"])
    cli.via = options["via"]
    cli.timeout_given = options["timeout"] is not None
    if options["timeout"] is None:
        cli.timeout = 30.0
    kwargs["fmt"] = chosen_format(kwargs.pop("fmt_given", None), kwargs.pop("fmt_older", None),
                                  kwargs.pop("as_json", False))
    if name in _NO_TARGET:
        module.run(**kwargs)
    else:
        module.run(cli, **kwargs)
    return cli.exit_code


def parse(args: List[str]) -> Optional[Tuple[str, Any, Dict[str, Any], Dict[str, Any]]]:
    """(the command, its module, the group's options, the command's keyword arguments as click would pass them
    to it), or None where click must read ``args``."""
    i = 0
    given: Dict[str, Any] = {}
    while i < len(args) and args[i] not in FAST:
        i = _option(args, i, _GLOBAL, given)
        if i < 0:
            return None
    if i >= len(args):
        return None
    options = _environment(given)
    if options is None:
        return None
    import importlib

    module = importlib.import_module("probe.cli.commands." + COMMANDS[args[i]][0])
    params: Sequence[Param] = module.PARAMS
    spellings = _spellings(params)
    kwargs: Dict[str, Any] = {}
    words: List[str] = []
    rest = args[i + 1:]
    j = 0
    while j < len(rest):
        if rest[j] in spellings:
            j = _option(rest, j, spellings, kwargs)
            if j < 0:
                return None
        elif rest[j].startswith("-"):  # help, an option written --opt=value, one not declared: click's
            return None
        else:
            words.append(rest[j])
            j += 1
    arguments = [p.dest for p in params if p.kind is ARGUMENT]
    if len(words) != len(arguments):  # every argument of these commands is required, and one word each
        return None
    kwargs.update(zip(arguments, words))
    return args[i], module, _with_defaults(options, GLOBAL_PARAMS), _with_defaults(kwargs, params)


def _option(args: List[str], i: int, spellings: Dict[str, Param], into: Dict[str, Any]) -> int:
    """Read the option at ``args[i]`` (and its value) into ``into``; the index after it, or -1 where click
    must read the command line."""
    param = spellings.get(args[i])
    if param is None or not param.fast:
        return -1
    if param.kind is FLAG:
        into[param.dest] = True
        return i + 1
    if i + 1 >= len(args):
        return -1
    value = _value(param, args[i + 1])
    if value is _LEFT:
        return -1
    if param.multiple:
        into[param.dest] = into.get(param.dest, ()) + (value,)
    else:
        into[param.dest] = value
    return i + 2


def _value(param: Param, text: str) -> Any:
    """An option's value as click would read it, or ``_LEFT`` where click must say what is wrong with it."""
    if text.startswith("-"):  # click may read it as a value or as an option: left to it
        return _LEFT
    try:
        return _convert(param.kind, text)
    except ValueError:
        return _LEFT


def _convert(kind: Tuple[Any, ...], text: str) -> Any:
    """``text`` read as a value of ``kind`` (``probe.cli.spec``); ValueError where click would refuse it."""
    if kind is STRING:
        return text
    if kind is PATH:
        if os.path.isdir(text):  # click.Path(dir_okay=False) refuses a directory
            raise ValueError(text)
        return text
    if kind[0] == "choice":
        if text not in kind[1]:
            raise ValueError(text)
        return text
    if kind[0] == "seconds":
        return read_seconds(text, kind[1], kind[2])
    if kind[0] == "count":
        number = int(text)  # as click.IntRange(min=...)
        if number < kind[1]:
            raise ValueError(text)
        return number
    if kind[0] == "converted":
        return kind[1](text)
    raise ValueError("no reading of %r" % (kind,))


def _spellings(params: Sequence[Param]) -> Dict[str, Param]:
    return {decl: p for p in params if p.kind is not ARGUMENT for decl in p.decls}


_GLOBAL = _spellings(GLOBAL_PARAMS)


def _environment(given: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The group's options with those click reads from the environment, as it reads them; None where the
    environment holds what click must read (a variable of an option left to it, a value it refuses)."""
    options = dict(given)
    for param in GLOBAL_PARAMS:
        variable = param.envvar
        if variable is None or not os.environ.get(variable):  # click takes an empty variable as unset
            continue
        if not param.fast:
            return None
        if param.dest not in options:
            try:
                options[param.dest] = _convert(param.kind, os.environ[variable])
            except ValueError:
                return None
    return options


def _with_defaults(given: Dict[str, Any], params: Sequence[Param]) -> Dict[str, Any]:
    """``given`` and, for every parameter not given, the value click passes for it."""
    out = {p.dest: p.fast_default() for p in params if p.kind is not ARGUMENT}
    out.update(given)
    return out
