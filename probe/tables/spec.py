"""The declarative spec of a virtual table: name, description, typed columns, and where rows come from.

Runs inside the target: stdlib only, Python 3.9+.
"""

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence, Tuple

__all__ = ["Column", "TableSpec", "COLUMN_TYPES", "RowsFn"]

#: SQL types a column may declare; each maps to one Arrow type (see ``probe.tables.arrow``).
COLUMN_TYPES = ("BOOLEAN", "INTEGER", "BIGINT", "DOUBLE", "VARCHAR", "TIMESTAMP", "VARCHAR[]")

_NAME = re.compile(r"^[a-z_][a-z0-9_]*\.[a-z_][a-z0-9_]*$")
_COLUMN = re.compile(r"^[a-z_][a-z0-9_]*$")

RowsFn = Callable[[], Iterable[Any]]


@dataclass(frozen=True)
class Column:
    """One typed, described column. ``type`` is one of :data:`COLUMN_TYPES`."""

    name: str
    type: str
    description: str = ""

    def __post_init__(self) -> None:
        if not _COLUMN.match(self.name):
            raise ValueError("column name %r must be lower-case letters, digits and underscores" % self.name)
        if self.type not in COLUMN_TYPES:
            raise ValueError("column %r: type %r is not one of %s" % (self.name, self.type, ", ".join(COLUMN_TYPES)))


@dataclass(frozen=True)
class TableSpec:
    """A virtual table. ``rows`` is called once per query that names the table.

    ``rows()`` returns an iterable of tuples (in column order) or of dicts keyed by column name.
    """

    name: str
    description: str
    columns: Tuple[Column, ...]
    rows: RowsFn
    example: Optional[str] = None

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError("table name %r must look like 'namespace.table' (lower case)" % self.name)
        if not self.columns:
            raise ValueError("table %r has no columns" % self.name)
        names = [c.name for c in self.columns]
        if len(set(names)) != len(names):
            raise ValueError("table %r declares a column twice" % self.name)

    @property
    def column_names(self) -> Sequence[str]:
        return [c.name for c in self.columns]

    def describe(self) -> dict:
        """The spec as JSON-ready data, for ``/v1/tables``."""
        return {
            "name": self.name,
            "description": self.description,
            "columns": [{"name": c.name, "type": c.type, "description": c.description} for c in self.columns],
            "example": self.example,
        }
