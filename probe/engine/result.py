"""The result of one query: an Arrow table plus whether the row cap cut it short."""

from dataclasses import dataclass
from typing import Any, Dict, Iterator, List

__all__ = ["QueryResult"]


@dataclass(frozen=True)
class QueryResult:
    table: Any  # pyarrow.Table
    truncated: bool
    elapsed_ms: float

    def columns(self) -> List[Dict[str, str]]:
        return [{"name": f.name, "type": str(f.type)} for f in self.table.schema]

    def rows(self) -> List[List[Any]]:
        """Row-major values, for JSON."""
        columns = [_plain_column(col) for col in self.table.columns]
        return [list(row) for row in zip(*columns)] if columns else []

    def row_chunks(self, size: int) -> Iterator[List[List[Any]]]:
        """Row-major values, ``size`` rows at a time (each conversion holds the GIL only that long)."""
        for start in range(0, self.table.num_rows, size):
            piece = self.table.slice(start, size)
            columns = [_plain_column(col) for col in piece.columns]
            yield [list(row) for row in zip(*columns)]

    def json_head(self) -> Dict[str, Any]:
        """Everything of the JSON answer but the rows."""
        return {"columns": self.columns(), "truncated": self.truncated, "row_count": self.table.num_rows,
                "elapsed_ms": round(self.elapsed_ms, 3)}

    def to_json_dict(self) -> Dict[str, Any]:
        return dict(self.json_head(), rows=self.rows())


def _plain_column(column: Any) -> List[Any]:
    """A column's values for JSON: a BLOB as DuckDB writes it (printable ASCII, else \\xNN), not b'...'."""
    values = column.to_pylist()
    if values and "binary" in str(column.type):
        return [None if v is None else "".join(chr(b) if 32 <= b < 127 and b != 92 else "\\x%02X" % b for b in v)
                for v in values]
    return values
