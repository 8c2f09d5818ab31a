"""The words of a record made at ranks' deaths, and their amending once the launcher has said more.

A death is ``(died_at, rank, pid, cause)``: when (a crash record's time; inf where it has none), which rank
and process, and its crash record's cause. The record's reason names the first to die, its own death
first: the others often die of it (an exception of a closed connection, the launcher's SIGTERM to the
rest), and a death without a word (SIGKILL, the OOM killer) has no time of its own.

torchrun logs a rank's exit code only once it has ended the other ranks (``probe.host.exits``), often after
the watch recorded the death: :func:`reword` rewrites the record's reason, and the dead ranks' evidence,
when the words have become more exact since.
"""

import math
import os
from typing import Any, Dict, List, Sequence, Tuple

from probe.host import exits

__all__ = ["Death", "reason", "consequence_of_another", "reword", "patched"]

Death = Tuple[float, int, int, str]


def consequence_of_another(cause: str) -> bool:
    """Whether a death of this cause is how ranks die of another rank's death: the launcher's SIGTERM to the
    rest, or an uncaught exception (a collective whose peer is gone raises one). Other signals, a death
    without a word, and os._exit are a rank's own."""
    return cause.startswith(("SIGTERM (terminated)", "uncaught exception", "ended by the launcher"))


def reason(deaths: Sequence[Death]) -> str:
    """``rank N died: HOW; then rank M: ...``, in the words known now."""
    worded = sorted(((at if math.isfinite(at) else math.inf, rank, exits.death_words(pid, cause))
                     for at, rank, pid, cause in deaths), key=lambda d: (consequence_of_another(d[2]), d[0], d[1]))
    (_, rank, cause), rest = worded[0], worded[1:]
    also = "; then %s" % ", ".join("rank %d: %s" % (r, c.split(":")[0]) for _, r, c in rest[:3]) \
        if rest else ""
    return "rank %d died: %s%s%s" % (rank, cause, also, ", ..." if len(rest) > 3 else "")


def reword(directory: str, deaths: Sequence[Death], old: str) -> str:
    """Rewrite the record in ``directory`` where its words, ``old``, have become more exact; the words now."""
    from probe.snapshot import record

    new = reason(deaths)
    if new == old:
        return old
    dead = {pid for _, _, pid, _ in deaths}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.startswith("meta-") and name.endswith(".json"):
            meta = record.read_meta(path)
            meta["reason"] = new
            record.write_meta(directory, meta)
        elif name.startswith("rank-") and name.endswith(".json"):
            rec = record.read_rank(path)
            rec["reason"] = new
            if rec.get("pid") in dead:
                exits.amend_record(rec, int(rec["pid"]))
            record.write_rank(directory, rec)
    return new


def patched(records: List[Dict[str, Any]], members: Sequence[Any], dead: Sequence[bool], words: str) -> None:
    """Records just captured: each says ``words`` as its reason, each dead rank's how it ended."""
    for member, rec, is_dead in zip(members, records, dead):
        rec["reason"] = words
        if is_dead:
            exits.amend_record(rec, member.pid)
