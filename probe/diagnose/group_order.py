"""A deadlock across process groups: ranks that each wait in a collective of one group which others have
not issued, because those others wait in a collective of another group.

Two ranks in two groups show it plainly: rank 0 waits in the world's ``barrier`` #21, which rank 1 has not
issued; rank 1 waits in a subgroup's ``all_reduce`` #1, which rank 0 has not issued. Each group alone looks
like a hang with a culprit, and either verdict would blame a rank that only waits. What is true is that
the ranks issue the groups' collectives in different orders; nothing recorded says whose order is wrong, so
every rank in the cycle is named and none is called a mere victim. :mod:`probe.diagnose.collectives`
decides that it is one (every rank behind in a hung group waits in another hung group) and calls
:func:`deadlock`; both say who is behind in a group with :func:`behind_text`.
"""

from typing import Any, Callable, Dict, List, Sequence

from probe.diagnose.evidence import Sample, main_stack
from probe.diagnose.verdict import Commands, Evidence, Verdict, ranks_word, where_of, where_text

__all__ = ["behind_text", "deadlock"]

Who = Callable[[Sequence[int]], str]


def behind_text(who: Callable[[Sequence[int]], str], behind: List[int], rows: Dict[int, Dict[str, Any]]) -> str:
    """``rank 1's last is #20``; a member with no entry of the group: ``rank 0 issued none of its collectives``."""
    none = [r for r in behind if rows[r].get("none_recorded")]
    some = [r for r in behind if r not in none]
    parts = []
    if some:
        parts.append("%s's last is %s" % (who(some), ",".join("#%d" % n for n in sorted({int(rows[r]["last_seq"])
                                                                                         for r in some}))))
    if none:
        parts.append("%s, a member, issued none of its collectives (no entry of the group recorded)" % who(none))
    return "; ".join(parts)


def deadlock(last: Sample, hung: List[Any], who: Who, command: Commands) -> Verdict:
    """The verdict on ``hung`` (``collectives.Hung``: group, number, waiting, behind, rows), where every rank
    behind in one of them waits in another."""
    involved = sorted({r for h in hung for r in h.waiting + h.behind})
    parts = []
    evidence = []
    for h in hung:
        fr_cmd = command(None, "query \"SELECT pg, collective_seq_id, op, state, retired, time_created FROM "
                               "torch.flight_recorder WHERE pg = '%s' ORDER BY collective_seq_id DESC LIMIT 3\""
                         % h.pg.replace("'", "''").replace('"', ""))
        op = str(h.rows[h.waiting[0]].get("last_op") or "a collective")
        said = h.rows[h.waiting[0]].get("pg_desc")
        desc = " (%s)" % said if said not in (None, "", "undefined") else ""  # torch's word for a group not named
        parts.append("%s wait%s in group %s%s's %s #%d, which %s did not issue" % (
            who(h.waiting), "s" if len(h.waiting) == 1 else "", h.pg, desc, op, h.top, who(h.behind)))
        age = min(float(h.rows[r].get("last_age") or 0) for r in h.waiting)
        evidence.append(Evidence(
            "Flight Recorder, group %s: %s issued #%d (%s) %.1f s ago and it is not done; %s" % (
                h.pg, who(h.waiting), h.top, op, age, behind_text(who, h.behind, h.rows)),
            fr_cmd, h.waiting + h.behind,
            [dict(rank=r, pg=h.pg, last_seq=None if row.get("none_recorded") else row["last_seq"],
                  last_op=row.get("last_op"), last_done=row.get("last_done"), last_age=row.get("last_age"))
             for r, row in sorted(h.rows.items())]))
    where = None
    for r in involved:
        ev = last.ranks.get(r)
        if ev is None:
            continue
        thread, key = main_stack(ev)
        at = where_of(key, thread, ev.library())
        where = where or at
        evidence.append(Evidence("%s: %s" % (who([r]), where_text(at)), command([r], "backtrace"), [r]))
    summary = ("collective deadlock across process groups: %s; each waits for a rank that waits elsewhere: the "
               "ranks issue these groups' collectives in different orders (whose order is wrong is not recorded)"
               % "; ".join(parts))
    nexts = ["make every rank issue the collectives of these groups in the same order: look for a rank-dependent "
             "branch, or a subgroup's collective that some ranks reach before the other group's",
             "how %s got there, with the C frames: %s" % (ranks_word(involved), command(involved[:1],
                                                                                      "backtrace --native")),
             "save the state before restarting, into a directory every rank can write (DIR: choose one; it must "
             "exist): %s" % command(None, "checkpoint DIR/emergency-{rank}.pt")]
    return Verdict("collective_deadlock", "stuck", summary, involved, [], where, evidence, nexts)
