"""The verdicts on ranks that cannot answer: dead (how it ended), a C call that keeps its GIL (which thread,
where), stopped, or no answer at all; with the ranks that wait for it in a collective named as waiting.

``where`` is the thread that matters: the one that keeps the GIL where that is known, else the main
thread; with the innermost frame of the program's own code it was called from where the innermost frame
is a library's. Advice that acts on the process (``kill -CONT``) is given only for a live process, not
for a record read back later (the process may be long gone).
"""

import re
from typing import Any, Callable, Dict, List, Sequence, Tuple

from probe.diagnose.evidence import RankEvidence, Sample, main_stack
from probe.diagnose.verdict import Commands, Evidence, Verdict, where_of, where_text

__all__ = ["cannot_answer", "died_of_another", "waiting"]

Key = Tuple[Tuple[str, str, int, str], ...]


def died_of_another(ev: RankEvidence) -> bool:
    """A dead rank whose death is how ranks die of another's: SIGTERM (a launcher ends the others so), an
    uncaught exception (a collective whose peer is gone raises one)."""
    why = ev.why or ""
    return ev.state == "dead" and ("SIGTERM (terminated)" in why or ": uncaught exception: " in why)


def waiting(in_collective: Dict[int, Any], first: Sample, last: Sample,
            progress: Dict[int, Dict[str, Any]]) -> Dict[int, Any]:
    """The ranks that wait for a rank that cannot answer: those inside a collective over the look
    (rank -> (op, thread, stack)), and the other answering ranks of a job whose main thread neither ran nor
    moved and that made no step (rank -> (None, thread, stack)): waiting inside DDP's backward, a barrier
    of their own, a queue fed by the silent rank."""
    out = dict(in_collective)
    if last.single:
        return out
    for r, ev in last.ranks.items():
        if r in out or ev.state != "answering" or r not in first.ranks or first.ranks[r] is ev:
            continue
        if progress.get(r, {}).get("ran") is False and not progress[r].get("stepped"):
            thread, key = main_stack(ev)
            if key:
                out[r] = (None, thread, key)
    return out


def _culprit_thread(ev: RankEvidence) -> Tuple[str, Key]:
    """The thread a verdict on ``ev`` points at: the GIL's holder where it is known, else the main thread."""
    if ev.state == "gil_held" and type(ev.holder_id) is int:
        name = ev.names_by_id().get(ev.holder_id)
        stacks = ev.stacks()
        if name is not None and stacks.get(name):
            return name, stacks[name]
    return main_stack(ev)


def cannot_answer(ev: RankEvidence, name: str, in_collective: Dict[int, Any], ranks: Dict[int, RankEvidence],
                  who: Callable[[Sequence[int]], str], command: Commands, single: bool,
                  recorded: bool = False) -> Verdict:
    thread, key = _culprit_thread(ev)
    where = where_of(key, thread, ev.library()) if ev.frames else None
    waiting = sorted(in_collective)
    inside = [r for r in waiting if in_collective[r][0] is not None]
    still = [r for r in waiting if in_collective[r][0] is None]
    victims_text = ""
    if inside:
        ops = sorted({in_collective[r][0] for r in inside})
        victims_text = "; %s wait%s for it in %s" % (who(inside), "s" if len(inside) == 1 else "", "/".join(ops))
    if still:
        victims_text += "; %s make%s no progress (no step, no CPU, the same stack), most likely waiting for it" % (
            who(still), "s" if len(still) == 1 else "")
    stacks_cmd = command([ev.rank], "backtrace")
    evidence: List[Evidence] = []
    nexts: List[str] = []
    if ev.state == "dead":
        status, kind = "dead", "dead"
        summary = "%s %s%s" % (name, _death(ev.why.split(" -- ")[0]), victims_text)
        if ev.frames:
            evidence.append(Evidence("its last stacks (%s): %s" % (ev.source, where_text(where)), stacks_cmd, [ev.rank]))
        else:
            evidence.append(Evidence("it left no stacks (a signal that runs no handler: SIGKILL, the OOM killer)",
                                     None, [ev.rank]))
        nexts.append("find out why it ended: its exit status, `dmesg | grep -i oom` on its node (the OOM killer), "
                     "`probe list` there")
        if not single:
            nexts.append("the others wait for it until their collective's timeout: restart the job from its last "
                         "checkpoint")
    elif ev.state == "gil_held":
        status, kind = "stuck", "gil_held"
        summary = "%s cannot answer: %s, a call into C that keeps the GIL%s" % (
            name, ev.holder or "a thread holds its GIL", victims_text)
        evidence.append(Evidence("stacks read from outside: %s" % where_text(where), stacks_cmd, [ev.rank]))
        nexts.append("see the C frames: %s" % command([ev.rank], "backtrace --native"))
        if not recorded:
            nexts.append("eval and the torch tables need the GIL: they work again once that call returns")
    elif ev.state == "stopped":
        status, kind = "stuck", "stopped"
        summary = "%s %s stopped (SIGSTOP, or a debugger): nothing in it %s%s" % (
            name, "was" if recorded else "is", "ran" if recorded else "runs", victims_text)
        evidence.append(Evidence("%s; stacks read from outside: %s" % (ev.why.split(" -- ")[0], where_text(where)),
                                 stacks_cmd, [ev.rank]))
        if not recorded:
            nexts.append("resume it with `kill -CONT %s` on its node (or detach the debugger)"
                         % (ev.pid if ev.pid is not None else "PID"))
    else:
        status, kind = "degraded", "no_answer"
        summary = "%s gave no evidence: %s" % (name, ev.why.split(" -- ")[0] or ev.state)
        if ev.frames:
            evidence.append(Evidence("stacks read from outside: %s" % where_text(where), stacks_cmd, [ev.rank]))
        else:
            evidence.append(Evidence(ev.why or "no answer, and its stacks could not be read", None, [ev.rank]))
        nexts.append("look again, with more time: %s" % command([ev.rank], "--deadline 30 backtrace"))
    from probe.diagnose.fr_copy import where_it_is

    said, line = where_it_is(ev, ranks, who)  # its recorder, from the copy its agent kept while it ran
    summary += "" if single else said
    if line and (ev.fr_copy is not None or ev.state in ("gil_held", "stopped")):
        evidence.append(Evidence(line, None, [ev.rank], list(ev.fr or ())))
    for group in (inside, still):
        if group:
            op, vthread, vkey = in_collective[group[0]]
            library = ranks[group[0]].library() if group[0] in ranks else None
            evidence.append(Evidence("%s: %s" % (who(group), where_text(where_of(vkey, vthread, library))),
                                     command(group, "backtrace"), group))
    return Verdict(kind, status, summary, [ev.rank], waiting, where, evidence, nexts)


def _death(why: str) -> str:
    """What follows the rank's name in the summary of its death: "is dead: CAUSE" (or "died while
    answering: CAUSE"), the error's words without the "process N is dead:" they may begin with, which the
    summary, naming the rank, would otherwise say twice ("process N has exited, ..." -> "it has exited, ...")."""
    found = re.match(r"(?:process|rank) \d+ (is dead|died while answering)(?:: |$)(.*)", why, re.S)
    if found:
        return "%s: %s" % (found.group(1), found.group(2)) if found.group(2) else found.group(1)
    found = re.match(r"(?:process|rank) \d+ (\S.*)", why, re.S)
    return "is dead: %s" % ("it " + found.group(1) if found else why)
