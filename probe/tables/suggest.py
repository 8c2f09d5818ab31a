"""The table a user meant where a name is a slip of one (``python.threds``, ``threads``): said in the error
instead of DuckDB's own guess, which names its catalog (``pg_prepared_statements``), never probe's tables."""

import difflib
import re
from typing import Iterable, List, Optional

__all__ = ["meant_table", "named_after_from"]

_FROM = re.compile(r'(?i)\b(?:from|join)\s+"?([A-Za-z_][\w]*(?:"?\."?[A-Za-z_][\w]*)?)"?')


def meant_table(name: str, listed: Iterable[str]) -> Optional[str]:
    """The listed table ``name`` is a slip of: the one whose short name it is, or the closest by spelling."""
    tables = sorted(listed)
    if name in tables:
        return None
    short = {t.split(".", 1)[-1]: t for t in tables}
    if name in short:
        return short[name]
    close = difflib.get_close_matches(name, tables, n=1, cutoff=0.75)
    return close[0] if close else None


def named_after_from(sql: str) -> List[str]:
    """The names written after FROM and JOIN (a suggestion's candidates only: what the query really reads
    is DuckDB's to decide)."""
    return [m.group(1).replace('"', "") for m in _FROM.finditer(sql)]
