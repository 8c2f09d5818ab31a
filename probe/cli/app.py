"""The ``probe`` command line: ``probe [OPTIONS] [TARGET] COMMAND [ARGS]``.

Commands are registered in one explicit list below, by module, and imported only when invoked: the
command's start-up is part of every answer's latency (``probe PID backtrace`` races py-spy). A target
written before the command (``probe 4242 backtrace``) is the same as ``--target 4242``; ``-t`` may be
repeated to run against several targets at once.

This module imports no click: the list and the reading of a command line serve ``probe.cli.fast``, which
runs the commands people run in loops (backtrace, query, health, list, ranks) without click where their
command line is a plain one. ``cli``, the click group (global options, help, completion), is in
``probe.cli.group``, which is built on this list (and this module knows nothing of it).
"""

import re
from typing import Dict, List, Tuple

from probe.cli.spec import FLAG, GLOBAL_PARAMS

__all__ = ["COMMANDS", "normalise_argv"]

#: name -> (module under probe.cli.commands, attribute): the whole command set, in help order.
COMMANDS: Dict[str, Tuple[str, str]] = {
    "list": ("list_", "list_"),
    "backtrace": ("backtrace", "backtrace"),
    "query": ("query", "query"),
    "eval": ("eval_", "eval_"),
    "repl": ("repl", "repl"),
    "debug": ("debug", "debug"),
    "tables": ("tables", "tables"),
    "schema": ("tables", "schema"),
    "health": ("health", "health"),
    "inject": ("inject", "inject"),
    "checkpoint": ("checkpoint", "checkpoint"),
    "lr": ("lr", "lr"),
    "ranks": ("ranks", "ranks"),
    "trace": ("trace", "trace"),
    "profile": ("profile", "profile"),
    "diagnose": ("diagnose", "diagnose"),
    "snapshot": ("snapshot", "snapshot"),
    "snapshots": ("snapshots", "snapshots"),
    "audit": ("audit", "audit"),
    "page": ("page", "page"),
    "mcp": ("mcp", "mcp"),
}
_GLOBAL_WITH_VALUE = {decl for p in GLOBAL_PARAMS if p.kind is not FLAG for decl in p.decls}
_NO_TARGET = {"list", "snapshots"}
"""Commands that take no target; every other one is ``probe TARGET COMMAND ...``."""
_NO_ARGS = {"backtrace", "repl", "debug", "tables", "health", "inject", "diagnose", "snapshot"}
"""Commands without positional arguments: a target written after them is understood as one."""
_LOOKS_LIKE_TARGET = re.compile(r"\d+|(?:unix|core):.+|\[?[\w.\-:]+\]?:\d+")


def normalise_argv(argv: List[str]) -> List[str]:
    """Turn ``probe 4242 backtrace`` into ``probe --target 4242 backtrace`` (also after global options).

    A target written after the command is understood too: ``-t X`` / ``--target X`` anywhere before a
    ``--``, and ``probe inject 4242`` (a word that looks like a target, after a command that takes no
    other argument, or followed by the command's own argument: ``probe query 4242 "SELECT 1"``)."""
    out = list(argv)
    i = 0
    while i < len(out):
        arg = out[i]
        if arg in _GLOBAL_WITH_VALUE:
            i += 2
            continue
        if arg.startswith("-"):
            i += 1
            continue
        if arg not in COMMANDS:
            out[i:i + 1] = ["--target", arg]  # the first word that is no command is the target...
            i += 2
            if i < len(out) and out[i] in COMMANDS:
                moved, kept = _targets_after(out[i], out[i + 1:], has_target=True)
                return out[:i] + moved + out[i:i + 1] + kept
            return out  # ...and the next is the command (click names a misspelt one)
        given = any(a in ("-t", "--target") or a.startswith("--target=") for a in out[:i])
        moved, kept = _targets_after(arg, out[i + 1:], has_target=given)
        return out[:i] + moved + out[i:i + 1] + kept
    return out


def _targets_after(command: str, rest: List[str], has_target: bool) -> Tuple[List[str], List[str]]:
    """The targets written in ``rest`` (what follows ``command``) as ``--target X`` options, and the rest."""
    if command in _NO_TARGET:
        return [], rest
    moved: List[str] = []
    kept: List[str] = []
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg == "--":
            kept.extend(rest[i:])
            break
        if arg in ("-t", "--target") and i + 1 < len(rest):
            moved += ["--target", rest[i + 1]]
            i += 2
            continue
        if arg.startswith("--target="):
            moved += ["--target", arg.split("=", 1)[1]]
            i += 1
            continue
        kept.append(arg)
        i += 1
    if not has_target and not moved:
        words = [j for j, a in enumerate(kept) if not a.startswith("-")]
        if words and _LOOKS_LIKE_TARGET.fullmatch(kept[words[0]]) and (command in _NO_ARGS or len(words) > 1):
            moved = ["--target", kept.pop(words[0])]
    return moved, kept

