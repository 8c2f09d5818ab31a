"""The lock-wait verdicts of ``probe diagnose``: threads that stay at a lock's acquire, who holds each lock,
and the deadlock when the holders wait for each other.

A thread waits for a lock when its innermost frame, in the program's own code, stays at ``with X:`` or
``X.acquire(`` over the look and gains no CPU: a lock's acquire is C code, so no Python frame is deeper.
``X`` may be named anything (``with a:`` is as much a lock as ``with self._lock:``); where the agent
resolved it (``python.locks``) an object that is not a lock is no lock wait, and the lock's identity,
not its name, says which thread holds it (:mod:`probe.diagnose.locks`).
"""

import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from probe.diagnose.evidence import RankEvidence
from probe.diagnose.locks import code_only, holders as lock_holders, waited_lock
from probe.diagnose.verdict import CPU_RAN_S, Commands, Evidence, Verdict, short_path, where_of, where_text

__all__ = ["lock_line", "lock_wait_of", "lock_waits", "lock_verdict"]

Key = Sequence[Tuple[str, str, int, str]]

_LOCKISH = re.compile(r"lock|mutex", re.IGNORECASE)
_CHAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\s*\.\s*[A-Za-z_][A-Za-z0-9_]*)*")


def lock_line(code: str) -> Optional[str]:
    """The lock a line would wait for: ``with X:`` (X a plain name or attribute chain, or an expression that
    says lock or mutex), ``X.acquire(``; None for any other line."""
    text = code_only(code)
    expr = waited_lock(text)
    if expr is None:
        return None
    if text.startswith(("with ", "async with ")):
        return expr if _CHAIN.fullmatch(expr) or _LOCKISH.search(expr) else None
    return expr


def lock_wait_of(key: Key, library: Any) -> bool:
    """The innermost frame is the program's own, at a lock's acquire (a wait inside threading or queue, an
    Event's or a Condition's, is a wait for work, not for a lock). Kept per innermost frame and library:
    at 16k ranks the same few frames are asked about 100,000 times a diagnosis."""
    if not key:
        return False
    if not hasattr(library, "roots"):
        return not library.holds(key[0][1]) and lock_line(key[0][3]) is not None
    place = (key[0][1], key[0][3], getattr(library, "roots", None), getattr(library, "known", None))
    got = _SEEN.get(place)
    if got is None:
        if len(_SEEN) >= 4096:
            _SEEN.clear()
        got = _SEEN[place] = not library.holds(key[0][1]) and lock_line(key[0][3]) is not None
    return got


_SEEN: Dict[Any, bool] = {}  # (file, code, library roots, known) -> lock_wait_of


def _not_a_lock(ev: RankEvidence, thread: str, key: Key) -> bool:
    """Whether the agent found the object at the waiting line and it is no lock (``with open_gate:`` of a
    context manager written in C that blocks for other reasons is not called a lock wait)."""
    names = ev.names_by_id()
    rows = [r for r in ev.lock_rows() if r.get("role") == "waits" and names.get(r.get("thread_id")) == thread
            and r.get("depth") == 0 and r.get("lineno") == key[0][2]]
    return bool(rows) and all(r.get("lock_type") is not None and r.get("locked") is None for r in rows)


def lock_waits(a: RankEvidence, b: RankEvidence) -> List[Tuple[str, Tuple[Tuple[str, str, int, str], ...]]]:
    """Threads at a lock's acquire in both samples, with the same stack, gaining no CPU (kept on ``b`` for
    the same two looks: the look for a longer look and the judge both ask)."""
    memo = b.__dict__.get("_lock_waits_memo")
    if memo is not None and memo[0] is a and memo[1] is a.frames and memo[2] is b.frames \
            and memo[3] is a.threads and memo[4] is b.threads:
        return memo[5]  # type: ignore[no-any-return]
    out = _lock_waits(a, b)
    b.__dict__["_lock_waits_memo"] = (a, a.frames, b.frames, a.threads, b.threads, out)
    return out


def _lock_waits(a: RankEvidence, b: RankEvidence) -> List[Tuple[str, Tuple[Tuple[str, str, int, str], ...]]]:
    if a.state != "answering" or b.state != "answering":
        return []
    library = b.library()
    # Most ranks have no thread at a lock's line: said from the innermost frames alone (kept per frame),
    # before the other look's stacks and both looks' CPU are read (at 16k ranks, twice a diagnosis).
    waiting = [(name, key) for name, _, key in b._named() if lock_wait_of(key, library)]
    if not waiting:
        return []
    sa = a.stacks()
    ca, cb = a.cpu_by_name(), b.cpu_by_name()
    out = []
    for name, key in waiting:
        if sa.get(name) == key and not _not_a_lock(b, name, key):
            gained = (cb[name] - ca[name]) if name in ca and name in cb else None
            if gained is None or gained < CPU_RAN_S:
                out.append((name, key))
    return out


def _place(row: Dict[str, Any]) -> str:
    return "%s (%s:%s)" % (row["holder_func"], short_path(str(row["holder_file"])),
                           row.get("holder_with_line") or row["holder_line"])


def lock_verdict(ev: RankEvidence, waits: List[Tuple[str, Any]], window: float,
                 who: Callable[[Sequence[int]], str], command: Commands, live: bool = True) -> Verdict:
    library = ev.library()
    names = [n for n, _ in waits]
    main = "MainThread" in names
    name, key = waits[0]
    where = where_of(key, name, library)
    several = len(waits) > 1
    held = {str(row["thread"]): row for row in lock_holders(ev, waits)}
    cycle = _lock_cycle(held)
    if cycle:
        detail = "; a deadlock: %s (%s)" % ("; ".join(
            "thread %s waits for %s, held by thread %s" % (n, _lock_name(held[n]), held[n]["holder"]) for n in cycle),
            "; ".join("thread %s holds %s since %s" % (held[n]["holder"], _held_name(held[n]), _place(held[n]))
                      for n in cycle))
    else:
        known = [row for row in held.values() if row.get("holder") is not None]
        detail = "".join("; %s waits for %s, held by thread %s in %s (%s:%s) (%s)" % (
            row["thread"], row["lock"], row["holder"], row["holder_func"], short_path(str(row["holder_file"])),
            row["holder_line"], row.get("how") or "by its stack") for row in known)
        if several and len(known) < len(held):
            detail += "; a deadlock if each holds what another waits for"
        if len(known) < len(held):
            detail += "; the holder of %s unknown (%s)" % (", ".join(
                str(row["lock"] or "the lock") for row in held.values() if row.get("holder") is None),
                "a threading.Lock records no owner" if any(row.get("lock_type") != "_thread.RLock" for row in
                                                           held.values() if row.get("holder") is None)
                else "its owner is not among the threads read")
    summary = "%s: %s wait%s for a lock (no CPU, the same stack over %.1f s)%s" % (
        who([ev.rank]), ", ".join(names), "" if several else "s", window, detail)
    evidence = []
    for n, k in waits:
        row = held[n]
        if row.get("holder") is not None:
            if row.get("holder_with_line"):
                said = "held by thread %s, inside `with %s:` (%s:%s), now at %s (%s:%s)" % (
                    row["holder"], row.get("holder_expr") or row["lock"], short_path(str(row["holder_file"])),
                    row["holder_with_line"], row["holder_func"], short_path(str(row["holder_file"])), row["holder_line"])
            else:
                said = "held by thread %s (the RLock's owner; taken with acquire()), now at %s (%s:%s)" % (
                    row["holder"], row["holder_func"], short_path(str(row["holder_file"])), row["holder_line"])
        else:
            said = "holder unknown: %s" % row.get("why")
        evidence.append(Evidence("thread %s at `%s`: %s; %s" % (n, code_only(k[0][3]), where_text(where_of(k, n, library)),
                                                                said),
                                 command([ev.rank], "backtrace"), [ev.rank], [dict(row)]))
    holders = sorted({str(row["holder"]) for row in held.values() if row.get("holder") is not None} - set(cycle or ()))
    if cycle:
        nexts = ["take the locks in one order in every thread (%s: each thread holds one and waits for the next)"
                 % " -> ".join(_held_name(held[n]) for n in cycle)]
    elif holders:
        nexts = ["what %s does while holding it: %s" % (", ".join("thread %s" % h for h in holders), command(
            [ev.rank], "backtrace"))]
    else:
        nexts = ["which thread holds it: look for the thread inside that lock's `with` block: %s"
                 % command([ev.rank], "backtrace")]
    lock = held[name].get("lock")
    if live and lock:  # the lock object itself, read in the waiting frame: locked or not, an RLock's owner
        nexts.append("the lock as the waiting frame sees it (locked or not; an RLock's owner): %s" % command(
            [ev.rank], "eval --frame %s:0 %s" % (_quoted(name), _quoted("repr(%s)" % lock))))
    return Verdict("lock_wait", "stuck" if main or several else "degraded", summary, [ev.rank], [], where, evidence,
                   nexts)


def _lock_name(row: Dict[str, Any]) -> str:
    """The lock as the waiting line names it, and as its holder's ``with`` does where that differs
    (``gate (a)``: a helper's parameter for the module's ``a``)."""
    held = row.get("holder_expr")
    return "%s (%s)" % (row["lock"], held) if held and held != row["lock"] else str(row["lock"])


def _held_name(row: Dict[str, Any]) -> str:
    return str(row.get("holder_expr") or row["lock"])


def _quoted(text: str) -> str:
    import shlex

    return shlex.quote(text)


def _lock_cycle(held: Dict[str, Dict[str, Any]]) -> Optional[List[str]]:
    """Waiting threads each holding the lock the next one waits for, back to the first; or None."""
    for start in sorted(held):
        seen = [start]
        while True:
            nxt = held[seen[-1]].get("holder")
            if nxt == start and len(seen) > 1:
                return seen
            if nxt is None or nxt not in held or nxt in seen:
                break
            seen.append(str(nxt))
    return None
