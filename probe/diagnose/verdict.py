"""What every family of ``probe diagnose``'s rules speaks in: a verdict and its evidence, the report, the
exit statuses, and the words for ranks and places.

Kept apart from the judge (:mod:`probe.diagnose.rules`) and from the families it calls, so that a family
module imports this one and the judge imports the families, never the reverse: no import circle.
"""

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["STATUSES", "EXIT_CODES", "CPU_RAN_S", "HANG_FLOOR_S", "Commands", "Evidence", "Verdict", "Report",
           "ranks_word", "short_path", "where_of", "where_text"]

STATUSES = ("healthy", "degraded", "stuck", "dead")
EXIT_CODES = {"healthy": 0, "degraded": 10, "stuck": 11, "dead": 12}
"""The exit status of ``probe diagnose``: apart from probe's own (1-7, 130)."""

CPU_RAN_S = 0.02  # a thread that gained this much CPU over the window ran
HANG_FLOOR_S = 2.0  # a collective (or a lock, a loader) waited in for less is no hang, whatever else

Commands = Callable[[Optional[Sequence[int]], str], str]
"""(ranks or None for all, the command's rest) -> the probe command line that shows it."""


@dataclass
class Evidence:
    text: str
    command: Optional[str] = None
    ranks: List[int] = field(default_factory=list)
    rows: List[Dict[str, Any]] = field(default_factory=list)

    def as_json(self) -> Dict[str, Any]:
        return {"text": self.text, "command": self.command, "ranks": self.ranks, "rows": self.rows}


@dataclass
class Verdict:
    kind: str
    status: str
    summary: str
    culprits: List[int] = field(default_factory=list)
    victims: List[int] = field(default_factory=list)
    where: Optional[Dict[str, Any]] = None
    evidence: List[Evidence] = field(default_factory=list)
    next: List[str] = field(default_factory=list)

    def as_json(self) -> Dict[str, Any]:
        return {"kind": self.kind, "status": self.status, "summary": self.summary, "culprits": self.culprits,
                "victims": self.victims, "where": self.where, "evidence": [e.as_json() for e in self.evidence],
                "next": self.next}


@dataclass
class Report:
    status: str
    verdicts: List[Verdict]
    unavailable: List[str]
    window: float
    samples: int
    progress: Dict[int, Dict[str, Any]]

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    def as_json(self) -> Dict[str, Any]:
        return {"status": self.status, "exit_code": self.exit_code, "verdicts": [v.as_json() for v in self.verdicts],
                "unavailable": self.unavailable, "window_s": round(self.window, 3), "samples": self.samples,
                "progress": {str(r): p for r, p in sorted(self.progress.items())}}


def ranks_word(ranks: Sequence[int], single: bool = False, pid: Optional[int] = None) -> str:
    from probe.client.cluster import compact_ranks

    if single:
        return "process %d" % pid if pid is not None else "the process"
    return ("rank %s" if len(ranks) == 1 else "ranks %s") % compact_ranks(ranks)


def short_path(path: str) -> str:
    """A file's path from its installed package on (``torch/nn/modules/module.py``); others as they are."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path[path.index(marker) + len(marker):]
    return path


def where_of(key: Sequence[Tuple[str, str, int, str]], thread: str, library: Any = None) -> Optional[Dict[str, Any]]:
    """The innermost frame of a stack, and the innermost of the program's own frames when that one is a
    library's: ``{"func", "file", "line", "thread", "called_from"}``. ``library``: the process's layout
    (``RankEvidence.library()``; this host's where not given)."""
    if not key:
        return None
    if library is None:
        from probe.diagnose.library import local_layout

        library = local_layout()
    top = key[0]
    out: Dict[str, Any] = {"func": top[0], "file": top[1], "line": top[2], "thread": thread}
    if library.holds(top[1]):
        own = next((f for f in key if not library.holds(f[1])), None)
        if own is not None:
            out["called_from"] = {"func": own[0], "file": own[1], "line": own[2]}
    return out


def where_text(where: Optional[Dict[str, Any]]) -> str:
    if not where:
        return "(no stack)"
    text = "%s (%s:%d)" % (where["func"], short_path(where["file"]), where["line"])
    if where.get("called_from"):
        own = where["called_from"]
        text += " called from %s (%s:%d)" % (own["func"], own["file"], own["line"])
    return text + ", thread %s" % where["thread"]
