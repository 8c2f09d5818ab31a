"""The lines of "not known" under a diagnosis: what evidence could not be had, on which ranks, why, in one
line each (an engine's message can span several), and the probe command that turns it on where one does
(`probe T trace start` for the trace's steps and each module's time)."""

from typing import Callable, Dict, List, Optional, Sequence

from probe.diagnose.evidence import Sample
from probe.diagnose.verdict import Commands

__all__ = ["unavailable", "with_how", "said"]

_HOW = {"trace": ("records each step and each module's time", "trace start"),
        "NaN/Inf check": ("checks every traced output for NaN/Inf", "trace start --anomalies")}
"""What turns on the evidence a line of "not known" says is missing: (what it gives, the probe command)."""


def unavailable(last: Sample, answering: List[int], who: Callable[[Sequence[int]], str],
                 command: Optional[Commands] = None) -> List[str]:
    out = []
    ranks = last.ranks
    for what, attr in (("Flight Recorder", "fr_why"), ("trace", "trace_why"), ("threads' CPU", "threads_why")):
        reasons: Dict[str, List[int]] = {}
        for r in answering:
            why = getattr(ranks[r], attr)
            if why:
                reasons.setdefault(why, []).append(r)  # by the text as sent: each distinct one read once below
        lines: Dict[str, List[int]] = {}
        for why, rs in reasons.items():
            lines.setdefault(said(why), []).extend(rs)
        reasons = {why: sorted(rs) for why, rs in lines.items()}
        for why, rs in sorted(reasons.items()):
            out.append("%s: %s on %s" % (what, why, who(rs)))
    return with_how(out, command, last.recorded)


def said(why: str) -> str:
    """An error's words on one line (an engine's message can span several)."""
    lines = [line.strip() for line in str(why).splitlines() if line.strip()]
    return lines[0] if lines else str(why)


def with_how(lines: List[str], command: Optional[Commands], recorded: bool) -> List[str]:
    """Each line of "not known" whose evidence a probe command turns on, with that command (not for a record:
    its process is not there to be asked)."""
    if command is None or recorded:
        return lines
    out = []
    for line in lines:
        what = line.split(":", 1)[0]
        if what in _HOW and "torch is not loaded" not in line and "cannot answer" not in line:
            gives, rest = _HOW[what]
            line += " (`%s` %s)" % (command(None, rest), gives)
        out.append(line)
    return out
