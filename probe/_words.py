"""Small wording helpers shared by every part that writes sentences for people (no imports of probe's own)."""

import re
from typing import Dict, Iterable, Optional

__all__ = ["span", "listed", "for_target", "age_text"]


def span(low: float, high: float, fmt: str = "%d", unit: str = "", close: float = 0.0) -> str:
    """``low-high`` with ``unit`` after it, or one value where the two are one (within ``close``, or equal as
    written): a range of one value reads ``82 steps``, never ``82-82 steps``."""
    one, other = fmt % low, fmt % high
    text = one if one == other or abs(high - low) <= close else "%s-%s" % (one, other)
    return text + (" " + unit if unit else "")


def listed(why: Dict[str, object], label: str = "rank", limit: Optional[int] = None) -> str:
    """``rank 1: why; rank 3: why`` for a mapping of names to reasons, in the names' order (numbers as
    numbers), instead of a dict's repr in a log line."""
    keys: Iterable[str] = sorted(why, key=lambda k: (0, int(k), "") if str(k).isdigit() else (1, 0, str(k)))
    parts = ["%s %s: %s" % (label, k, why[k]) for k in keys]
    if limit is not None and len(parts) > limit:
        parts = parts[:limit] + ["%d more" % (len(parts) - limit)]
    return "; ".join(parts)


_PLACEHOLDER = re.compile(r"\bprobe (?:TARGET|PID)(?= )")


def for_target(text: str, target: Optional[str]) -> str:
    """``text`` with the placeholders of a command (``probe TARGET backtrace``, ``probe PID inject``) made
    the command to type for ``target``, where the words were written without knowing it (the agent, a table)."""
    if not target or not text:
        return text
    shown = target if re.fullmatch(r"[\w.:\[\]@/-]+", target) else "'%s'" % target.replace("'", "'\\''")
    return _PLACEHOLDER.sub(lambda _: "probe " + shown, text)


def age_text(seconds: float) -> str:
    """How long ago, in the largest unit that fits: ``12 s ago``, ``3 min ago``, ``2 h ago``, ``4 d ago``."""
    seconds = max(0.0, seconds)
    for unit, scale in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= scale:
            return "%.0f %s ago" % (seconds / scale, unit)
    return "%.0f s ago" % seconds
