"""The evidence ``probe diagnose`` judges: per rank, what can be read without harming it.

For each rank (or the one process), within the fan-out's deadline:

* its stacks, from its agent; where the agent cannot answer, read from outside (a C call holding the
  GIL, a stopped process), or a dead one's last stacks from its crash record, with the state that says
  why (``gil_held``, ``stopped``, ``dead``, ``no_answer``, ``unreachable``);
* only from an agent that answered: its threads' CPU time (``python.threads``), the Flight Recorder's
  last collective of each process group and the trace's steps (one query over ``torch.flight_recorder``
  and ``python.torch_trace``).

Only reads: no eval, no collective, no device synchronisation (the tables promise as much). What could
not be had is kept with why (``*_why``), never filled in.
"""

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from probe.client.results import Frame
from probe.errors import AgentBlocked, ConnectError, ProbeError, ProcessDead, Timeout, TorchNotLoaded

__all__ = ["RankEvidence", "Sample", "collect", "forget", "sample_job", "sample_one", "FR_SQL", "TRACE_SQL",
           "THREADS_SQL"]

THREADS_SQL = ("SELECT thread_id, thread_name, is_main, is_agent, CASE WHEN cpu_user IS NULL THEN NULL "
               "ELSE cpu_user + coalesce(cpu_system, 0) END AS cpu FROM python.threads")
"""Each thread's CPU seconds: a thread blocked for good gains none, one that runs gains some."""

FR_SQL = """\
WITH e AS (SELECT *, max(collective_seq_id) OVER (PARTITION BY pg) AS top_seq FROM torch.flight_recorder
  WHERE NOT coalesce(is_p2p, false) AND collective_seq_id IS NOT NULL)
SELECT pg, any_value(pg_desc) AS pg_desc, max(collective_seq_id) AS last_seq,
  arg_max(op, collective_seq_id) AS last_op,
  arg_max(coalesce(retired, false) OR state = 'completed', collective_seq_id) AS last_done,
  epoch(now()) - epoch(arg_max(time_created, collective_seq_id)) AS last_age,
  (epoch(max(time_created)) - epoch(min(time_created))) / greatest(count(*) - 1, 1) AS period,
  arg_max(call_site, collective_seq_id) AS call_site, count(*) AS entries,
  arg_max(input_sizes, collective_seq_id) AS last_sizes, arg_max(input_dtypes, collective_seq_id) AS last_dtypes,
  string_agg(CASE WHEN collective_seq_id > top_seq - 8 THEN concat_ws(chr(9), collective_seq_id, coalesce(op, ''),
    coalesce(input_sizes, ''), coalesce(input_dtypes, '')) END, chr(10) ORDER BY collective_seq_id) AS recent
FROM e GROUP BY pg"""
"""One row per process group of the Flight Recorder: its last collective (number, op, whether done, how
long ago it was issued, its input sizes and dtypes), the mean interval between its recorded collectives,
and its last 8 collectives as ``seq<TAB>op<TAB>sizes<TAB>dtypes`` lines (``probe.diagnose.collectives``
compares them across ranks)."""

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

MAX_TABLE_ROWS = 2000  # rows of python.paths and python.locks read (their rows, without SQL: no engine involved)


def _may_wait_for_a_lock(ev: "RankEvidence") -> bool:
    from probe.diagnose import lockwaits

    return any(lockwaits.lock_line(key[0][3]) for key in ev.stacks().values() if key)


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
    trace: Optional[Dict[str, Any]] = None
    trace_why: Optional[str] = None
    training: Optional[Dict[str, Any]] = None  # data loader workers, NaN/Inf (probe.diagnose.training)
    memory: Optional[Dict[str, Any]] = None  # RSS readings, where memory is, OOM kills (probe.diagnose.memory)
    steps: Optional[List[Dict[str, Any]]] = None  # the step counter's rows (probe.diagnose.progress)
    steps_why: Optional[str] = None
    paths: Optional[List[List[str]]] = None  # [kind, directory] of its interpreter's layout (python.paths)
    locks: Optional[List[Dict[str, Any]]] = None  # python.locks rows, where a thread's line may wait for a lock
    seconds: float = 0.0
    at: float = field(default_factory=time.monotonic)
    error: Optional[ProbeError] = None  # the error that left it unreachable, for a single process to raise

    def stacks(self) -> Dict[str, Tuple[Tuple[str, str, int, str], ...]]:
        """Thread name -> (func, file, lineno, code) innermost first; threads that share a name get #2...
        (One dict while the frames are the same: read it, do not change it.)"""
        named = self._named()
        memo = self.__dict__.get("_stacks_memo")
        if memo is not None and memo[0] is named:
            return memo[1]  # type: ignore[no-any-return]
        out = {name: key for name, _, key in named}
        self.__dict__["_stacks_memo"] = (named, out)
        return out

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
        from probe.diagnose import library

        rows = tuple((str(r[0]), str(r[1])) for r in (self.paths if isinstance(self.paths, list) else ())
                     if isinstance(r, (list, tuple)) and len(r) == 2)[:64]
        # One Library per distinct layout, kept: the rules ask for it rank by rank, and the ranks of a job
        # share one layout (this host's own, read from sysconfig, cost a millisecond each time).
        found = _LIBRARIES.get(rows)
        if found is None:
            if len(_LIBRARIES) >= 64:
                _LIBRARIES.clear()
            found = _LIBRARIES[rows] = library.from_rows(rows) if rows else library.local_layout()
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
                "flight_recorder_why": self.fr_why, "trace": self.trace, "trace_why": self.trace_why,
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


def keep_named(ev: RankEvidence, named: List[Tuple[str, int, Tuple[Tuple[str, str, int, str], ...]]]) -> None:
    """Give ``ev`` its named stacks, made by whoever built its frames (``probe.diagnose.gathered``: each
    distinct stack's key once for every rank), so that they are not made again from the frames."""
    ev.__dict__["_named_memo"] = (ev.frames, len(ev.frames or ()), named)


def _agent_frames(client: Any) -> List[Frame]:
    """The rank's stacks from its agent (a ``probe.client.sources.Source``); where it cannot answer, its
    error, which says the rank's state (and carries what was read from outside)."""
    return client.backtrace(fallback=False)  # type: ignore[no-any-return]


def _exited(pid: Optional[int]) -> bool:
    """A process that exited and was not reaped yet (a zombie): dead, surely. One that is gone may never
    have been (a mistyped pid): that is said as the error, not as a death."""
    if pid is None:
        return False
    try:
        with open("/proc/%d/stat" % pid, "rb") as handle:
            stat = handle.read()
        return stat[stat.rindex(b")") + 2:][:1] in (b"Z", b"X")
    except (OSError, ValueError):
        return False


def _died_without_a_word(ev: RankEvidence, pid: int) -> bool:
    """A process that is gone and whose agent's crash record holds its header alone: it existed, and died
    with no handler run (SIGKILL, the OOM killer, os._exit; a clean exit removes the record). ``ev.why``
    then says so, as for a rank that died with its stacks."""
    from probe.reader import crash

    record = crash.dead_record(pid)
    if record is None:
        return False
    ev.why = "process %d is dead: %s -- its exit status, or the kernel log (OOM killer), may say more" % (
        pid, record.cause)
    return True


def _from_failure(ev: RankEvidence, client: Any, exc: ProbeError) -> None:
    """What the error says of a rank that did not answer: its state, why, and the stacks that came with it."""
    from probe.client import fallback

    ev.why = exc.message + (" -- %s" % exc.hint if exc.hint else "")
    ev.error = exc
    diagnosis = getattr(exc, "diagnosis", None)
    stacks = fallback.outside_stacks(exc, agentless=True)
    local_pid = client.target.pid if client.target.is_local else None
    if isinstance(exc, ProcessDead) or getattr(exc, "record", None) is not None or (
            diagnosis is not None and diagnosis.state == "dead"):
        ev.state = "dead"
    elif diagnosis is not None and diagnosis.state in ("gil_held", "stopped", "no_answer"):
        ev.state = diagnosis.state
    elif getattr(exc, "agentless_pid", None) is not None:
        ev.state = "no_agent"
    elif isinstance(exc, (Timeout, AgentBlocked)):
        ev.state = "no_answer"
    elif isinstance(exc, ConnectError) and local_pid is not None and (_exited(local_pid) or
                                                                        _died_without_a_word(ev, local_pid)):
        ev.state = "dead"
    else:
        ev.state = "unreachable"
    if stacks is not None:
        ev.frames = fallback.frames_of(stacks)
        ev.source = str(getattr(stacks, "source", "read from outside"))
        from probe.diagnose import library

        facts = getattr(stacks, "facts", None) or {}
        roots = library.from_process(local_pid if ev.state != "dead" else None, facts.get("executable"))
        if roots:  # with this probe's own package: the target's agent is most often this very install
            ev.paths = [["stdlib", root] for root in roots] + [["probe", os.path.dirname(os.path.dirname(
                os.path.abspath(__file__)))]]
        if ev.state == "gil_held":
            holder = diagnosis.holder if diagnosis is not None and diagnosis.holder is not None else None
            if holder is None:
                try:
                    holder = stacks.gil_holder()
                except Exception:  # a reader's stacks without GIL facts: said as unknown
                    holder = None
            if holder is not None:
                ev.holder = "thread %s in %s" % (holder.label().strip(), holder.where())
                ident = holder.thread_id if holder.thread_id is not None else holder.native_id
                ev.holder_id = ident if isinstance(ident, int) else None
    else:
        ev.source = "none"


def _query(client: Any, sql: str) -> List[Dict[str, Any]]:
    rows = client.query_rows(sql, timeout=5.0)
    if client.note:  # answered from stacks read from outside: the agent stopped answering meanwhile
        raise ProbeError("the agent stopped answering: %s" % client.note.splitlines()[0])
    names = [c[0] for c in rows.columns]
    return [dict(zip(names, row)) for row in rows.rows]


_LAYOUTS: Dict[Tuple[str, int], List[List[str]]] = {}
MAX_LAYOUTS = 4096


def _layout(client: Any, host: str, pid: Optional[int]) -> Optional[List[List[str]]]:
    """The interpreter's layout (``python.paths``), read once per process: it does not change while it runs."""
    if pid is not None and (host, pid) in _LAYOUTS:
        return _LAYOUTS[(host, pid)]
    try:
        paths = [[str(r["kind"]), str(r["path"])] for r in _table(client, "python.paths")]
    except ProbeError:  # an older agent: the layout is guessed (probe.diagnose.library)
        return None
    if pid is not None:
        if len(_LAYOUTS) >= MAX_LAYOUTS:
            _LAYOUTS.clear()
        _LAYOUTS[(host, pid)] = paths
    return paths


def _table(client: Any, name: str) -> List[Dict[str, Any]]:
    """A table's rows as the agent makes them (``/v1/rows``: no SQL engine on either side): the
    interpreter's layout (``python.paths``, which frames are a library's), the locks by identity
    (``python.locks``, asked only where some thread's innermost line is a ``with`` or an ``acquire(``)."""
    rows = client.table_rows(name, max_rows=MAX_TABLE_ROWS)
    if client.note:
        raise ProbeError("the agent stopped answering: %s" % client.note.splitlines()[0])
    names = [c[0] for c in rows.columns]
    return [dict(zip(names, row)) for row in rows.rows]


def collect(client: Any, rank: int, host: str, pid: Optional[int] = None, listed_state: Optional[str] = None) -> RankEvidence:
    """One rank's evidence; never raises (what failed is kept, with why)."""
    start = time.monotonic()
    ev = RankEvidence(rank, host, pid)
    try:
        if client.target.core is not None:
            ev.frames = client.backtrace()
            ev.state, ev.source, ev.why = "dead", str(client.note or "a core file"), "a core file"
        else:
            ev.frames = _agent_frames(client)
    except ProbeError as exc:
        _from_failure(ev, client, exc)
    except Exception as exc:  # a reader's or parser's surprise: this rank's evidence is said to be missing
        ev.state, ev.why, ev.source = "unreachable", "%s: %s" % (type(exc).__name__, exc), "none"
    if ev.state == "unreachable" and listed_state == "dead":
        ev.state = "dead"
    if ev.state == "answering":
        ev.paths = _layout(client, host, pid)
        if _may_wait_for_a_lock(ev):
            try:
                ev.locks = _table(client, "python.locks")
            except ProbeError:  # an older agent: holders are found by the expressions' text
                ev.locks = None
        try:
            ev.threads = _query(client, THREADS_SQL)
        except ProbeError as exc:
            ev.threads_why = exc.message
        try:
            ev.fr = _query(client, FR_SQL)
            if not ev.fr:
                ev.fr_why = "it holds no collective (off unless the job starts with TORCH_FR_BUFFER_SIZE=N)"
        except TorchNotLoaded:
            ev.fr_why = "torch is not loaded"
        except ProbeError as exc:
            ev.fr_why = exc.message
        if ev.fr_why != "torch is not loaded":
            try:
                rows = _query(client, TRACE_SQL)
                ev.trace = rows[0] if rows and rows[0].get("step") is not None else None
                if ev.trace is None:
                    ev.trace_why = "it holds no step (`trace start` turns it on)"
            except ProbeError as exc:
                ev.trace_why = exc.message
        else:
            ev.trace_why = ev.fr_why
        from probe.diagnose import progress

        progress.collect_steps(ev, _query, client)
    else:
        why = "its agent cannot answer (%s)" % ev.state.replace("_", " ")
        ev.threads_why = ev.fr_why = ev.trace_why = ev.steps_why = why
    from probe.diagnose import memory, training

    if ev.state == "answering":
        training.gather(client, ev, _query)
    memory.gather(client, ev, _query)
    ev.seconds = time.monotonic() - start
    return ev


def forget(host: str, pid: Optional[int], rank: int) -> None:
    """Drop what the looks of this process kept of one rank (RSS readings, the memory split, the
    parameters read after a NaN): a long-lived reader (the node helper's watch, which records again at the
    next stall) starts each recording afresh, and keeps nothing of ranks long gone."""
    from probe.diagnose import memory, training

    memory.forget((host, pid, rank))
    training.forget((host, pid))
    from probe.diagnose import numerics

    numerics.forget((host, pid))
    if pid is not None:
        _LAYOUTS.pop((host, pid), None)


def sample_job(cluster: Any, deadline: float, only: Optional[Sequence[int]] = None,
               previous: Optional[Sample] = None) -> Sample:
    """Every rank's evidence through the fan-out, within ``deadline`` seconds. ``only``: the ranks to ask
    again (the others keep their evidence from ``previous``: a rank that cannot answer is not read from
    outside a second time)."""
    from probe.diagnose import gathered

    start = time.monotonic()
    chosen = cluster if only is None else cluster.select(only)
    chosen.via = getattr(cluster, "via", "auto")
    saved = chosen.deadline
    chosen.deadline = deadline
    ranks: Dict[int, RankEvidence] = {} if previous is None else dict(previous.ranks)
    try:
        if chosen.members and gathered.through_helpers(chosen):  # one request a node (probe.diagnose.gathered)
            got, failures = gathered.sample(chosen, None if previous is None else start - previous.at + 1.0,
                                            sys.modules[__name__])
            ranks.update(got)
        else:
            by_client = {id(c): m for m, c in zip(chosen.members, chosen.clients)}
            answers = chosen.map(lambda c: _collect_member(c, by_client[id(c)])) if chosen.members else []
            for answer in answers:
                ranks[answer.member.rank] = answer.value
            failures = chosen.failures
    finally:
        chosen.deadline = saved
    for failure in failures:
        member = next((m for m in chosen.members if m.rank == failure.rank), None)
        ranks[failure.rank] = RankEvidence(failure.rank, failure.host, member.pid if member else None,
                                           state="dead" if member is not None and member.state == "dead"
                                           else "no_answer", why=failure.reason, source="none",
                                           threads_why="no answer", fr_why="no answer", trace_why="no answer")
    return Sample(ranks, len(cluster.members), False, start, time.monotonic() - start)


def _collect_member(client: Any, member: Any) -> RankEvidence:
    return collect(client, member.rank, member.host, member.pid, member.state)


def sample_one(client: Any, deadline: float) -> Sample:
    """The one process's evidence (rank 0 of a job of one), within about ``deadline`` seconds."""
    from probe.client.fanout import fan_out

    start = time.monotonic()
    pid = client.target.pid
    label = "process %d" % pid if pid is not None else client.target.label
    outcome = fan_out([client], lambda c: collect(c, 0, label, pid), 1, deadline)[0]
    if outcome.error is not None:
        ev = RankEvidence(0, label, pid, state="no_answer", why=outcome.error.message, source="none",
                          threads_why="no answer", fr_why="no answer", trace_why="no answer")
    else:
        ev = outcome.value
    if ev.state == "unreachable" and ev.frames is None and ev.error is not None:
        raise ev.error  # no agent, not a Python process, refused: probe's own error, not a diagnosis
    return Sample({0: ev}, 1, True, start, time.monotonic() - start)



