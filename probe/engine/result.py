"""The result of one query: an Arrow table plus whether the row cap cut it short."""

from dataclasses import dataclass
from typing import Any, Dict, List

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
        columns = [col.to_pylist() for col in self.table.columns]
        return [list(row) for row in zip(*columns)] if columns else []

    def to_json_dict(self) -> Dict[str, Any]:
        return {"columns": self.columns(), "rows": self.rows(), "truncated": self.truncated,
                "row_count": self.table.num_rows, "elapsed_ms": round(self.elapsed_ms, 3)}
