"""Stacks read from outside a busy process are ones the program can be in (issue 32, item 18).

A process without an agent, recursing and returning on the CPU all the time (tests/targets/
mutual_recursion.py: two functions calling each other on the main thread; a method recursing through
generators on thread ``walker``), is read 100 times with ``probe PID backtrace --json``. Read without stopping it, a stack can be caught while it changes: a caller at a line that calls
nothing, a callee its caller's line does not call. Every stack read must be one the program can produce;
what it can produce is derived from the target's source with ``ast``: each frame but the innermost stands
at a line whose calls include the function of the frame inside it.
"""

import ast
import json
import os
from typing import Dict, List, Set, Tuple

import pytest

from procs import TARGETS, run_cli

pytest.importorskip("pystack", reason="reading from outside needs py-spy or pystack")

TARGET = os.path.join(TARGETS, "mutual_recursion.py")
READS = 100


def _calls_by_line(path: str) -> Tuple[Dict[Tuple[str, int], Set[str]], Dict[str, range]]:
    """(function, line) -> names called on that line; function -> its lines (``<module>`` for the top).
    Functions by qualified name (``Tree.walk``), as the reader names them on 3.11 and later."""
    with open(path) as handle:
        tree = ast.parse(handle.read())
    calls: Dict[Tuple[str, int], Set[str]] = {}
    spans: Dict[str, range] = {"<module>": range(1, 10 ** 6)}

    def visit(node: ast.AST, scope: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner, inner_prefix = scope, prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = prefix + child.name
                inner_prefix = inner + ".<locals>."
                spans[inner] = range(child.lineno, (child.end_lineno or child.lineno) + 1)
            elif isinstance(child, ast.ClassDef):
                inner_prefix = prefix + child.name + "."
            if isinstance(child, ast.Call):
                func = child.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
                if name:
                    for line in range(child.lineno, (child.end_lineno or child.lineno) + 1):
                        calls.setdefault((scope, line), set()).add(name)
            visit(child, inner, inner_prefix)

    visit(tree, "<module>", "")
    return calls, spans


def _impossible(frames: List[Tuple[str, int]], calls: Dict[Tuple[str, int], Set[str]],
                spans: Dict[str, range], outermost: str) -> str:
    """Why the stack (innermost first, the target's frames only) is not one the program can be in; "" when
    it is. ``outermost``: the function its outermost frame must be (``<module>``, a thread's target)."""
    if not frames or frames[-1][0] != outermost:
        return "the outermost frame is not %s" % outermost
    for func, line in frames:
        if func not in spans or line not in spans[func]:
            return "%s@%d is no line of the target's %s" % (func, line, func)
    for (inner, _), (outer, line) in zip(frames, frames[1:]):
        if inner.rsplit(".", 1)[-1] not in calls.get((outer, line), set()):
            return "%s@%d does not call %s" % (outer, line, inner)
    return ""


def test_a_busy_recursion_read_from_outside_shows_only_stacks_it_can_be_in(target_factory) -> None:
    calls, spans = _calls_by_line(TARGET)
    with open(TARGET) as handle:
        lines = handle.read().splitlines()
    at = {text.strip(): number for number, text in enumerate(lines, 1)}
    # the rule sees the source as written: a calling line, and the line after it, which calls nothing
    assert calls[("ping", at["total += pong(depth + 1, limit)"])] == {"pong"}
    assert ("ping", at["total -= 2"]) not in calls
    assert calls[("Tree.walk", at["yield from child.walk(level + 1)"])] == {"walk"}
    assert ("Tree.walk", at["yield -level"]) not in calls
    proc = target_factory("mutual_recursion.py", probe=False)
    torn: List[str] = []
    depths: Dict[str, Set[int]] = {"MainThread": set(), "walker": set()}
    for _ in range(READS):
        result = run_cli(str(proc.pid), "backtrace", "--json")
        assert result.code == 0, result.err
        # the note says how it was read: stopped by py-spy, or from memory while no thread ran (probe's own reader)
        assert "(every stack is one it was in)" in result.err, result.err
        rows = json.loads(result.out)
        for thread, outermost in (("MainThread", "<module>"), ("walker", "work")):
            mine = sorted((r for r in rows if r["thread_name"] == thread), key=lambda r: r["depth"])
            frames = [(r["func"], r["lineno"]) for r in mine if r["file"] == TARGET]  # threading's frames above
            assert all(r["file"] == TARGET for r in mine[:len(frames)]), mine
            why = _impossible(frames, calls, spans, outermost)
            if why:
                torn.append("%s, %s: %s" % (thread, why, " <- ".join("%s@%d" % f for f in frames)))
            depths[thread].add(len(frames))
    assert not torn, "%d stacks of %d reads the program cannot be in:\n%s" % (len(torn), READS, "\n".join(torn))
    for thread, seen in depths.items():  # caught at enough depths for the check to mean something
        assert len(seen) >= 4, "%s was not caught at enough depths to tell: %s" % (thread, sorted(seen))
