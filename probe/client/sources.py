"""One kind of source: whatever a command reads answers the same calls.

A source is one rank (or one process) that a command reads: a live agent (unix socket or TCP), the
same process read from outside when its agent cannot answer (GIL held, stopped, dead: the live
client falls back to it by itself), a core file, one rank of a snapshot record or of torch's Flight
Recorder dumps. Each answers :class:`Source`: the tables it has, rows of a table (the columns asked
for), SQL over them, stacks, health, and it says what it cannot do (``refuses``: eval and the other
calls that need a live process, on a record). A node helper's gathered answers stand for many ranks
at once, as :class:`probe.client.cluster.Cluster` does (``probe.client.via_helpers``).

The client knows the wire and this interface, never the packages built on it: a source kind defined
above it (``snapshot:PATH``, in ``probe.snapshot.target``) registers itself here when its module is
imported (:func:`register_kind`), and :func:`probe.client.connect` and
:func:`probe.client.cluster.connect_all` open a target of that prefix through it. Whoever offers such
targets imports the registering module first: the CLI where a target names the prefix, ``probe.connect``
(``probe/__init__.py``) on first use. This module imports nothing, so that the fast commands pay nothing.
"""

from typing import TYPE_CHECKING, Any, Callable, Dict, FrozenSet, List, NamedTuple, Optional, Protocol

if TYPE_CHECKING:  # names only, for the protocol's signatures
    from probe.client.results import EvalResult, Frame, Rows, TableInfo
    from probe.client.targets import Target

__all__ = ["Source", "SourceKind", "register_kind", "kind_for", "registered_prefixes", "LIVE_ONLY"]

LIVE_ONLY: FrozenSet[str] = frozenset({"eval", "interrupt_eval", "complete", "checkpoint", "trace", "debug_start",
                                       "debug_stop"})
"""The calls only a live process answers: a record's source lists them in ``refuses``."""


class Source(Protocol):
    """What every source answers. ``probe.client.Client`` (a live agent, falling back to reading the
    process or its core from outside) and ``probe.snapshot.target.RecordClient`` (a rank as recorded)
    satisfy it; ``diagnose`` reads its evidence through these calls, live or recorded.

    ``target``: what the user wrote, parsed; ``note``: set by the last call when the answer did not come
    from an agent (where it came from, and why); ``refuses``: the calls this source cannot make (they
    raise a :class:`probe.errors.ProbeError` that says why), empty for a live agent."""

    target: "Target"
    note: Optional[str]
    refuses: FrozenSet[str]

    def health(self, fallback: bool = True) -> Dict[str, Any]:
        """Who it is (pid, host, rank, ...); with ``fallback``, a source that cannot answer says its state."""
        ...

    def tables(self) -> List["TableInfo"]:
        """The tables it has, with their columns."""
        ...

    def schema(self, name: str) -> "TableInfo":
        """One table's columns (:class:`probe.errors.NotFound` where it has no such table)."""
        ...

    def table_rows(self, name: str, max_rows: Optional[int] = None, columns: Optional[List[str]] = None) -> "Rows":
        """The rows of one table, as produced (no SQL); ``columns``: only those asked for."""
        ...

    def backtrace(self, native: bool = False, fallback: bool = True) -> List["Frame"]:
        """Every thread's stack, innermost frame first within each thread; without ``fallback``, only
        what the agent itself answers (else its error, which says why and what was read instead)."""
        ...

    def query_rows(self, sql: str, max_rows: Optional[int] = None, timeout: Optional[float] = None,
                   native: bool = False, query_id: Optional[str] = None) -> "Rows":
        """SQL over its tables, as plain rows (where the SQL runs is the source's affair)."""
        ...

    def query(self, sql: str, max_rows: Optional[int] = None, timeout: Optional[float] = None,
              native: bool = False, query_id: Optional[str] = None) -> Any:
        """SQL over its tables, as a ``pyarrow.Table``."""
        ...

    def interrupt_query(self, query_id: str) -> str:
        """Stop the query sent with ``query_id``."""
        ...

    def eval(self, code: str, timeout: Optional[float] = None, on: str = "agent", frame: Optional[str] = None,
             wait: Optional[float] = None, eval_id: Optional[str] = None,
             origin: Optional[str] = None) -> "EvalResult":
        """Run Python in the process (refused by a record: ``"eval" in refuses``)."""
        ...


class SourceKind(NamedTuple):
    """How targets of one prefix open: ``one(text)`` gives the source of ``probe TARGET COMMAND``;
    ``every(text, deadline, max_in_flight)`` the ranks of ``--all-ranks`` (a ``Cluster``), None where the
    kind has no ranks; ``what``: a few words for errors."""

    one: Callable[[str], Any]
    every: Optional[Callable[[str, float, int], Any]] = None
    what: str = ""


_KINDS: Dict[str, SourceKind] = {}
_DEFINED_IN = {"snapshot:": "probe.snapshot.target"}
"""Where the kinds probe ships are defined, for the error that names what to import (never imported here)."""


def register_kind(prefix: str, kind: SourceKind) -> None:
    """Open targets that start with ``prefix`` (``"snapshot:"``) through ``kind``; a later registration of
    the same prefix replaces the earlier one."""
    _KINDS[prefix] = kind


def registered_prefixes() -> List[str]:
    return sorted(_KINDS)


def kind_for(text: str) -> Optional[SourceKind]:
    """The registered kind whose prefix ``text`` starts with; None where none does. A target of a kind
    probe ships whose module was not imported is a usage error that names the module."""
    from probe.errors import UsageError

    stripped = text.strip()
    for prefix, kind in _KINDS.items():
        if stripped.startswith(prefix):
            return kind
    for prefix, module in _DEFINED_IN.items():
        if stripped.startswith(prefix):
            raise UsageError("no source kind for %s targets is registered in this process" % prefix,
                             hint="import %s first (the probe command and probe.connect do)" % module)
    return None
