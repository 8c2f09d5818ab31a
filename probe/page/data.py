"""What the page shows, gathered with the client calls the commands make, and shaped for the browser.

A *source* is the job (a :class:`~probe.client.cluster.Cluster` made afresh for each gathering, so that
ranks that restart or die are seen, and two gatherings never share a cluster's ``failures``) or the one
process (a :class:`~probe.client.Client`). Each gathering is bounded: the fan-out's deadline bounds its
time, and the caps below bound what it sends to the browser (distinct stacks, frames, rows, steps).
The shaping functions are pure: data in, plain JSON-ready values out.
"""

import math
import socket
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

from probe.client.cluster import MEMBER_COLUMNS, NoRankAnswered, compact_ranks
from probe.client.results import Frame, Rows, thread_stacks
from probe.errors import ProbeError

__all__ = ["JobSource", "ProcessSource", "flame", "stack_groups", "grid_state", "StepHistory", "cell",
           "MAX_THREADS", "MAX_STACKS", "MAX_DEPTH", "MAX_FRAMES", "MAX_ROWS", "TRACE_SQL", "COUNTER_SQL", "MEMORY_SQL"]

MAX_THREADS = 8
"""Thread names drawn in the flame graph (MainThread first); the rest are counted, not drawn."""
MAX_STACKS = 64
"""Distinct stacks of one thread name drawn (the largest groups); the rest are counted."""
MAX_DEPTH = 80
"""Frames of one stack drawn, from the outermost; deeper frames are cut (said in the frame's place)."""
MAX_FRAMES = 2500
"""Frames (flame graph nodes) sent in all, over every thread name: past it no further stack is drawn."""
MAX_ROWS = 5000
"""Rows of a SQL answer sent to the page (each rank's own cap applies first)."""
MAX_TRACE_EVENTS = 1_000_000
"""Trace events in one export (every rank's together); past it the file says it was cut."""
MAX_UNLISTED = 4096
"""Ranks of the job's world size that no helper lists given a cell of their own; the rest are counted."""
UNLISTED_WHY = ("not listed by its node's helper: it has not registered and its helper has not seen it (starting, "
                "exited before its helper looked, or on a node whose helper does not report)")

TRACE_SQL = ("SELECT step, max(time_offset + host_duration) AS step_s, max(allocated) AS memory_mb "
             "FROM python.torch_trace WHERE step >= (SELECT max(step) FROM python.torch_trace) - {n} "
             "AND step < (SELECT max(step) FROM python.torch_trace) "
             "AND step > (SELECT min(step) FROM python.torch_trace) GROUP BY step ORDER BY step")
"""Each rank's last N whole steps from the trace: a step's time (from the end of the step before to its
last span's end, host time) and its memory (MB; the CUDA allocator's, RSS on a CPU-only rank). Neither
the newest step (under way) nor the oldest one held (it began when the trace did, or lost its first
spans to the ring buffer) is whole."""
COUNTER_SQL = "SELECT max(steps) AS steps, arg_max(step_time_last_s, steps) AS step_s FROM torch.steps"
"""The step counter (no trace needed): steps made and the last step's time, of the busiest optimizer."""
MEMORY_SQL = "SELECT rss / 1e6 AS memory_mb FROM process.info"
"""The resident set size, MB, where the trace gives no memory."""

Key = Tuple[Tuple[str, str, int], ...]


def cell(value: Any) -> Any:
    """A query's value as JSON can carry it: NaN and infinities as null, what JSON has no type for as text."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if isinstance(value, (list, tuple)):
        return [cell(v) for v in value]
    if isinstance(value, dict):
        return {str(k): cell(v) for k, v in value.items()}
    return str(value)


def rows_json(rows: Rows, cap: int = MAX_ROWS) -> Dict[str, Any]:
    return {"columns": [{"name": n, "type": t} for n, t in rows.columns],
            "rows": [[cell(v) for v in row] for row in rows.rows[:cap]],
            "truncated": bool(rows.truncated) or len(rows.rows) > cap, "total": len(rows.rows)}


def failures_json(failures: Sequence[Any]) -> List[Dict[str, Any]]:
    return [{"rank": f.rank, "host": f.host, "reason": f.reason} for f in failures]


def _short(path: str) -> str:
    marker = "site-packages/"
    return path[path.index(marker) + len(marker):] if marker in path else path


# -- stacks: groups and the flame graph ---------------------------------------------------------------


def _ordered(threads: Dict[str, Dict[Key, List[int]]]) -> List[Tuple[str, List[Tuple[Key, List[int]]]]]:
    """As ``--all-ranks backtrace`` orders them: MainThread first, each name's largest group first."""
    names = sorted(threads, key=lambda n: (n != "MainThread", n))
    return [(name, sorted(threads[name].items(), key=lambda kv: (-len(kv[1]), min(kv[1])))) for name in names]


def stack_groups(threads: Dict[str, Dict[Key, List[int]]]) -> List[Dict[str, Any]]:
    """The main thread's distinct stacks, largest first: the groups the grid colours ranks by."""
    ordered = dict(_ordered(threads)).get("MainThread", [])
    return [{"group": i, "ranks": sorted(ranks), "ranks_text": compact_ranks(ranks), "count": len(ranks),
             "top": "%s (%s:%d)" % (key[0][0], _short(str(key[0][1])), key[0][2]) if key else "(no frame)"}
            for i, (key, ranks) in enumerate(ordered)]


def flame(threads: Dict[str, Dict[Key, List[int]]], total: int) -> Dict[str, Any]:
    """Each thread name's stacks merged into one tree, outermost frame at the root, every frame with the
    ranks whose stack holds it. Where a node's ranks part ways, the children other than the largest are
    marked ``departs`` (``>`` in ``--all-ranks backtrace``). Bounded by MAX_THREADS, MAX_STACKS, MAX_DEPTH and
    MAX_FRAMES (the largest groups drawn first)."""
    out: List[Dict[str, Any]] = []
    ordered = _ordered(threads)
    budget = MAX_FRAMES
    for name, groups in ordered[:MAX_THREADS]:
        root: Dict[str, Any] = {"func": name, "file": "", "line": 0, "ranks": set(), "kids": {}}
        drawn = 0
        for key, ranks in groups[:MAX_STACKS]:
            if budget <= 0:
                break
            budget -= min(len(key), MAX_DEPTH + 1)  # at most: frames shared with a stack before cost nothing
            drawn += 1
            node = root
            node["ranks"].update(ranks)
            frames = list(reversed(key))  # outermost first
            for func, file, lineno in frames[:MAX_DEPTH]:
                node = node["kids"].setdefault((func, file, lineno), {"func": func, "file": _short(str(file)),
                                                                      "line": lineno, "ranks": set(), "kids": {}})
                node["ranks"].update(ranks)
            if len(frames) > MAX_DEPTH:
                node = node["kids"].setdefault(("...", "", 0), {"func": "(%d frames more)" % (len(frames) - MAX_DEPTH),
                                                                "file": "", "line": 0, "ranks": set(), "kids": {}})
                node["ranks"].update(ranks)
        out.append({"thread": name, "ranks_answered": len({r for _, ranks in groups for r in ranks}), "stacks": len(groups),
                    "stacks_drawn": drawn, "tree": _plain(root, False)})
    return {"threads": out, "threads_more": max(0, len(ordered) - MAX_THREADS), "total": total}


def _plain(node: Dict[str, Any], departs: bool) -> Dict[str, Any]:
    kids = sorted(node["kids"].values(), key=lambda k: (-len(k["ranks"]), min(k["ranks"])))
    ranks = sorted(node["ranks"])
    out: Dict[str, Any] = {"func": str(node["func"]), "file": str(node["file"]), "line": node["line"], "n": len(ranks),
                           "ranks": compact_ranks(ranks)}
    if departs:  # only where true, and kids only where there are: a 256-rank refresh carries thousands of frames
        out["departs"] = True
    if kids:
        out["kids"] = [_plain(k, i > 0) for i, k in enumerate(kids)]
    return out


def frames_json(frames: Sequence[Frame]) -> List[Dict[str, Any]]:
    """A rank's frames, per thread (main first), innermost first, for the rank's panel."""
    threads: Dict[int, List[Frame]] = {}
    for frame in frames:
        threads.setdefault(frame.thread_id, []).append(frame)
    order = sorted(threads.values(), key=lambda fs: (not fs[0].is_main, fs[0].thread_name or "", fs[0].thread_id))
    return [{"thread": stack[0].thread_name or "?", "thread_id": stack[0].thread_id, "main": stack[0].is_main,
             "frames": [{"func": f.func, "file": f.file, "line": f.lineno, "code": f.code, "native": f.frame_type == "native"}
                        for f in sorted(stack, key=lambda f: f.depth)[:MAX_DEPTH * 2]]}
            for stack in order[:64]]


# -- the grid -------------------------------------------------------------------------------------------


def grid_state(listed: Optional[str], seen: Optional[str]) -> str:
    """One word a rank for the grid: running, silent, gil_held, stopped or dead; from the state its node
    helper lists (``ranks``) and the state diagnose's last look found (``seen``: answering, gil_held,
    stopped, no_answer, unreachable, no_agent, dead), the worse of the two."""
    if listed == "dead" or seen == "dead":
        return "dead"
    if listed == "stopped" or seen == "stopped":
        return "stopped"
    if seen == "gil_held":
        return "gil_held"
    if listed in ("silent", "unreported") or seen in ("no_answer", "unreachable", "no_agent"):
        return "silent"
    return "running"


def unlisted_ranks(members: Sequence[Dict[str, Any]]) -> Tuple[List[int], int]:
    """The ranks below the largest world size the members report that no member is (the first
    ``MAX_UNLISTED`` of them, and how many in all): a rank its helper never saw (it died before its helper
    looked, or its node's helper does not report) still has a cell, not a hole in the grid. A world size
    is the members' word: one past the client's ``MAX_RANKS`` is not believed."""
    from probe.client.cluster import MAX_RANKS

    sizes = [m.get("world_size") for m in members]
    sizes = [s for s in sizes if isinstance(s, int) and not isinstance(s, bool) and 0 < s <= MAX_RANKS]
    if not sizes:
        return [], 0
    world = max(sizes)
    listed = {r for r in (m.get("rank") for m in members) if isinstance(r, int) and 0 <= r < world}
    first: List[int] = []
    for rank in range(world):
        if len(first) >= MAX_UNLISTED:
            break
        if rank not in listed:
            first.append(rank)
    return first, world - len(listed)


# -- step time and memory ---------------------------------------------------------------------------------


class StepHistory:
    """Each rank's last N steps: from the trace where it is on (the rows themselves), else the step
    counter's and RSS's readings, kept here one a step as the page looks (a rank that makes no step keeps
    its last point; one with no optimizer step counted gets a point a look)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.looks = 0
        self._kept: Dict[int, Deque[Tuple[int, Optional[float], Optional[float], str]]] = {}

    def update(self, trace: Dict[int, List[Dict[str, Any]]], counter: Dict[int, Dict[str, Any]],
               memory: Dict[int, Optional[float]], ranks: Sequence[int]) -> Dict[str, Any]:
        self.looks += 1
        series = []
        for rank in ranks:
            rows = trace.get(rank) or []
            if rows:
                rows = rows[-self.steps:]
                series.append({"rank": rank, "source": "trace", "unit": "step", "x": [r["step"] for r in rows],
                               "step_s": [_num(r.get("step_s")) for r in rows],
                               "memory_mb": [_num(r.get("memory_mb")) for r in rows]})
                continue
            kept = self._kept.setdefault(rank, deque(maxlen=self.steps))
            count = counter.get(rank, {}).get("steps")
            mem = memory.get(rank)
            if count:
                if not kept or kept[-1][3] != "step" or kept[-1][0] != count:
                    kept.append((int(count), _num(counter[rank].get("step_s")), _num(mem), "step"))
            elif rank in memory:
                if kept and kept[-1][3] == "step":
                    kept.clear()  # a restarted rank: its counter began again
                kept.append((self.looks, None, _num(mem), "look"))
            if kept:
                series.append({"rank": rank, "source": "counter" if kept[-1][3] == "step" else "memory",
                               "unit": kept[-1][3], "x": [p[0] for p in kept], "step_s": [p[1] for p in kept],
                               "memory_mb": [p[2] for p in kept]})
        for rank in [r for r in self._kept if r not in set(ranks)]:
            del self._kept[rank]  # a rank the job no longer lists
        return {"steps": self.steps, "series": series}


def _num(value: Any) -> Optional[float]:
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return float("%.4g" % number) if math.isfinite(number) else None


def _by_rank(rows: Rows) -> Dict[int, List[Dict[str, Any]]]:
    out: Dict[int, List[Dict[str, Any]]] = {}
    for row in rows.as_dicts():
        out.setdefault(int(row["rank"]), []).append(row)
    return out


# -- the sources ---------------------------------------------------------------------------------------


Commands = Callable[[Optional[Sequence[int]], str], str]


class JobSource:
    """Every rank of a job; ``make`` returns a fresh Cluster (discovered again) for each gathering."""

    single = False

    def __init__(self, make: Callable[[], Any], command: Commands, label: str, deadline: float,
                 diagnose_deadline: float) -> None:
        self.make = make
        self.command = command
        self.label = label
        self.deadline = deadline
        self.diagnose_deadline = diagnose_deadline

    def _cluster(self) -> Any:
        cluster = self.make()
        cluster.progress = None
        cluster.deadline = min(cluster.deadline, self.deadline)
        return cluster

    def diagnose(self) -> Tuple[Any, Any]:
        """diagnose's report, and its last look (every rank's evidence)."""
        from probe.diagnose.engine import diagnose, sampler_for

        cluster = self.make()
        cluster.progress = None
        return _diagnosed(diagnose, sampler_for(cluster, False), self.diagnose_deadline, self.command)

    def overview(self) -> Dict[str, Any]:
        """The members as the helpers list them, and their stacks grouped as ``--all-ranks backtrace`` does;
        ``unlisted``: the ranks below the job's world size that no helper lists (the command says them too)."""
        cluster = self._cluster()
        members = [dict(zip(MEMBER_COLUMNS, (cell(getattr(m, c)) for c in MEMBER_COLUMNS))) for m in cluster.members]
        unlisted, unlisted_count = unlisted_ranks(members)
        try:
            grouped = cluster.backtrace_groups()
            threads, outside = grouped.threads, grouped.outside
        except NoRankAnswered:
            threads, outside = {}, {}
        return {"members": members, "threads": threads, "outside": {str(r): n.splitlines()[0] for r, n in outside.items()},
                "failures": failures_json(cluster.failures), "total": len(cluster.members) + unlisted_count,
                "asked_directly": list(cluster.asked_directly), "unlisted": unlisted, "unlisted_count": unlisted_count}

    def rank(self, rank: int) -> Dict[str, Any]:
        """One rank's stacks (read from outside where it cannot answer) and its process.info row."""
        chosen = self._cluster().select([rank])
        out: Dict[str, Any] = {"rank": rank, "command": self.command([rank], "backtrace")}
        answers = chosen.map(lambda c: c.backtrace())
        if answers:
            out["threads"] = frames_json(answers[0].value)
            out["note"] = answers[0].note
        else:
            out["error"] = chosen.failures[0].reason if chosen.failures else "no answer"
        process = chosen.query_rows("SELECT * FROM process.info", empty_if_none=True)
        out["process"] = process.as_dicts()[0] if process.rows else None
        if out["process"]:
            out["process"] = {k: cell(v) for k, v in out["process"].items()}
        elif chosen.failures:
            out["process_error"] = chosen.failures[0].reason
        return out

    def sql(self, sql: str, rank: Optional[int], merge: Optional[str], max_rows: int) -> Dict[str, Any]:
        """``--all-ranks query`` (``--merge`` run here on the union), ``--ranks N query``, or SQL over
        ``cluster.ranks`` run here, as ``query`` does."""
        from probe.client.local_sql import names_members, rows_of, run_on_members

        cluster = self._cluster()
        if names_members(sql):
            if merge:
                raise ProbeError("--merge groups the rows of several ranks; cluster.ranks is one table already")
            return dict(rows_json(rows_of(run_on_members(sql, cluster.ranks, max_rows, None, cluster))), failures=[])
        if rank is not None:
            cluster = cluster.select([rank])
        if merge:
            from probe.client.merge import merge_rows

            rows = rows_of(merge_rows(cluster.query(sql, max_rows=max_rows, empty_if_none=True), merge))
        else:
            rows = cluster.query_rows(sql, max_rows=max_rows, empty_if_none=True)
        return dict(rows_json(rows), failures=failures_json(cluster.failures))

    def metrics(self, history: StepHistory) -> Dict[str, Any]:
        """Step time and memory per rank: three ``--all-ranks query`` calls (the trace, the step counter,
        RSS), each rank's last N steps kept in ``history``."""
        cluster = self._cluster()
        ranks = [m.rank for m in cluster.members]
        trace = _by_rank(cluster.query_rows(TRACE_SQL.format(n=history.steps), empty_if_none=True))
        counter = {r: rows[0] for r, rows in _by_rank(cluster.query_rows(COUNTER_SQL, empty_if_none=True)).items()}
        memory = {r: rows[0].get("memory_mb") for r, rows in
                  _by_rank(cluster.query_rows(MEMORY_SQL, empty_if_none=True)).items()}
        out = history.update(trace, counter, memory, ranks)
        out["queries"] = [self.command(None, "query %s" % _quoted(q)) for q in
                          (TRACE_SQL.format(n=history.steps), COUNTER_SQL, MEMORY_SQL)]
        return out

    def trace_events(self) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
        """Every rank's trace for Perfetto (``trace export``), and the ranks that gave none."""
        cluster = self._cluster()
        events: List[Dict[str, Any]] = []
        for answer in cluster.map(lambda c: c.trace_export()):
            events.extend(answer.value.get("traceEvents", []))
        return events, failures_json(cluster.failures)


class ProcessSource:
    """One process (``probe PID page``); ``make`` returns a fresh Client for each gathering."""

    single = True

    def __init__(self, make: Callable[[], Any], command: Commands, label: str, deadline: float,
                 diagnose_deadline: float) -> None:
        self.make = make
        self.command = command
        self.label = label
        self.deadline = deadline
        self.diagnose_deadline = diagnose_deadline

    def diagnose(self) -> Tuple[Any, Any]:
        from probe.diagnose.engine import diagnose, sampler_for

        return _diagnosed(diagnose, sampler_for(self.make(), True), self.diagnose_deadline, self.command)

    def _pid(self, client: Any) -> Optional[int]:
        return client.target.pid

    def overview(self) -> Dict[str, Any]:
        client = self.make()
        member: Dict[str, Any] = {c: None for c in MEMBER_COLUMNS}
        member.update(rank=0, host=socket.gethostname() if client.target.is_local else client.target.label,
                      pid=self._pid(client), state="running")
        try:
            frames = client.backtrace()
            threads = {name: {key: [0]} for name, key in thread_stacks(frames).items()}
            outside = {"0": client.note.splitlines()[0]} if client.note else {}
            failures: List[Dict[str, Any]] = []
        except ProbeError as exc:
            threads, outside = {}, {}
            failures = [{"rank": 0, "host": member["host"], "reason": _reason(exc)}]
            member["state"] = "silent"
        return {"members": [member], "threads": threads, "outside": outside, "failures": failures, "total": 1,
                "asked_directly": []}

    def rank(self, rank: int) -> Dict[str, Any]:
        client = self.make()
        out: Dict[str, Any] = {"rank": 0, "command": self.command(None, "backtrace")}
        try:
            out["threads"] = frames_json(client.backtrace())
            out["note"] = client.note
        except ProbeError as exc:
            out["error"] = _reason(exc)
        try:
            rows = client.query_rows("SELECT * FROM process.info", timeout=self.deadline)
            out["process"] = {k: cell(v) for k, v in rows.as_dicts()[0].items()} if rows.rows else None
        except ProbeError as exc:
            out["process_error"] = _reason(exc)
        return out

    def sql(self, sql: str, rank: Optional[int], merge: Optional[str], max_rows: int) -> Dict[str, Any]:
        if merge:
            raise ProbeError("--merge runs over the rows of several ranks, and this is one process")
        rows = self.make().query_rows(sql, max_rows=max_rows, timeout=self.deadline)
        return dict(rows_json(rows), failures=[])

    def metrics(self, history: StepHistory) -> Dict[str, Any]:
        client = self.make()
        trace: Dict[int, List[Dict[str, Any]]] = {}
        counter: Dict[int, Dict[str, Any]] = {}
        memory: Dict[int, Optional[float]] = {}
        for sql, keep in ((TRACE_SQL.format(n=history.steps), lambda rows: trace.__setitem__(0, rows)),
                          (COUNTER_SQL, lambda rows: counter.__setitem__(0, rows[0]) if rows else None),
                          (MEMORY_SQL, lambda rows: memory.__setitem__(0, rows[0]["memory_mb"]) if rows else None)):
            try:
                keep(client.query_rows(sql, timeout=self.deadline).as_dicts())
            except ProbeError:
                continue  # torch not loaded, the trace off, the agent unable to answer: no point this look
        out = history.update(trace, counter, memory, [0])
        out["queries"] = [self.command(None, "query %s" % _quoted(q)) for q in
                          (TRACE_SQL.format(n=history.steps), COUNTER_SQL, MEMORY_SQL)]
        return out

    def trace_events(self) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
        client = self.make()
        try:
            return list(client.trace_export().get("traceEvents", [])), []
        except ProbeError as exc:
            return [], [{"rank": 0, "host": client.target.label, "reason": _reason(exc)}]


def _reason(exc: ProbeError) -> str:
    return exc.message + (" -- %s" % exc.hint if exc.hint else "")


def _quoted(sql: str) -> str:
    import shlex

    return shlex.quote(sql)


def _diagnosed(diagnose: Any, inner: Any, deadline: float, command: Commands) -> Tuple[Any, Any]:
    """diagnose's report with the sampler the command uses, keeping its last look for the grid."""
    looks: List[Any] = []

    def sampler(*args: Any) -> Any:
        sample = inner(*args)
        looks.append(sample)
        return sample

    report = diagnose(sampler, deadline, command)
    return report, (looks[-1] if looks else None)


def diagnose_json(report: Any, sample: Any, at: float) -> Dict[str, Any]:
    """The report as ``diagnose --json`` gives it, its text as the command prints it, and what the last
    look saw of each rank (its state, why, where its stacks came from)."""
    from probe.cli.commands.diagnose import render

    states: Dict[str, Any] = {}
    if sample is not None:
        for rank, ev in sample.ranks.items():
            states[str(rank)] = {"state": ev.state, "why": ev.why, "source": ev.source, "holder": ev.holder}
    culprits = sorted(report.verdicts[0].culprits) if report.verdicts else []  # the verdict at the top's
    return dict(cell(report.as_json()), lines=render(report), states=states, culprits=culprits,
                at=time.strftime("%H:%M:%S", time.localtime(at)))
