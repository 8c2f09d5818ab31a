"""Answers of many ranks, grouped: pure functions, data in, lines out.

A hung job is hundreds of ranks doing the same thing and one doing something else; printing every
rank's stack hides that one. So ranks whose stacks (per thread name) or outputs are identical share
one block, largest group first, with their ranks in compact form (``0-6,8-15``), and the frames where
a smaller group's stack departs from the largest group's are marked ``>``.
"""

from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from probe.cli.render import visible
from probe.client.cluster import compact_ranks
from probe.client.results import EvalResult, Frame, thread_stacks

__all__ = ["RankStacks", "group_stacks", "render_grouped_backtrace", "render_groups", "sorted_groups",
           "render_grouped_eval", "ranks_word"]

Key = Tuple[Tuple[str, str, int], ...]  # (func, file, lineno), innermost first


class RankStacks(NamedTuple):
    """One rank's frames, and where they came from when not from its agent."""

    rank: int
    frames: Sequence[Frame]
    outside: Optional[str] = None


def ranks_word(ranks: Sequence[int]) -> str:
    return ("rank %s" if len(ranks) == 1 else "ranks %s") % compact_ranks(ranks)


def group_stacks(ranks: Sequence[RankStacks]) -> List[Tuple[str, List[Tuple[Key, List[int]]]]]:
    """Per thread name (MainThread first): the distinct stacks with their ranks, largest group first."""
    per_name: Dict[str, Dict[Key, List[int]]] = {}
    for rank in ranks:
        for name, key in thread_stacks(rank.frames).items():
            per_name.setdefault(name, {}).setdefault(key, []).append(rank.rank)
    names = sorted(per_name, key=lambda n: (n != "MainThread", n))
    return [(name, sorted(per_name[name].items(), key=lambda kv: (-len(kv[1]), min(kv[1])))) for name in names]


def _short(path: str) -> str:
    marker = "site-packages/"
    return path[path.index(marker) + len(marker):] if marker in path else path


def _differs(key: Key, majority: Key) -> List[bool]:
    """For each frame of ``key`` (innermost first): whether the majority's stack, aligned at the
    outermost frame, has another frame there (or none)."""
    out = []
    for i in range(len(key)):
        j = len(majority) - len(key) + i  # the same distance from the outermost frame
        out.append(j < 0 or majority[j] != key[i])
    return out


def render_grouped_backtrace(ranks: Sequence[RankStacks], total: int) -> Iterator[str]:
    """Each thread name, each distinct stack once with its ranks; ``>`` marks where a minority departs."""
    return render_groups(group_stacks(ranks), {r.rank: r.outside for r in ranks if r.outside}, total)


def sorted_groups(threads: Dict[str, Dict[Key, List[int]]]) -> List[Tuple[str, List[Tuple[Key, List[int]]]]]:
    """Stacks already grouped (thread name -> stack -> ranks, as the node helpers send them) in
    ``group_stacks``'s order: MainThread first, largest group first."""
    names = sorted(threads, key=lambda n: (n != "MainThread", n))
    return [(name, sorted(threads[name].items(), key=lambda kv: (-len(kv[1]), min(kv[1])))) for name in names]


def render_groups(grouped: List[Tuple[str, List[Tuple[Key, List[int]]]]], outside: Dict[int, str],
                  total: int) -> Iterator[str]:
    """The lines of ``render_grouped_backtrace`` from stacks already grouped; ``outside``: rank -> note."""
    for t, (name, groups) in enumerate(grouped):
        if t:
            yield ""
        count = sum(len(g[1]) for g in groups)
        yield 'Thread "%s": %d distinct stack%s across %d of %d rank%s' % (
            visible(name), len(groups), "" if len(groups) == 1 else "s", count, total, "" if total == 1 else "s")
        majority = groups[0][0]
        for g, (key, members) in enumerate(groups):
            read = [r for r in members if r in outside]
            tag = "  [stack%s of %s read from outside]" % ("s" if len(read) > 1 else "", ranks_word(read)) if read else ""
            yield "  %s (%d)%s" % (ranks_word(members), len(members), tag)
            marks = _differs(key, majority) if g else [False] * len(key)
            for (func, file, lineno), mark in zip(key, marks):
                yield "    %s %s (%s:%d)" % (">" if mark else " ", visible(str(func)), visible(_short(str(file))), lineno)


def _eval_text(result: EvalResult) -> Tuple[str, str]:
    out = result.stdout + ((result.value + "\n") if result.value is not None else "")
    err = result.stderr + (result.error or "") + ("(timed out)\n" if result.timed_out else "")
    return out, err


def render_grouped_eval(results: Sequence[Tuple[int, EvalResult]]) -> Iterator[Tuple[str, bool]]:
    """(line, to_stderr) pairs: identical outputs share one block headed by their ranks, largest first."""
    groups: Dict[Tuple[str, str], List[int]] = {}
    for rank, result in results:
        groups.setdefault(_eval_text(result), []).append(rank)
    for (out, err), members in sorted(groups.items(), key=lambda kv: (-len(kv[1]), min(kv[1]))):
        head = ranks_word(members)
        lines = out.rstrip("\n").split("\n") if out else []
        if len(lines) == 1 and not err:
            yield "%s: %s" % (head, lines[0]), False
            continue
        yield "%s:" % head, False
        for line in lines:
            yield "  " + line, False
        for line in err.rstrip("\n").split("\n") if err else []:
            yield "  " + line, True


def render_grouped_text(results: Sequence[Tuple[int, str]]) -> Iterator[str]:
    """Lines: ranks that printed the same text share one block headed by their ranks, largest group first
    (``tables`` and ``schema`` across ranks: one listing, not one a rank)."""
    groups: Dict[str, List[int]] = {}
    for rank, text in results:
        groups.setdefault(text, []).append(rank)
    for text, members in sorted(groups.items(), key=lambda kv: (-len(kv[1]), min(kv[1]))):
        yield "%s:" % ranks_word(members)
        for line in text.rstrip("\n").split("\n"):
            yield ("  " + line).rstrip()
