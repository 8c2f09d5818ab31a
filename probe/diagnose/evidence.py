"""The evidence ``probe diagnose`` judges: per rank, what was read without harming it, kept whole.

:class:`RankEvidence` is one rank's look (its state, stacks, threads' CPU, the Flight Recorder's last
collectives, the trace's steps, the step counter's rows, and each family's own part: ``training``,
``memory``), a :class:`Sample` every rank's at one moment. :mod:`probe.diagnose.gather` fills them in
live; a snapshot record reads them back (:mod:`probe.snapshot.record`). What could not be had is kept
with why (``*_why``), never filled in.

This module imports no family of rules: they read it, and the gathering that calls them lies above.
"""

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from probe.client.results import Frame
from probe.errors import ProbeError

__all__ = ["RankEvidence", "Sample", "STATES", "FR_SQL", "TRACE_SQL", "THREADS_SQL", "agent_frames", "main_stack",
           "fr_by_pg"]

THREADS_SQL = ("SELECT thread_id, thread_name, is_main, is_agent, CASE WHEN cpu_user IS NULL THEN NULL "
               "ELSE cpu_user + coalesce(cpu_system, 0) END AS cpu FROM python.threads")
"""Each thread's CPU seconds: a thread blocked for good gains none, one that runs gains some."""

FR_SQL = """\
WITH e AS (SELECT *, max(collective_seq_id) OVER (PARTITION BY pg) AS top_seq FROM torch.flight_recorder
  WHERE NOT coalesce(is_p2p, false) AND collective_seq_id IS NOT NULL),
  g AS (SELECT group_name, any_value(group_ranks) AS group_ranks FROM torch.distributed WHERE initialized
    GROUP BY group_name)
SELECT f.*, g.group_ranks FROM (SELECT pg, any_value(pg_desc) AS pg_desc, max(collective_seq_id) AS last_seq,
  arg_max(op, collective_seq_id) AS last_op,
  arg_max(coalesce(retired, false) OR state = 'completed', collective_seq_id) AS last_done,
  epoch(now()) - epoch(arg_max(time_created, collective_seq_id)) AS last_age,
  (epoch(max(time_created)) - epoch(min(time_created))) / greatest(count(*) - 1, 1) AS period,
  arg_max(call_site, collective_seq_id) AS call_site, count(*) AS entries,
  arg_max(input_sizes, collective_seq_id) AS last_sizes, arg_max(input_dtypes, collective_seq_id) AS last_dtypes,
  string_agg(CASE WHEN collective_seq_id > top_seq - 8 THEN concat_ws(chr(9), collective_seq_id, coalesce(op, ''),
    coalesce(input_sizes, ''), coalesce(input_dtypes, '')) END, chr(10) ORDER BY collective_seq_id) AS recent
FROM e GROUP BY pg) f
LEFT JOIN g ON f.pg = g.group_name"""
"""One row per process group of the Flight Recorder: its last collective (number, op, whether done, how
long ago it was issued, its input sizes and dtypes), the mean interval between its recorded collectives,
and its last 8 collectives as ``seq<TAB>op<TAB>sizes<TAB>dtypes`` lines (``probe.diagnose.collectives``
compares them across ranks); and the group's global ranks (``[0, 1]``, from ``torch.distributed``): a member
with no entry of a group waited in has issued none of its collectives."""

TRACE_SQL = """\
SELECT max(step) AS step, epoch(now()) - epoch(max(time)) AS last_age, count(*) AS entries,
  (SELECT sum(duration) / greatest(count(DISTINCT step), 1) FROM python.torch_trace
     WHERE stage = 'forward' AND step >= (SELECT max(step) - 5 FROM python.torch_trace)
       AND step < (SELECT max(step) FROM python.torch_trace)) AS compute,
  (SELECT arg_max(module, spent) FROM (SELECT module, sum(duration) AS spent FROM python.torch_trace
     WHERE stage = 'forward' AND step >= (SELECT max(step) - 5 FROM python.torch_trace) GROUP BY module)) AS top_module,
  (SELECT (epoch(max(time)) - epoch(min(time))) / greatest(max(step) - min(step), 1) FROM python.torch_trace
     WHERE step >= (SELECT max(step) - 5 FROM python.torch_trace)) AS step_s
FROM python.torch_trace"""
"""The trace's last step, how long ago its last span began, the forward self time per step over the last
5 complete steps (a rank's own compute), its slowest forward module there, and the wall time per step."""

_LIBRARIES: Dict[Tuple[Tuple[str, str], ...], Any] = {}  # a layout's rows -> its Library (RankEvidence.library)

STATES = ("answering", "gil_held", "stopped", "dead", "no_answer", "unreachable", "no_agent")


@dataclass
class RankEvidence:
    rank: int
    host: str
    pid: Optional[int] = None
    state: str = "answering"
    why: str = ""  # why it did not answer (the error's message and hint)
    source: str = "agent"  # where the stacks came from: agent, or the reader's words (outside, crash record)
    frames: Optional[List[Frame]] = None
    holder: Optional[str] = None  # the thread that keeps the GIL, and where
    holder_id: Optional[int] = None  # that thread's id in ``frames``
    threads: Optional[List[Dict[str, Any]]] = None
    threads_why: Optional[str] = None
    fr: Optional[List[Dict[str, Any]]] = None
    fr_why: Optional[str] = None
    fr_copy: Optional[Dict[str, Any]] = None  # where ``fr`` is its agent's copy, not live (probe.diagnose.fr_copy)
    trace: Optional[Dict[str, Any]] = None
    trace_why: Optional[str] = None
    training: Optional[Dict[str, Any]] = None  # data loader workers, NaN/Inf (probe.diagnose.training)
    memory: Optional[Dict[str, Any]] = None  # RSS readings, where memory is, OOM kills (probe.diagnose.memory)
    steps: Optional[List[Dict[str, Any]]] = None  # the step counter's rows (probe.diagnose.progress)
    steps_why: Optional[str] = None
    paths: Optional[List[List[str]]] = None  # [kind, directory] of its interpreter's layout (python.paths)
    locks: Optional[List[Dict[str, Any]]] = None  # python.locks rows, where a thread's line may wait for a lock
    seconds: float = 0.0
    prefetching: bool = False  # its node helper takes the next look's straggler samples now (probe.host.prefetch)
    at: float = field(default_factory=time.monotonic)
    error: Optional[ProbeError] = None  # the error that left it unreachable, for a single process to raise

    def stacks(self) -> Dict[str, Tuple[Tuple[str, str, int, str], ...]]:
        """Thread name -> (func, file, lineno, code) innermost first; threads that share a name get #2...
        (One dict while the frames are the same: read it, do not change it. Kept while ``frames`` is the
        same list: the rules ask for it several times a rank.)"""
        memo = self.__dict__.get("_stacks_memo")
        frames = self.frames
        if memo is not None and memo[0] is frames and memo[1] == len(frames or ()):
            return memo[2]  # type: ignore[no-any-return]
        out = {name: key for name, _, key in self._named()}
        self.__dict__["_stacks_memo"] = (frames, len(frames or ()), out)
        return out

    def _main(self) -> Tuple[str, Any]:
        """:func:`main_stack`'s answer, read from the named stacks alone (kept like them): the rules compare
        two looks' main stacks for every rank, and most never ask for the rest of :meth:`stacks`."""
        memo = self.__dict__.get("_main_memo")
        frames = self.frames
        if memo is not None and memo[0] is frames and memo[1] == len(frames or ()):
            return memo[2]  # type: ignore[no-any-return]
        named = self._named()
        first = named[0] if named else None  # the main thread first, where it has Python frames
        main = (first[0], first[2]) if first is not None and first[0] == "MainThread" else \
            next(((name, key) for name, _, key in named if name == "MainThread"), None)
        if main is None:
            main = (named[0][0], named[0][2]) if named else ("MainThread", ())
        self.__dict__["_main_memo"] = (frames, len(frames or ()), main)
        return main

    def names_by_id(self) -> Dict[int, str]:
        """Thread id -> the name :meth:`stacks` gives that thread."""
        return {ident: name for name, ident, _ in self._named()}

    def _named(self) -> List[Tuple[str, int, Tuple[Tuple[str, str, int, str], ...]]]:
        """Kept while ``frames`` is the same list (the rules ask for a rank's stacks many times; at 16k ranks
        rebuilding them each time was most of the judging)."""
        memo = self.__dict__.get("_named_memo")
        frames = self.frames
        if memo is not None and memo[0] is frames and memo[1] == len(frames or ()):
            return memo[2]
        out = self._named_now()
        self.__dict__["_named_memo"] = (frames, len(frames or ()), out)
        return out

    def _named_now(self) -> List[Tuple[str, int, Tuple[Tuple[str, str, int, str], ...]]]:
        by_thread: Dict[int, List[Frame]] = {}
        for frame in self.frames or ():
            if frame.frame_type == "python":
                by_thread.setdefault(frame.thread_id, []).append(frame)
        out: List[Tuple[str, int, Tuple[Tuple[str, str, int, str], ...]]] = []
        taken = set()
        for stack in sorted(by_thread.values(), key=lambda fs: (not fs[0].is_main, fs[0].thread_name or "",
                                                                 fs[0].thread_id)):
            name = "MainThread" if stack[0].is_main else (stack[0].thread_name or "?")
            unique, n = name, 1
            while unique in taken:
                n += 1
                unique = "%s#%d" % (name, n)
            taken.add(unique)
            out.append((unique, stack[0].thread_id, tuple((f.func, f.file, f.lineno, (f.code or "").strip())
                                                          for f in sorted(stack, key=lambda f: f.depth))))
        return out

    def lock_rows(self) -> List[Dict[str, Any]]:
        """The rows of ``python.locks`` whose fields have the types the table gives (a record is hostile)."""
        out = []
        for row in (self.locks if isinstance(self.locks, list) else ())[:4096]:
            if isinstance(row, dict) and all(row.get(k) is None or type(row.get(k)) is int
                                             for k in ("thread_id", "depth", "lineno", "with_line", "lock_id", "owner")):
                out.append(row)
        return out

    def library(self) -> Any:
        """Which of its frames are a library's (:class:`probe.diagnose.library.Library`), by the layout it
        reported or that was read from outside; this host's own where neither is known."""
        memo = self.__dict__.get("_library_memo")  # asked rank by rank by several rules: kept while paths is the same
        if memo is not None and memo[0] is self.paths:
            return memo[1]
        from probe.diagnose.library import from_rows, local_layout

        rows = tuple((str(r[0]), str(r[1])) for r in (self.paths if isinstance(self.paths, list) else ())
                     if isinstance(r, (list, tuple)) and len(r) == 2)[:64]
        # One Library per distinct layout, kept: the rules ask for it rank by rank, and the ranks of a job
        # share one layout (this host's own, read from sysconfig, cost a millisecond each time).
        found = _LIBRARIES.get(rows)
        if found is None:
            if len(_LIBRARIES) >= 64:
                _LIBRARIES.clear()
            found = _LIBRARIES[rows] = from_rows(rows) if rows else local_layout()
        self.__dict__["_library_memo"] = (self.paths, found)
        return found

    def main_cpu(self) -> Optional[float]:
        for thread in self.threads or ():
            if thread.get("is_main") and isinstance(thread.get("cpu"), (int, float)):
                return float(thread["cpu"])
        return None

    def cpu_by_name(self) -> Dict[str, float]:
        out: Dict[str, float] = {}
        for thread in self.threads or ():
            name = "MainThread" if thread.get("is_main") else str(thread.get("thread_name"))
            if isinstance(thread.get("cpu"), (int, float)) and name not in out:
                out[name] = float(thread["cpu"])
        return out

    def as_json(self) -> Dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "pid": self.pid, "state": self.state, "why": self.why or None,
                "source": self.source, "holder": self.holder,
                "stacks": {name: [{"func": f, "file": p, "line": n} for f, p, n, _ in key[:12]]
                           for name, key in self.stacks().items()} if self.frames is not None else None,
                "threads": self.threads, "threads_why": self.threads_why, "flight_recorder": self.fr,
                "flight_recorder_why": self.fr_why, "flight_recorder_copy": self.fr_copy, "trace": self.trace, "trace_why": self.trace_why,
                "steps": self.steps, "steps_why": self.steps_why, "paths": self.paths,
                "training": self.training, "memory": self.memory}


@dataclass
class Sample:
    """Every rank's evidence at one moment; ``total``: the ranks asked; ``single``: one process, not a job."""

    ranks: Dict[int, RankEvidence]
    total: int
    single: bool = False
    at: float = field(default_factory=time.monotonic)
    seconds: float = 0.0
    recorded: bool = False  # read back from a snapshot: its processes may be gone, advice that acts on them is not given
    history: Any = None  # cluster.stack_history's current runs (probe.client.stack_history): rows, or a call
    # (ranks -> rows) that asks the helpers of those ranks alone, made where a verdict names them


def keep_named(ev: RankEvidence, named: List[Tuple[str, int, Tuple[Tuple[str, str, int, str], ...]]]) -> None:
    """Give ``ev`` its named stacks, made by whoever built its frames (``probe.diagnose.gathered``: each
    distinct stack's key once for every rank), so that they are not made again from the frames."""
    ev.__dict__["_named_memo"] = (ev.frames, len(ev.frames or ()), named)


def agent_frames(client: Any) -> List[Frame]:
    """The rank's stacks from its agent (a ``probe.client.sources.Source``); where it cannot answer, its
    error, which says the rank's state (and carries what was read from outside)."""
    return client.backtrace(fallback=False)  # type: ignore[no-any-return]


def main_stack(ev: RankEvidence) -> Tuple[str, Tuple[Tuple[str, str, int, str], ...]]:
    """(thread name, stack) of the rank's main thread; else of its first thread; else no stack."""
    return ev._main()


def fr_by_pg(ev: RankEvidence) -> Dict[str, Dict[str, Any]]:
    """The Flight Recorder's row of each process group that has a last collective, by group."""
    return {str(r.get("pg")): r for r in ev.fr or () if r.get("last_seq") is not None}
