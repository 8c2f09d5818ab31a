"""The collective verdicts: a hang (a rank that did not issue or enter the collective the others wait in) and
a mismatched collective.

A hang, only where every rank answers (else the ranks that cannot answer are the reason, and their
verdicts name the waiting ones): from the Flight Recorder, the ranks whose last collective of a group is
before the one the others issued and still wait in (its number, op, for how long); without it, from the
stacks: ranks whose main thread stayed inside a torch.distributed collective over the whole window, with
no CPU gained and no step made (:func:`waiting_in`), against the ranks outside it. One process of a job
waiting so is said to wait for a rank elsewhere (:func:`waits_alone`).

A mismatched collective: ranks that issued different collectives under the same number of one process
group (rank 1 ``broadcast`` where the others ``all_reduce``), or the same op with different sizes or dtypes.

Such ranks all wait, each in its own collective, and none is behind another: the Flight Recorder's
numbers are equal and the stacks show every rank inside torch.distributed, so neither "a rank did not
issue #N" nor "a rank did not enter it" is true. What is:

* from the Flight Recorder (live, a probe snapshot, or torch's own dumps): per group, each rank's last
  ``RECENT`` collectives (number, op, input sizes and dtypes; ``FR_SQL``'s ``recent``), compared number by
  number across ranks; the first number whose op differs, or whose sizes (for the ops whose every rank
  gives the same shapes) or dtypes differ, is the mismatch;
* with the recorder off, from the stacks: every rank's main thread stayed in a torch.distributed
  collective over the whole look, and not all in the same one.

The ranks whose op is the odd one out are named as the culprits, the others as waiting; where the sides
are as many (two ranks), both are named, since nothing recorded says which side's code is wrong.
"""

import json
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from probe.diagnose.evidence import RankEvidence, Sample, fr_by_pg, main_stack
from probe.diagnose.group_order import behind_text, deadlock
from probe.diagnose.verdict import CPU_RAN_S, HANG_FLOOR_S, Commands, Evidence, Verdict, ranks_word, where_of, \
    where_text

__all__ = ["RECENT", "recent_text", "parse_recent", "mismatch", "collective_of", "waiting_in", "hang", "waits_alone"]

HANG_PERIODS = 5.0  # no hang either: a collective waited in for less than this many of the group's mean intervals

RECENT = 8
"""Collectives of each group kept per rank and look for the comparison (the newest)."""

SAME_SIZES = ("all_reduce", "allreduce", "all_reduce_coalesced", "allreduce_coalesced", "broadcast", "reduce",
              "_allgather_base", "all_gather_into_tensor", "allgather_into_tensor_coalesced",
              "reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced")
"""Ops whose input shapes are the same on every rank (an all_to_all's, a scatter's or a list all_gather's, which
may be uneven, need not be)."""

Entry = Tuple[str, str, str]  # (op, input sizes as JSON, input dtypes as JSON)
Who = Callable[[Sequence[int]], str]


def recent_text(rows: Sequence[Dict[str, Any]]) -> str:
    """The ``recent`` field from rows of ``torch.flight_recorder`` (a dump's): one line a collective,
    ``seq<TAB>op<TAB>sizes<TAB>dtypes``, the newest ``RECENT``, as ``FR_SQL`` writes it live."""
    kept = sorted((r for r in rows if r.get("collective_seq_id") is not None), key=lambda r: int(r["collective_seq_id"]))
    return "\n".join("\t".join((str(int(r["collective_seq_id"])), str(r.get("op") or ""), str(r.get("input_sizes") or ""),
                                str(r.get("input_dtypes") or ""))) for r in kept[-RECENT:])


def parse_recent(row: Dict[str, Any]) -> Dict[int, Entry]:
    """seq -> (op, sizes, dtypes) from one group's row of the evidence; what cannot be read is left out
    (the text came from the target). The last collective's own fields fill in where ``recent`` is absent."""
    out: Dict[int, Entry] = {}
    text = row.get("recent")
    for line in str(text).splitlines()[-4 * RECENT:] if isinstance(text, str) else ():
        parts = line.split("\t")
        if len(parts) != 4 or not parts[0].isdigit() or len(parts[0]) > 18:
            continue
        out[int(parts[0])] = (parts[1][:200], parts[2][:400], parts[3][:400])
    last = row.get("last_seq")
    if isinstance(last, int) and last not in out and row.get("last_op"):
        out[last] = (str(row["last_op"])[:200], str(row.get("last_sizes") or "")[:400],
                     str(row.get("last_dtypes") or "")[:400])
    return out


def _short_op(op: str) -> str:
    return op.split(":", 1)[-1]


def _differ(a: Entry, b: Entry) -> Optional[str]:
    """What differs between two ranks' entries of one number: 'op', 'sizes', 'dtypes', or None."""
    if a[0] != b[0]:
        return "op"
    if _shown(a[2]) and _shown(b[2]) and _plain(a[2]) != _plain(b[2]):  # none on one side (a scatter's non-root)
        return "dtypes"
    if _short_op(a[0]) in SAME_SIZES and _shown(a[1]) and _shown(b[1]) and _plain(a[1]) != _plain(b[1]):
        return "sizes"
    return None


def _plain(text: str) -> Any:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return json.dumps(value)


def _described(entry: Entry) -> str:
    op, sizes, dtypes = entry
    shapes = _shown(sizes)
    kinds = _shown(dtypes)
    return "%s%s" % (op, " (sizes %s, dtypes %s)" % (shapes, kinds) if shapes or kinds else "")


def _shown(text: str) -> str:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text[:80]
    if value in ([], None, ""):
        return ""
    return json.dumps(value, separators=(",", ":"))[:80]


def mismatch(first: Any, last: Any, answering: List[int], who: Who, command: Any) -> Optional[Any]:
    """The mismatch verdict, from the Flight Recorder where it has the ranks' entries, else from the stacks."""
    if len(answering) < 2:
        return None
    return _from_recorder(last, answering, who, command) or _from_stacks(first, last, answering, who, command)


def _sides(entries: Dict[int, Entry], what: str) -> List[Tuple[Entry, List[int]]]:
    """The ranks grouped by what they issued, the largest group first (ties: the lowest rank first)."""
    groups: Dict[Any, Tuple[Entry, List[int]]] = {}
    for rank, entry in sorted(entries.items()):
        key = entry[0] if what == "op" else (entry[0], _plain(entry[1]) if what == "sizes" else "",
                                             _plain(entry[2]) if what == "dtypes" else "")
        groups.setdefault(key, (entry, []))[1].append(rank)
    return sorted(groups.values(), key=lambda g: (-len(g[1]), g[1][0]))


def _from_recorder(last: Any, answering: List[int], who: Who, command: Any) -> Optional[Any]:
    by_pg: Dict[str, Dict[int, Dict[int, Entry]]] = {}
    rows: Dict[str, Dict[int, Dict[str, Any]]] = {}
    for r in answering:
        for pg, row in fr_by_pg(last.ranks[r]).items():
            parsed = parse_recent(row)
            if parsed:
                by_pg.setdefault(pg, {})[r] = parsed
                rows.setdefault(pg, {})[r] = row
    for pg, ranks in sorted(by_pg.items()):
        if len(ranks) < 2:
            continue
        seqs = sorted(set().union(*(set(e) for e in ranks.values())))
        for seq in seqs:
            entries = {r: e[seq] for r, e in ranks.items() if seq in e}
            if len(entries) < 2:
                continue
            base = next(iter(entries.values()))
            what = next((d for d in (_differ(base, e) for e in entries.values()) if d), None)
            if what is None:
                continue
            return _verdict(last, pg, seq, what, entries, rows[pg], who, command)
    return None


def _verdict(last: Any, pg: str, seq: int, what: str, entries: Dict[int, Entry], rows: Dict[int, Dict[str, Any]],
             who: Who, command: Any) -> Any:
    sides = _sides(entries, what)
    if len(sides[0][1]) > len(sides[1][1]):
        culprits = sorted(r for _, rs in sides[1:] for r in rs)
        victims = sorted(sides[0][1])
    else:  # as many on each side: nothing recorded says which side's code is wrong
        culprits, victims = sorted(entries), []
    desc = rows[min(rows)].get("pg_desc")
    group = "process group %s%s" % (pg, " (%s)" % desc if desc else "")
    word = {"op": "ops", "sizes": "input sizes", "dtypes": "input dtypes"}[what]
    said = "; ".join("%s %s" % (who(rs), _described(e) if what != "op" else e[0]) for e, rs in sides)
    pending = [r for r, row in rows.items() if row.get("last_seq") == seq and not row.get("last_done")]
    stuck = bool(pending) and len(pending) == len(entries)
    summary = "collective mismatch in %s at #%d: %s%s" % (
        group, seq, said, "; each waits in its own" if stuck else "")
    if not victims:
        summary += " (which side is wrong is not recorded: each runs a different code path here)"
    where = None
    evidence = [Evidence("Flight Recorder, group %s, collective #%d: the %s differ: %s" % (
        pg, seq, word, "; ".join("%s %s" % (who(rs), _described(e)) for e, rs in sides)),
        command(None, "query \"SELECT pg, collective_seq_id, op, input_sizes, input_dtypes, state, retired FROM "
                      "torch.flight_recorder WHERE collective_seq_id = %d\"" % seq), sorted(entries),
        [dict(rank=r, pg=pg, collective_seq_id=seq, op=e[0], input_sizes=e[1], input_dtypes=e[2])
         for r, e in sorted(entries.items())])]
    for entry, rs in sides:
        line = _line(last, rs[0], rows.get(rs[0]))
        if where is None and rs[0] in culprits and line[0] is not None:
            where = line[0]
        evidence.append(Evidence("%s issued %s #%d at %s" % (who(rs), _short_op(entry[0]), seq, line[1]),
                                 command(rs, "backtrace"), rs))
    nexts = ["make every rank issue the same collectives in the same order, with the same shapes and dtypes: "
             "look for a rank-dependent branch around these lines", _stacks_next(culprits, who, command)]
    return Verdict("collective_mismatch", "stuck" if stuck else "degraded", summary, culprits, victims, where,
                   evidence, nexts)


def _stacks_next(culprits: List[int], who: Who, command: Any) -> str:
    return "how %s got there, with the C frames: %s" % (who(culprits), command(culprits, "backtrace --native"))


def _line(last: Any, rank: int, row: Optional[Dict[str, Any]]) -> Tuple[Optional[Dict[str, Any]], str]:
    """Where a rank issued its collective: the program's own frame on its main thread's stack where that is
    inside a collective, else the recorder's call site; the text says which, or that neither is known."""
    ev = last.ranks[rank]
    thread, key = main_stack(ev)
    if key and collective_of(key) is not None:
        where = where_of(key, thread)
        return where, where_text(where)
    frames = [f.strip() for f in str((row or {}).get("call_site") or "").split(";") if f.strip()]
    own = [f for f in frames if "site-packages/" not in f and "/lib/python3" not in f]
    if own:
        return None, "%s (the recorder's call site)" % own[0]
    return None, "a line not known here: its stack was not read in a collective and the recorder kept none"


def _from_stacks(first: Any, last: Any, answering: List[int], who: Who, command: Any) -> Optional[Any]:
    """Every rank's main thread in a torch.distributed collective in both looks (the same stack), not all
    in the same op, the recorder not saying otherwise: each waits in its own collective."""
    window = max(0.0, last.at - first.at)
    if window < HANG_FLOOR_S or all(fr_by_pg(last.ranks[r]) for r in answering):
        return None  # where the recorder has every rank, its numbers say what the stacks cannot
    ops: Dict[int, Tuple[str, str, Any]] = {}
    for r in answering:
        a = first.ranks.get(r)
        name, key = main_stack(last.ranks[r])
        op = collective_of(key)
        if op is None or a is None or main_stack(a) != (name, key):
            return None
        ops[r] = (op, name, key)
    groups: Dict[str, List[int]] = {}
    for r, (op, _, _) in sorted(ops.items()):
        groups.setdefault(op, []).append(r)
    if len(groups) < 2:
        return None
    sides = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    if len(sides[0][1]) > len(sides[1][1]):
        culprits, victims = sorted(r for _, rs in sides[1:] for r in rs), sorted(sides[0][1])
    else:
        culprits, victims = sorted(ops), []
    said = "; ".join("%s in %s" % (who(rs), op) for op, rs in sides)
    summary = "collective mismatch: %s, each the same stack over %.1f s: ranks waiting in different collectives" % (
        said, window)
    if not victims:
        summary += " (which side is wrong is not known: each runs a different code path here)"
    evidence = []
    where = None
    for op, rs in sides:
        _, thread, key = ops[rs[0]]
        at = where_of(key, thread)
        if where is None and rs[0] in culprits:
            where = at
        evidence.append(Evidence("%s: in %s at %s, no CPU gained and no step" % (who(rs), op, where_text(at)),
                                 command(rs, "backtrace"), rs))
    whys = sorted({str(last.ranks[r].fr_why) for r in answering if last.ranks[r].fr_why})
    evidence.append(Evidence("the Flight Recorder: %s; whether they are the same collective's number is not known "
                             "(TORCH_FR_BUFFER_SIZE=2000 at the job's start records numbers, ops, sizes and dtypes)"
                             % ("; ".join(whys) if whys else "it holds none of these"), None, []))
    nexts = ["make every rank issue the same collectives in the same order: look for a rank-dependent branch "
             "around these lines", _stacks_next(culprits, who, command)]
    return Verdict("collective_mismatch", "stuck", summary, culprits, victims, where, evidence, nexts)


# -- a collective hang ---------------------------------------------------------------------------------

_C10D = ("distributed/distributed_c10d.py", "distributed/_functional_collectives.py", "distributed/c10d_logger.py")


def collective_of(key: Sequence[Tuple[str, str, int, str]]) -> Optional[str]:
    """The torch.distributed collective a stack is inside (``all_reduce``, ``barrier``...), or None."""
    for func, path, _, _ in key:
        if path.endswith(_C10D[:2]) and not func.startswith("_") and func != "wrapper":
            return func
    return None


def waiting_in(first: Sample, last: Sample, answering: List[int],
               progress: Dict[int, Dict[str, Any]]) -> Dict[int, Tuple[str, str, Any]]:
    """Ranks waiting inside a collective, by stacks, stuck over the whole window (victims of whoever is
    missing): rank -> (op, thread, stack)."""
    in_collective: Dict[int, Tuple[str, str, Any]] = {}
    for r in answering:
        moved = progress[r]
        if moved.get("stepped") or (moved.get("cpu") or 0) >= CPU_RAN_S:
            continue  # first: the cheapest, and what most ranks of a working job say
        name, key = main_stack(last.ranks[r])
        op = collective_of(key)
        a = first.ranks.get(r)
        if op is not None and a is not None and main_stack(a) == (name, key):
            in_collective[r] = (op, name, key)
    return in_collective


def hang(first: Sample, last: Sample, answering: List[int], in_collective: Dict[int, Any], window: float,
         who: Who, command: Commands) -> Optional[Verdict]:
    """A mismatch, else a hang by the Flight Recorder, else a hang by the stacks; or None."""
    return mismatch(first, last, answering, who, command) or _fr_hang(first, last, answering, who, command) or \
        _stack_hang(last, answering, in_collective, window, who, command)


class Hung(NamedTuple):
    """One process group's hang by the Flight Recorder: ``waiting`` issued #``top`` and still wait in it,
    ``behind`` did not issue it (their last numbers are below)."""

    pg: str
    top: int
    waiting: List[int]
    behind: List[int]
    rows: Dict[int, Dict[str, Any]]


def _hung_groups(first: Sample, last: Sample, answering: List[int]) -> List[Hung]:
    """Every group where ranks wait in their last collective #M, still since the first look and for long
    against the group's pace, while others' last collective is before M."""
    groups: Dict[str, Dict[int, Dict[str, Any]]] = {}
    for r in answering:
        for pg, row in fr_by_pg(last.ranks[r]).items():
            groups.setdefault(pg, {})[r] = row
    hung: List[Hung] = []
    for pg, rows in sorted(groups.items()):
        for r in _members(rows):  # members that issued none of its collectives the recorder keeps
            if r not in rows and r in last.ranks and r in answering:
                rows[r] = {"pg": pg, "last_seq": 0, "last_op": None, "last_done": True, "none_recorded": True}
        if len(rows) < 2:
            continue
        top = max(int(row["last_seq"]) for row in rows.values())
        waiting = sorted(r for r, row in rows.items() if int(row["last_seq"]) == top and not row.get("last_done"))
        behind = sorted(r for r, row in rows.items() if int(row["last_seq"]) < top)
        if not waiting or not behind:
            continue
        still = []
        for r in waiting:
            before = fr_by_pg(first.ranks[r]).get(pg) if r in first.ranks else None
            row = rows[r]
            period = float(row.get("period") or 0.0)
            age = float(row.get("last_age") or 0.0)
            if before is not None and int(before["last_seq"]) == top and not before.get("last_done") \
                    and age >= max(HANG_FLOOR_S, HANG_PERIODS * period):
                still.append(r)
        if still == waiting:  # else a rank arrived, or the wait is short for this group's pace: not a hang (yet)
            hung.append(Hung(pg, top, waiting, behind, rows))
    return hung


def _members(rows: Dict[int, Dict[str, Any]]) -> List[int]:
    """The group's global ranks as its rows say (``group_ranks``, ``[0, 1]``), where one says; else none."""
    for row in rows.values():
        text = row.get("group_ranks")
        if isinstance(text, str) and len(text) < 1 << 20:
            try:
                ranks = json.loads(text)
            except ValueError:
                continue
            if isinstance(ranks, list) and all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
                return ranks
    return []


def _fr_hang(first: Sample, last: Sample, answering: List[int], who: Callable[[Sequence[int]], str],
             command: Commands) -> Optional[Verdict]:
    """From the Flight Recorder: per group, the ranks at its last collective #M that wait in it, and the
    ranks whose last collective is before M (they did not issue #M). A rank behind in one group that itself
    waits in another hung group is no cause: the culprits are the ranks behind that wait in no hung group.
    Where every rank behind waits in another (rank 0 in group 0's barrier, which rank 1 has not issued,
    rank 1 in group 1's all_reduce, which rank 0 has not issued), the groups' collectives are issued in
    different orders: a deadlock across groups (:mod:`probe.diagnose.group_order`)."""
    hung = _hung_groups(first, last, answering)
    waits_anywhere = {r for h in hung for r in h.waiting}
    for h in hung:
        roots = [r for r in h.behind if r not in waits_anywhere]
        if roots:
            return _fr_verdict(last, h, roots, hung, who, command)
    if hung:
        return deadlock(last, hung, who, command)
    return None


def _fr_verdict(last: Sample, h: Hung, behind: List[int], hung: List[Hung], who: Callable[[Sequence[int]], str],
                command: Commands) -> Verdict:
    """The hang of group ``h``, blaming ``behind`` (its ranks behind that wait in no hung group); every
    rank that waits in a hung group is a victim, and where one waits in another group it is said."""
    pg, top, waiting, rows = h.pg, h.top, h.waiting, h.rows
    row = rows[waiting[0]]
    op = str(row.get("last_op") or "a collective")
    desc = " (%s)" % row["pg_desc"] if row.get("pg_desc") not in (None, "", "undefined") else ""
    thread, key = main_stack(last.ranks[behind[0]])
    where = where_of(key, thread, last.ranks[behind[0]].library())
    summary = ("collective hang in process group %s%s: %s did not issue %s #%d; %s wait%s in it" % (
        pg, desc, who(behind), op, top, who(waiting), "s" if len(waiting) == 1 else ""))
    ages = [float(rows[r].get("last_age") or 0) for r in waiting]
    fr_cmd = command(None, "query \"SELECT pg, collective_seq_id, op, state, retired, time_created FROM "
                           "torch.flight_recorder ORDER BY collective_seq_id DESC LIMIT 3\"")
    evidence = [
        Evidence("Flight Recorder, group %s: %s issued #%d (%s) %.1f s ago and it is not done; %s"
                 % (pg, who(waiting), top, op, min(ages), behind_text(who, behind, rows)),
                 fr_cmd, waiting + behind,
                 [dict(rank=r, pg=pg, last_seq=rows[r]["last_seq"], last_op=rows[r].get("last_op"),
                       last_done=rows[r].get("last_done"), last_age=rows[r].get("last_age")) for r in sorted(rows)]),
        Evidence("%s: %s" % (who(behind), where_text(where)), command(behind, "backtrace"), behind)]
    vthread, vkey = main_stack(last.ranks[waiting[0]])
    evidence.append(Evidence("%s: %s" % (who(waiting), where_text(where_of(vkey, vthread,
                                                                            last.ranks[waiting[0]].library()))),
                             command(waiting, "backtrace"), waiting))
    victims = sorted({r for g in hung for r in g.waiting} - set(behind))
    for g in hung:
        if g is h:
            continue
        elsewhere = [r for r in g.waiting if r in h.behind or r not in waiting]
        if elsewhere:
            op_g = str(g.rows[g.waiting[0]].get("last_op") or "a collective")
            evidence.append(Evidence("%s wait%s in group %s's %s #%d, which %s did not issue" % (
                who(elsewhere), "s" if len(elsewhere) == 1 else "", g.pg, op_g, g.top, who(g.behind)),
                command(None, "query \"SELECT pg, collective_seq_id, op, state, retired, time_created FROM "
                              "torch.flight_recorder WHERE pg = '%s' ORDER BY collective_seq_id DESC LIMIT 3\""
                        % g.pg.replace("'", "''").replace('"', "")), elsewhere + g.behind))
    return Verdict("collective_hang", "stuck", summary, behind, victims, where, evidence, _hang_next(behind, command))


def waits_alone(ev: RankEvidence, found: Tuple[str, str, Any], window: float, command: Commands) -> Verdict:
    """One process of a job, waiting in a collective (``found``: from :func:`waiting_in`): the rank to blame
    is elsewhere, and only the job says which."""
    op, thread, key = found
    where = where_of(key, thread, ev.library())
    fr = [row for row in fr_by_pg(ev).values() if not row.get("last_done")]
    age = max((float(row.get("last_age") or 0) for row in fr), default=window)
    summary = "process %s waits in %s (no progress for %.1f s): the rank it waits for is elsewhere" % (
        ev.pid if ev.pid is not None else "", op, age)
    evidence = [Evidence("%s, the same stack over %.1f s with no CPU gained and no step" % (where_text(where), window),
                         command(None, "backtrace"), [ev.rank])]
    for row in fr:
        evidence.append(Evidence("Flight Recorder, group %s: #%s (%s) issued %.1f s ago, not done" % (
            row.get("pg"), row.get("last_seq"), row.get("last_op"), float(row.get("last_age") or 0)),
            command(None, "query \"SELECT * FROM torch.flight_recorder ORDER BY collective_seq_id DESC LIMIT 3\""),
            [ev.rank], [row]))
    return Verdict("collective_wait", "stuck" if age >= HANG_FLOOR_S * 5 else "degraded", summary, [], [],
                   where, evidence, ["diagnose the whole job to find the rank that did not join: probe MASTER:PROBE_PORT "
                                     "diagnose (or probe slurm:JOBID diagnose)"])


def _hang_next(culprits: List[int], command: Commands) -> List[str]:
    return ["see what %s does, with its C frames: %s" % (ranks_word(culprits), command(culprits[:1], "backtrace --native")),
            "why it did not reach the collective: a data loader, a rank-dependent branch, an exception caught and "
            "ignored; its locals: %s" % command(culprits[:1], "eval --frame MainThread:0 \"sorted(locals())\""),
            "save the state before restarting, into a directory every rank can write (DIR: choose one; it must "
            "exist): %s" % command(None, "checkpoint DIR/emergency-{rank}.pt")]


def _stack_hang(last: Sample, answering: List[int], in_collective: Dict[int, Any], window: float,
                who: Callable[[Sequence[int]], str], command: Commands) -> Optional[Verdict]:
    """From the stacks alone: ranks whose main thread stayed in a collective over the window (same stack, no
    CPU, no step) while the other ranks are outside it (or in another)."""
    if not in_collective or window < HANG_FLOOR_S:
        return None
    ops: Dict[str, List[int]] = {}
    for r, (op, _, _) in in_collective.items():
        ops.setdefault(op, []).append(r)
    op, waiting = max(ops.items(), key=lambda kv: (len(kv[1]), kv[0]))
    waiting.sort()
    outside = sorted(r for r in answering if r not in waiting)
    if not outside:
        return None  # every rank in the same collective: no rank is missing from it by the stacks
    thread, key = main_stack(last.ranks[outside[0]])
    where = where_of(key, thread, last.ranks[outside[0]].library())
    summary = "collective hang: %s did not enter %s; %s wait%s in it (no progress for %.1f s)" % (
        who(outside), op, who(waiting), "s" if len(waiting) == 1 else "", window)
    vthread, vkey = main_stack(last.ranks[waiting[0]])
    evidence = [Evidence("%s: %s, the same stack over %.1f s with no CPU gained and no step"
                         % (who(waiting), where_text(where_of(vkey, vthread, last.ranks[waiting[0]].library())), window),
                         command(waiting, "backtrace"), waiting),
                Evidence("%s: %s, outside %s" % (who(outside), where_text(where), op), command(outside, "backtrace"),
                         outside),
                Evidence("the Flight Recorder is off: the collective's number is not known "
                         "(TORCH_FR_BUFFER_SIZE=2000 at the job's start records it)", None, [])][
                    :3 if any(last.ranks[r].fr_why for r in answering) else 2]
    return Verdict("collective_hang", "stuck", summary, outside, waiting, where, evidence, _hang_next(outside, command))
