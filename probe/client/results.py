"""What the client returns: immutable records, rendered by the CLI and used by scripts.

NamedTuples rather than frozen dataclasses: the CLI imports these on every command, and defining a
dataclass costs about eight times as much as a NamedTuple.
"""

from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

__all__ = ["Rows", "by_rank", "EvalResult", "Frame", "ColumnInfo", "TableInfo", "StackKey", "thread_stacks"]


class Rows(NamedTuple):
    """A query result as columns and row-major values; ``truncated`` when the row cap cut it."""

    columns: Tuple[Tuple[str, str], ...]  # (name, type)
    rows: List[List[Any]]
    truncated: bool = False
    row_cap: Optional[int] = None  # the cap the agent applied, where it said

    @property
    def column_names(self) -> List[str]:
        return [name for name, _ in self.columns]

    def as_dicts(self) -> List[Dict[str, Any]]:
        names = self.column_names
        return [dict(zip(names, row)) for row in self.rows]

    def with_column(self, name: str, value: Any) -> "Rows":
        """The same rows with a constant first column (the ``target`` column of multi-target runs)."""
        return Rows(((name, "string"),) + self.columns, [[value] + list(r) for r in self.rows], self.truncated,
                    self.row_cap)

    def without_columns(self, names: Sequence[str]) -> "Rows":
        """The same rows less the columns ``names``: a rank's own ``rank`` column (torch.profile's, the trace's),
        which the rank a fan-out asked stands for, so that the union has one."""
        keep = [i for i, column in enumerate(self.columns) if column[0] not in names]
        if len(keep) == len(self.columns):
            return self
        return Rows(tuple(self.columns[i] for i in keep), [[row[i] for i in keep] for row in self.rows],
                    self.truncated, self.row_cap)

    @staticmethod
    def concat(parts: Sequence["Rows"]) -> "Rows":
        if not parts:
            return Rows((), [])
        rows: List[List[Any]] = []
        for part in parts:
            rows.extend(part.rows)
        return Rows(parts[0].columns, rows, any(p.truncated for p in parts), parts[0].row_cap)


def by_rank(parts: Sequence[Tuple[int, str, Rows]]) -> Rows:
    """Each rank's rows with ``rank`` and ``host`` first, as one result. A table that has a column of that
    name itself (torch.distributed's ``rank``) keeps it once: where it says what the added one says on
    every row, the table's own goes; where it differs, it stays as ``table_rank`` (``table_host``)."""
    if not parts:
        return Rows((), [])
    names = parts[0][2].column_names
    drop, rename = set(), {}
    for position, key in ((0, "rank"), (1, "host")):
        if key not in names:
            continue
        at = names.index(key)
        if all(str(row[at]) == str(part[position]) for part in parts for row in part[2].rows):
            drop.add(at)
        else:
            rename[at] = "table_" + key
    columns = (("rank", "BIGINT"), ("host", "string")) + tuple(
        (rename.get(i, name), kind) for i, (name, kind) in enumerate(parts[0][2].columns) if i not in drop)
    rows: List[List[Any]] = []
    for rank, host, part in parts:
        rows.extend([rank, host] + [v for i, v in enumerate(row) if i not in drop] for row in part.rows)
    return Rows(columns, rows, any(p.truncated for _, _, p in parts), parts[0][2].row_cap)


def own_columns(parts: List[Tuple[int, str, Any]]) -> Dict[str, bool]:
    """The arrow tables' own ``rank``/``host`` columns: name -> whether to keep it (as ``table_NAME``, where
    it differs from the rank's) or drop it (it says what the added column says)."""
    out: Dict[str, bool] = {}
    if not parts:
        return out
    for position, key in ((0, "rank"), (1, "host")):
        if key in parts[0][2].column_names:
            out[key] = any(str(v) != str(part[position]) for part in parts for v in part[2].column(key).to_pylist())
    return out


class EvalResult(NamedTuple):
    """What a snippet printed, its value and its error, as text: the objects stay in the target."""

    stdout: str
    stderr: str
    value: Optional[str]
    """The ``repr()`` of the snippet's last expression, as a string (cut past 64 KiB, ending
    ``...[truncated]``), not the object; None when the last statement is no expression or its value is
    None. The object stays in the target (in ``__main__`` as ``_``). For data, print it as JSON and parse ``stdout``, or
    read it with SQL (``query``)."""
    error: Optional[str]
    """What went wrong, as text (the traceback, when the snippet raised); None when nothing did."""
    timed_out: bool = False
    limits: Optional[Dict[str, Any]] = None
    """What the agent applied: ``timeout_s``, ``timeout_ceiling_s``, ``max_output``, and ``stdout_dropped``/
    ``stderr_dropped`` (characters cut past ``max_output``) where anything was cut."""

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out


class Frame(NamedTuple):
    thread_id: int
    thread_name: Optional[str]
    native_id: Optional[int]
    is_main: bool
    depth: int
    func: str
    file: str
    lineno: int
    code: Optional[str] = None
    frame_type: str = "python"  # "native" for a C frame (read from outside the process)

    def as_row(self) -> Dict[str, Any]:
        """The frame as a row of python.backtrace."""
        return {"thread_id": self.thread_id, "thread_name": self.thread_name, "native_id": self.native_id,
                "is_main": self.is_main, "depth": self.depth, "func": self.func, "file": self.file,
                "lineno": self.lineno, "frame_type": self.frame_type, "code": self.code}


class ColumnInfo(NamedTuple):
    name: str
    type: str
    description: str


class TableInfo(NamedTuple):
    name: str
    description: str
    columns: Tuple[ColumnInfo, ...]
    example: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        return {"name": self.name, "description": self.description, "example": self.example,
                "columns": [c._asdict() for c in self.columns]}

    @classmethod
    def from_json(cls, raw: Dict[str, Any]) -> "TableInfo":
        columns = tuple(ColumnInfo(c["name"], c["type"], c.get("description", "")) for c in raw.get("columns", []))
        return cls(raw["name"], raw.get("description", ""), columns, raw.get("example"))


StackKey = Tuple[Tuple[str, str, int], ...]  # (func, file, lineno), innermost first


def thread_stacks(frames: Sequence[Any]) -> Dict[str, StackKey]:
    """Thread name -> its stack, from a process's frames (each with ``thread_id``, ``thread_name``,
    ``is_main``, ``depth``, ``func``, ``file``, ``lineno``): what ranks are grouped by, in the client and
    in the node helpers alike. Threads that share a name get ``name#2``, ``name#3`` in ident order."""
    by_thread: Dict[int, List[Any]] = {}
    for frame in frames:
        by_thread.setdefault(frame.thread_id, []).append(frame)
    out: Dict[str, StackKey] = {}
    ordered = sorted(by_thread.values(), key=lambda fs: (not fs[0].is_main, fs[0].thread_name or "", fs[0].thread_id))
    for stack in ordered:
        name = "MainThread" if stack[0].is_main else (stack[0].thread_name or "?")
        unique, n = name, 1
        while unique in out:
            n += 1
            unique = "%s#%d" % (name, n)
        out[unique] = tuple((f.func, f.file, f.lineno) for f in sorted(stack, key=lambda f: f.depth))
    return out
