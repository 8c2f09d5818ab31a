"""Across ranks directly vs through the node helpers: ``ranks``, ``--all-ranks query`` and ``--all-ranks
backtrace`` on 256 and 1024 registered agents (8 and 32 ranks a node), and a simulated 16,384-rank job
(2,048 node helpers) through the helpers; wall time and the client's CPU, median and spread.

    python bench/bench_fanout_helpers.py [--runs 7] [--sizes 256,1024] [--per-node 8,32]
                                         [--big 16384] [--big-per-node 8] [--small 8,16,32,64]

SIMULATED AGENTS. A real agent costs 20-90 MB, so 1024 of them do not fit here. Each rank is a pair of
listening sockets (TCP for the direct path, the unix socket at ``probe._paths.socket_path(PID)`` of a
made-up pid for its node helper) served by a small single-threaded server (a few processes, many ranks
each) that speaks the two endpoints the fan-out uses, ``GET /v1/backtrace`` and ``POST /v1/query``,
with canned answers: 3 threads of 12 frames, one rank in 64 with another main-thread stack; one row for
the query (with ``Live``, used by bench_diagnose.py: rows made per SQL text for ``probe diagnose``'s queries,
advancing with wall time as a job making steps would). What that leaves out: the agents' own work (a real
agent spends ~4 ms of CPU a query, and its interpreter shares the GIL with the program), their memory,
and the GIL-held or dead rank (the tests cover those). The client is the real one (``probe.client.cluster``, discovery included).

NODE HELPERS: real ``probe.host.helper.Helper`` objects serving HTTP on their own TCP listener (the
same listener class as the agent's), several to a process; only their member list is simulated (the
ranks given, not children or registrations), and the master's helper gets the other nodes' reports
(``POST /v1/nodes``) from this script. For the 16,384-rank job the ranks are not served at all: each
helper answers for its ranks from the same canned stacks and rows (``probe.host.gather._client`` swapped
for a canned one, in the helpers' processes only), so what is timed is the client, discovery through
the master's helper, and the helpers' gathering and answering. (bench_diagnose.py's 16,384-rank job goes
further: a helper process collects and encodes one node's evidence a look, and serves every other node of
the process those bytes renumbered: ``_one_node_gathers``, ``_one_node_answers``.)

"client CPU s" is ``time.process_time()`` of this process (the client) over the call.
"""

import argparse
import json
import os
import selectors
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

from _common import REPO, Summary, clean_env, figure, header, table, verdict

sys.path.insert(0, REPO)

TOKEN = "bench-fanout-helpers-token"
SQL = "SELECT count(*) AS threads FROM python.threads"
PID_BASE = 100000  # above /proc/sys/kernel/pid_max here: no live process has these pids


# -- canned answers -------------------------------------------------------------------------------


def _stack(main_tail: str, main_line: int = 100) -> Dict[str, Any]:
    frames, threads = [], []
    names = [("MainThread", True, ["<module>", "main", "train", "step", "forward", "backward", "allreduce",
                                   "wait", "_wait", "poll", "select", main_tail]),
             ("pin_memory", False, ["_bootstrap", "_bootstrap_inner", "run", "_pin_memory_loop", "get", "wait",
                                    "wait", "acquire", "loop", "poll", "select", "sleep"]),
             ("probe-agent", False, ["_bootstrap", "_bootstrap_inner", "run", "_accept_loop", "poll", "select",
                                     "wait", "wait", "acquire", "loop", "poll", "idle"])]
    for tid, (name, is_main, funcs) in enumerate(names):
        chain = []
        for depth, func in enumerate(reversed(funcs)):  # innermost first
            chain.append(len(frames))
            line = (main_line if is_main and depth == 0 else 100) + depth
            frames.append([func, "/opt/venv/lib/python3.11/site-packages/trainer/%s.py" % name, line, None])
        threads.append([1000 + tid, name, 2000 + tid, is_main, chain])
    return {"frames": frames, "threads": threads}


BACKTRACES = [json.dumps(_stack("recv")).encode(), json.dumps(_stack("straggler")).encode()]
QUERY = json.dumps({"columns": [{"name": "threads", "type": "BIGINT"}], "rows": [[3]], "truncated": False}).encode()


class Live:
    """Answers of a HEALTHY, PROGRESSING job (``probe diagnose``'s bench): every rank steps its optimizer every
    ``STEP_S`` seconds of wall time since ``t0`` (the same count on every rank, as under DDP), its threads gain
    CPU as the time goes, its main thread's innermost line moves with the step; the Flight Recorder, the trace
    and torch.anomalies are empty (off), its RSS flat. Rows are made per SQL text, for the queries
    ``probe.diagnose`` sends (any other SQL gets the canned row)."""

    STEP_S = 0.1

    def __init__(self, t0: float) -> None:
        from probe.diagnose import evidence, memory, progress, training

        self.t0 = t0
        self.stacks = [[json.dumps(_stack(tail, 100 + k)).encode() for k in range(4)] for tail in ("recv", "straggler")]
        from probe.page import data

        self.by_sql = {evidence.THREADS_SQL: self.threads, evidence.FR_SQL: self.fr, evidence.TRACE_SQL: self.trace,
                       progress.STEPS_SQL: self.steps, training.ANOMALIES_SQL: self.anomalies,
                       memory.RSS_SQL: self.rss,
                       # the page's metrics (its default 50 steps): the trace off, the step counter, RSS
                       data.TRACE_SQL.format(n=50): lambda rank, age: ([("step", "BIGINT"), ("step_s", "DOUBLE"),
                                                                        ("memory_mb", "DOUBLE")], []),
                       data.COUNTER_SQL: lambda rank, age: ([("steps", "BIGINT"), ("step_s", "DOUBLE")],
                                                            [[int(age / self.STEP_S), self.STEP_S]]),
                       data.MEMORY_SQL: lambda rank, age: ([("memory_mb", "DOUBLE")], [[2147.5 + rank * 0.004]])}

    def backtrace(self, rank: int) -> bytes:
        return self.stacks[rank % 64 == 7][int((time.time() - self.t0) / self.STEP_S) % 4]

    def query(self, rank: int, body: bytes) -> bytes:
        try:
            make = self.by_sql.get(json.loads(body)["sql"])
        except (ValueError, KeyError, TypeError):
            make = None
        if make is None:
            return QUERY
        columns, rows = make(rank, time.time() - self.t0)
        return json.dumps({"columns": [{"name": n, "type": t} for n, t in columns], "rows": rows,
                           "truncated": False}).encode()

    def threads(self, rank: int, age: float) -> Any:
        return ([("thread_id", "BIGINT"), ("thread_name", "VARCHAR"), ("is_main", "BOOLEAN"), ("is_agent", "BOOLEAN"),
                 ("cpu", "DOUBLE")],
                [[1000, "MainThread", True, False, 0.9 * age], [1001, "pin_memory", False, False, 0.05 * age],
                 [1002, "probe-agent", False, True, 0.01 * age]])

    def fr(self, rank: int, age: float) -> Any:
        return [(n, "VARCHAR") for n in ("pg", "pg_desc", "last_seq", "last_op", "last_done", "last_age", "period",
                                         "call_site", "entries")], []

    def trace(self, rank: int, age: float) -> Any:  # an aggregate over the empty trace: one row of NULLs
        names = ("step", "last_age", "entries", "compute", "top_module", "step_s")
        return [(n, "DOUBLE") for n in names], [[None, None, 0, None, None, None]]

    def steps(self, rank: int, age: float) -> Any:
        count = int(age / self.STEP_S)
        return ([("optimizer", "VARCHAR"), ("steps", "BIGINT"), ("last_age", "DOUBLE"), ("step_last", "DOUBLE"),
                 ("step_s", "DOUBLE"), ("step_times", "INTEGER")],
                [["SGD@0x7f3a5c0e1d90", count, age - count * self.STEP_S, self.STEP_S, self.STEP_S, min(count, 64)]])

    def anomalies(self, rank: int, age: float) -> Any:
        return [(n, "VARCHAR") for n in ("step", "module", "stage", "kind", "shape", "loss", "total", "last_step",
                                         "last_loss")], []

    def rss(self, rank: int, age: float) -> Any:
        return [("rss", "BIGINT")], [[2 * 1024 ** 3 + rank * 4096]]


LIVE: Any = None  # a Live where the agents answer as a progressing job (role ``agents FIRST COUNT T0``)


_NONCES: Any = None


def _hello(head: bytes, local: str) -> bytes:
    """The listener's half of the token handshake (``probe.agent.handshake``), which every TCP request of the
    client starts with: a fresh nonce and the proof for the job's token. The request that follows is answered
    without checking its MAC (a simulated agent does no agent work)."""
    global _NONCES
    from probe.agent import handshake

    if _NONCES is None:
        _NONCES = handshake.Nonces()
    headers = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    return json.dumps(handshake.hello([(TOKEN.encode(), 3, "token")], {3: "eval"}, _NONCES, headers, local)).encode()


def _answer(rank: int, head: bytes, request: bytes = b"", local: str = "") -> bytes:
    if head.startswith(b"GET /v1/hello"):
        body = _hello(head, local)
    elif head.startswith(b"GET /v1/backtrace"):
        body = BACKTRACES[rank % 64 == 7] if LIVE is None else LIVE.backtrace(rank)
    elif head.startswith(b"POST /v1/query"):
        body = QUERY if LIVE is None else LIVE.query(rank, request)
    else:
        body = b'{"error": {"code": "not_found", "message": "a simulated agent serves backtrace and query only"}}'
        return b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
            % (len(body), body))


# -- roles: simulated agents, node helpers ----------------------------------------------------------


def role_agents(first: int, count: int) -> None:
    """Ranks ``first`` .. ``first + count - 1``: a TCP and a unix listener each, one thread for all."""
    from probe import _paths

    sel = selectors.DefaultSelector()
    paths, ports = [], []
    for rank in range(first, first + count):
        tcp = socket.socket()
        tcp.bind(("127.0.0.1", 0))
        tcp.listen(1024)
        path = _paths.socket_path(PID_BASE + rank)
        try:
            os.unlink(path)
        except OSError:
            pass
        unix = socket.socket(socket.AF_UNIX)
        unix.bind(path)
        unix.listen(1024)
        for sock in (tcp, unix):
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ, (rank, None))
        paths.append(path)
        ports.append(tcp.getsockname()[1])
    print("AGENTS %s" % " ".join(map(str, ports)), flush=True)
    beat = 0.0
    while True:
        now = time.monotonic()
        if now - beat > 0.2:  # the agent's heartbeat: its socket's mtime (a stale one is looked at from outside)
            beat = now
            for path in paths:
                os.utime(path)
        for key, _ in sel.select(0.2):
            rank, buf = key.data
            if buf is None:  # a listener
                try:
                    conn, _addr = key.fileobj.accept()  # type: ignore[union-attr]
                except BlockingIOError:
                    continue
                conn.setblocking(False)
                sel.register(conn, selectors.EVENT_READ, (rank, bytearray()))
                continue
            conn = key.fileobj
            try:
                chunk = conn.recv(65536)  # type: ignore[union-attr]
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            buf += chunk
            end = buf.find(b"\r\n\r\n")
            if chunk and end >= 0:
                head = bytes(buf[:end])
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                if len(buf) - end - 4 < length:
                    continue
                conn.setblocking(True)  # type: ignore[union-attr]
                conn.settimeout(2.0)  # type: ignore[union-attr]
                try:
                    local = ""
                    if conn.family == socket.AF_INET:  # type: ignore[union-attr]
                        local = "%s:%d" % conn.getsockname()  # type: ignore[union-attr]
                    conn.sendall(_answer(rank, head, bytes(buf[end + 4:end + 4 + length]), local))  # type: ignore[union-attr]
                except OSError:
                    pass
            elif chunk:
                continue
            sel.unregister(conn)
            conn.close()


class _Canned:
    """Stands for a rank's agent inside a helper (the 16,384-rank job): the canned answers, no I/O."""

    note = None
    _frames: List[Any] = []

    def __init__(self, member: Dict[str, Any], asked: Any) -> None:
        self.rank = member["rank"]

    def backtrace(self) -> Any:
        return _Canned._frames[self.rank % 64 == 7]

    def _answer_wait(self, limit: Any, default: float) -> float:
        return 10.0

    def _json(self, method: str, path: str, body: Any = None, timeout: Any = None) -> Dict[str, Any]:
        return json.loads(QUERY)


class _CannedLive(_Canned):
    """A rank's agent inside a helper, answering as ``Live`` does (``probe diagnose``'s evidence of a healthy
    job making steps), from memory: the helper's own work (``probe.diagnose.evidence.collect`` for each rank,
    its answer) is what runs, with no request to any rank."""

    live: Any = None
    frames: List[List[Any]] = []  # [stack variant][line step]: the frames of each canned stack

    class _Target:
        core = None
        is_local = True

        def __init__(self, pid: int) -> None:
            self.pid = pid
            self.label = "pid %d" % pid

    def __init__(self, member: Dict[str, Any], asked: Any) -> None:
        super().__init__(member, asked)
        self.target = self._Target(member["pid"])

    def backtrace(self, native: bool = False, fallback: bool = True) -> Any:
        step = int((time.time() - self.live.t0) / self.live.STEP_S) % 4
        return self.frames[self.rank % 64 == 7][step]

    def query_rows(self, sql: str, max_rows: Any = None, timeout: Any = None, **_: Any) -> Any:
        from probe.client.results import Rows

        make = self.live.by_sql.get(sql)
        if make is None:
            return Rows((("threads", "BIGINT"),), [[3]])
        columns, rows = make(self.rank, time.time() - self.live.t0)
        return Rows(tuple(columns), rows)

    def _json(self, method: str, path: str, body: Any = None, timeout: Any = None) -> Dict[str, Any]:
        """A gathered query (the page's metrics) answered as ``Live`` answers that SQL."""
        make = self.live.by_sql.get(json.loads(body)["sql"]) if path == "/v1/query" and body else None
        if make is None:
            return super()._json(method, path, body, timeout)
        columns, rows = make(self.rank, time.time() - self.live.t0)
        return {"columns": [{"name": n, "type": t} for n, t in columns], "rows": rows, "truncated": False}

    def table_rows(self, name: str, max_rows: Any = None, columns: Any = None) -> Any:
        from probe.errors import NotFound

        raise NotFound("a simulated agent serves backtrace and query only")


def _canned_frames(raw: bytes) -> List[Any]:
    from probe.client.results import Frame

    decoded = json.loads(raw)
    frames = []
    for thread_id, name, native_id, is_main, chain in decoded["threads"]:
        for depth, position in enumerate(chain):
            func, file, lineno, code = decoded["frames"][position]
            frames.append(Frame(thread_id, name, native_id, is_main, depth, func, file, lineno, code))
    return frames


def _one_node_gathers(gather: Any) -> None:
    """The helpers of this process stand for nodes that work at once: within one look, the ranks of one node
    are collected (``probe.diagnose.evidence.collect`` over canned agents, at once, as a node helper does it),
    and every node's rank of the same local number answers with that evidence, renumbered. So this process
    does one node's work a look, as each of a real job's nodes does at once on its own cores (a 2-core
    machine cannot run 2,048 nodes' work at once); everything else runs as it would: every node's request,
    answer and encoding, the client's reading of every rank's evidence and its rules. Each gather asks its
    ranks one at a time (they answer from memory): a runner a node, not 8 (16,384 threads here)."""
    import copy
    import dataclasses
    import threading

    real, fan_out = gather._evidence, gather._fan_out
    kept: Dict[str, Any] = {"last": -1.0, "evs": {}}
    lock = threading.Lock()

    def collect_node(members: List[Dict[str, Any]], asked: Any, budget: Any) -> Dict[int, Any]:
        out: Dict[int, Any] = {}

        def one(member: Dict[str, Any]) -> None:
            out[member["local_rank"]] = real(member, asked, budget)

        threads = [threading.Thread(target=one, args=(m,)) for m in members]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return out

    def shared_fan_out(helper: Any, members: List[Dict[str, Any]], work: Any, in_flight: int, deadline: float) -> Any:
        return fan_out(helper, members, work, 1, deadline)

    def shared(member: Dict[str, Any], asked: Any, budget: Any) -> Any:
        with lock:
            # A look's requests carry one since_s (0 at a first look, then the seconds since it) and come one
            # after another while it lasts (at 16k ranks, seconds): another since_s, or a pause of 0.6 s
            # without a request, is the next look.
            if time.monotonic() - kept["last"] > 0.6 or kept.get("since") != asked.since_s:
                kept["since"] = asked.since_s
                local = [m for m in SIM_NODES[0].local_members()]
                base = member["rank"] - member["local_rank"]  # the asking node's ranks that sample ahead, here
                mine = copy.copy(asked)
                mine.ahead = frozenset(m["rank"] for m in local if base + m["local_rank"] in getattr(asked, "ahead", ()))
                kept["evs"] = collect_node(local, mine, budget)
            ev = kept["evs"].get(member["local_rank"] % max(1, len(kept["evs"])))
            kept["last"] = time.monotonic()
        return dataclasses.replace(ev, rank=member["rank"], pid=member.get("pid"))

    gather._evidence = shared
    gather._fan_out = shared_fan_out
    _one_node_answers(gather)


def _one_node_answers(gather: Any) -> None:
    """A node's answer to a look, as bytes: the first node of this process asked in a look runs the real
    helper's gather (``probe.host.gather._gather``: its ranks' evidence as above, ``gathered.encode``, the JSON
    of the answer), and every other node of the process is answered with those bytes, its own ranks, pids and
    the evidence's ages (as old as they are now) put in. A real node builds its answer on its own cores, at the
    same time as the others: what this machine runs for each node is what the client's side of the wire
    sees (its connections, the handshake and the request, served by the real listener and ``gather``'s
    checks, and the answer's bytes), not 2,048 nodes' encoding on 2 cores."""
    import re
    import threading

    real = gather._gather
    kept: Dict[str, Any] = {"last": -1.0, "since": None, "body": None, "at": 0.0}
    lock = threading.Lock()
    item = re.compile(rb'\{"rank": (\d+), "age": ([0-9.e+-]+), "pid": (\d+)')
    head = re.compile(rb'^\{"op": "evidence", "ranks": \[([\d, ]*)\]')

    def answer(helper: Any, asked: Any) -> Any:
        if asked.op != "evidence" or asked.ranks is None:
            return real(helper, asked)
        with lock:
            fresh = time.monotonic() - kept["last"] > 0.6 or kept["since"] != asked.since_s
            if fresh:
                got = real(helper, asked)
                if got.status != 200:
                    return got
                kept.update(since=asked.since_s, body=bytes(got.body), at=time.monotonic(),
                            base=min(asked.ranks), n=len(asked.ranks))
            kept["last"] = time.monotonic()
            body, at, base = kept["body"], kept["at"], kept["base"]
        if fresh:
            return got
        if len(asked.ranks) != kept["n"]:  # a node of another size: its own answer
            return real(helper, asked)
        shift, later = min(asked.ranks) - base, time.monotonic() - at
        body = head.sub(lambda m: b'{"op": "evidence", "ranks": [%s]' % b", ".join(
            b"%d" % (int(r) + shift) for r in m.group(1).split(b", ") if r), body, count=1)
        body = item.sub(lambda m: b'{"rank": %d, "age": %.4f, "pid": %d' % (
            int(m.group(1)) + shift, float(m.group(2)) + later, int(m.group(3)) + shift), body)
        return gather.Response(200, body)

    gather._gather = answer


SIM_NODES: List[Any] = []  # this process's simulated node helpers


def role_helpers(spec_path: str) -> None:
    """The node helpers of a spec file: [{"node", "ranks": [[rank, port], ...], "master": bool}], each
    a real Helper on its own TCP listener; prints ``HELPER node port`` for each, then ``READY``."""
    from probe.agent.listener import Listener
    from probe.host import gather, helper as helper_mod

    with open(spec_path) as handle:
        spec = json.load(handle)
    if spec["canned"]:
        from probe.client.client import Client  # noqa: F401  (imported before timing)

        for raw in BACKTRACES:
            _Canned._frames.append(_canned_frames(raw))
        gather._client = _Canned  # type: ignore[assignment]
        if spec.get("live") is not None:  # diagnose's evidence, as a job making steps (bench_diagnose.py)
            from probe.diagnose import evidence  # noqa: F401  (imported before timing)

            _CannedLive.live = Live(spec["live"])
            _CannedLive.frames = [[_canned_frames(raw) for raw in variants] for variants in _CannedLive.live.stacks]
            gather._client = _CannedLive  # type: ignore[assignment]
            if spec.get("one_node"):
                _one_node_gathers(gather)

    class SimHelper(helper_mod.Helper):
        def __init__(self, node: int, ranks: List[List[int]], world: int) -> None:
            super().__init__(60000, TOKEN, None)
            self.sim_node, self.sim_ranks, self.sim_world = node, ranks, world
            self.sim_members: List[Dict[str, Any]] = []

        def local_members(self) -> List[Dict[str, Any]]:
            return self.sim_members

        def outside(self, pid_text: str) -> Dict[str, Any]:
            return {"state": "running", "message": "a simulated rank"}

    out = []
    for node in spec["nodes"]:
        sim = SimHelper(node["node"], node["ranks"], spec["world"])
        listener = Listener.tcp("127.0.0.1", 0, sim, keep_alive=True)  # as Helper.listen_tcp
        listener.start()
        host = helper_mod.node_host() if node.get("master") else "127.0.0.1"
        sim.sim_members = [{"rank": rank, "local_rank": i, "world_size": spec["world"], "node": node["node"],
                            "host": host, "port": port, "pid": PID_BASE + rank, "state": "running", "restarts": 0,
                            "heartbeat_age": 0.1, "helper": "127.0.0.1:%d" % listener.port}
                           for i, (rank, port) in enumerate(node["ranks"])]
        out.append((sim, listener))
        SIM_NODES.append(sim)
        print("HELPER %d %d" % (node["node"], listener.port), flush=True)
    print("READY", flush=True)
    if os.environ.get("PROBE_BENCH_PROFILE") and spec["nodes"][0]["node"] == int(os.environ.get("PROBE_BENCH_PROFILE_NODE", "0")):
        _profile_until_signal(os.environ["PROBE_BENCH_PROFILE"])
    sys.stdin.read()  # until the bench closes our stdin (or dies)


def _profile_until_signal(path: str) -> None:
    """A cProfile of this helper process's threads (each its own profiler, merged), written to ``path``
    at SIGUSR1 (bench_diagnose.py --profile: where a helper's time goes in a look)."""
    import cProfile
    import pstats
    import signal
    import threading

    profs: List[cProfile.Profile] = []

    def start_in_thread(*_: object) -> None:
        prof = cProfile.Profile(time.thread_time)  # CPU time: a thread waiting costs nothing
        profs.append(prof)
        prof.enable()

    def dump(*_: object) -> None:
        threading.setprofile(None)  # type: ignore[arg-type]
        with open(path, "w") as out:
            stats = pstats.Stats(*profs, stream=out) if profs else None
            if stats is not None:
                stats.sort_stats("tottime").print_stats(40)
                stats.sort_stats("cumulative").print_stats(40)

    threading.setprofile(start_in_thread)
    signal.signal(signal.SIGUSR1, dump)


# -- the bench ------------------------------------------------------------------------------------


class Job:
    """Simulated agents (unless canned) and node helpers for ``world`` ranks, ``per_node`` a node."""

    def __init__(self, world: int, per_node: int, canned: bool, runtime: str, agent_procs: int, helper_procs: int,
                 env: Dict[str, str], live: bool = False, one_node: bool = False) -> None:
        self.world, self.per_node = world, per_node
        live_args = [repr(time.time())] if live else []  # the agents answer as a progressing job (Live)
        self.procs: List[subprocess.Popen] = []
        ports = [20000 + r % 40000 for r in range(world)]  # canned: never connected to
        try:
            if not canned:
                ports = []
                step = -(-world // agent_procs)
                for first in range(0, world, step):
                    proc = self._start(["agents", str(first), str(min(step, world - first)), *live_args], env)
                    line = proc.stdout.readline().split()  # type: ignore[union-attr]
                    assert line and line[0] == "AGENTS", line
                    ports.extend(int(p) for p in line[1:])
            nodes = [{"node": n, "ranks": [[r, ports[r]] for r in range(n * per_node, min(world, (n + 1) * per_node))],
                      "master": n == 0} for n in range(-(-world // per_node))]
            self.helpers: Dict[int, int] = {}
            # Node k in process k % helper_procs: the client asks the nodes in order, many at once, and those
            # in flight together are spread over the processes (nodes work at once, each on its own cores)
            # rather than all waiting on one process's GIL.
            procs = min(helper_procs, len(nodes))
            for at in range(procs):
                path = os.path.join(runtime, "spec-%d-%d-%d.json" % (world, per_node, at))
                with open(path, "w") as handle:
                    json.dump({"canned": canned, "world": world, "nodes": nodes[at::procs],
                               "live": float(live_args[0]) if live_args else None, "one_node": one_node}, handle)
                proc = self._start(["helpers", path], env, stdin=True)
                for line in proc.stdout:  # type: ignore[union-attr]
                    words = line.split()
                    if words[0] == "READY":
                        break
                    self.helpers[int(words[1])] = int(words[2])
            assert len(self.helpers) == len(nodes), (len(self.helpers), len(nodes))
            self.nodes = nodes
            self.report()
        except BaseException:
            self.close()
            raise

    def _start(self, argv: List[str], env: Dict[str, str], stdin: bool = False) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", *argv], env=env, text=True,
                                stdout=subprocess.PIPE, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    @property
    def master(self) -> str:
        return "127.0.0.1:%d" % (self.helpers[0] + 1)  # PROBE_PORT: the helper listens on PROBE_PORT - 1

    def report(self) -> None:
        """Every other node's report to the master's helper (as their helpers send it every second)."""
        from probe.client import transport

        for node in self.nodes[1:]:
            members = [{"rank": r, "local_rank": i, "world_size": self.world, "port": port, "pid": PID_BASE + r,
                        "state": "running", "restarts": 0, "heartbeat_age": 0.1}
                       for i, (r, port) in enumerate(node["ranks"])]
            body = json.dumps({"node": node["node"], "host": "127.0.0.1", "members": members,
                               "helper": "127.0.0.1:%d" % self.helpers[node["node"]]}).encode()
            answer = transport.request(transport.TcpAddress("127.0.0.1", self.helpers[0]), "POST", "/v1/nodes", body,
                                       None, 10.0, token=TOKEN)
            assert answer.status == 200, bytes(answer.body)[:300]

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait(10)
            for stream in (proc.stdin, proc.stdout):
                if stream:
                    stream.close()


def timed(job: Job, what: str, via: str) -> List[float]:
    """One call as the CLI makes it (discovery, then the fan-out): [wall s, client CPU s, ranks answered,
    distinct main-thread stacks]."""
    from probe.client.cluster import connect_all

    start, cpu = time.perf_counter(), time.process_time()
    cluster = connect_all(job.master, token=TOKEN, deadline=30.0, timeout=30.0)
    cluster.via = via
    if what == "ranks":
        got, distinct = len(cluster.ranks_rows().rows), 0
    elif what == "query":
        got, distinct = len(cluster.query_rows(SQL).rows), 0
    else:
        grouped = cluster.backtrace_groups()
        got, distinct = grouped.answered, len(grouped.threads["MainThread"])
    wall, used = time.perf_counter() - start, time.process_time() - cpu
    assert got == job.world and not cluster.failures, (what, via, got, cluster.failures[:3])
    assert not cluster.asked_directly, cluster.asked_directly[:3]
    return [wall, used, got, distinct]


def measure(job: Job, whats: List[str], vias: List[str], runs: int) -> List[List[str]]:
    results: Dict[Any, List[List[float]]] = {(w, v): [] for w in whats for v in vias}
    for what in whats:
        for v in vias:
            timed(job, what, v)  # warm: imports, first connections
    for i in range(runs):
        job.report()  # fresh reports (a node unreported for 5 s is shown so)
        order = [(w, v) for w in whats for v in vias]
        for key in (order if i % 2 == 0 else order[::-1]):
            results[key].append(timed(job, *key))
    rows = []
    for (what, via), values in results.items():
        wall = Summary.of(v[0] for v in values)
        cpu = Summary.of(v[1] for v in values)
        peer = results.get((what, "direct")) if via == "helpers" else None
        ratio = ""
        if peer:
            ratio = "%.2fx" % (wall.median / Summary.of(v[0] for v in peer).median)
            figure("%s, %d ranks (%d a node), through the helpers" % (what, job.world, job.per_node),
                   [v[0] for v in values], peer="directly", peer_values=[v[0] for v in peer], unit="s", scale=1.0)
        rows.append([what, str(job.world), str(job.per_node), via, str(wall.n), "%.3f" % wall.median,
                     "%.3f-%.3f" % (wall.q1, wall.q3), "%.3f-%.3f" % (wall.low, wall.high), "%.3f" % cpu.median,
                     "%.3f-%.3f" % (cpu.low, cpu.high), ratio])
    return rows


HEAD = ["call", "ranks", "a node", "via", "n", "median s", "IQR s", "min-max s", "client CPU s", "CPU min-max s",
        "helpers/direct"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--sizes", default="256,1024")
    parser.add_argument("--per-node", default="8,32")
    parser.add_argument("--small", default="8,16,32,64", help="sizes (8 a node) for the threshold of --via auto")
    parser.add_argument("--big", type=int, default=16384)
    parser.add_argument("--big-per-node", type=int, default=8)
    parser.add_argument("--processes", type=int, default=4, help="processes of simulated agents, and of helpers")
    parser.add_argument("--big-processes", type=int, default=8, help="helper processes of the big job")
    args = parser.parse_args()
    if args.role:
        if args.role[0] == "agents":
            if len(args.role) > 3:
                global LIVE
                LIVE = Live(float(args.role[3]))
            role_agents(int(args.role[1]), int(args.role[2]))
        else:
            role_helpers(args.role[1])
        return
    runtime = tempfile.mkdtemp(prefix="probe-bench-")
    os.environ["PROBE_RUNTIME_DIR"] = runtime  # the client's too: no real agent's files are read
    env = dict(clean_env(), PROBE_RUNTIME_DIR=runtime, PROBE_HOST="localhost", PYTHONPATH=REPO)
    header("across ranks: directly vs through the node helpers (SIMULATED agents: see the docstring)", [
        "query: %s; backtrace: 3 threads x 12 frames, 2 distinct main-thread stacks; %d runs, interleaved"
        % (SQL, args.runs),
        "simulated agents: canned answers from a small server (no agent CPU, no GIL, no memory); the node "
        "helpers and the client are probe's own"])
    rows: List[List[str]] = []
    try:
        for n in [int(s) for s in args.small.split(",") if s]:
            job = Job(n, 8, False, runtime, 1, 1, env)
            try:
                rows += measure(job, ["query", "backtrace"], ["direct", "helpers"], args.runs)
            finally:
                job.close()
        for n in [int(s) for s in args.sizes.split(",") if s]:
            for per in [int(p) for p in args.per_node.split(",")]:
                job = Job(n, per, False, runtime, args.processes, args.processes, env)
                try:
                    rows += measure(job, ["ranks", "query", "backtrace"], ["direct", "helpers"], args.runs)
                finally:
                    job.close()
        print(table(rows, HEAD))
        if args.big:
            print()
            job = Job(args.big, args.big_per_node, True, runtime, 1, args.big_processes, env)
            try:
                big = measure(job, ["ranks", "query", "backtrace"], ["helpers"], max(3, args.runs // 2))
            finally:
                job.close()
            print("simulated %d-rank job, %d node helpers (%d ranks each) in %d processes, answering from canned "
                  "stacks and rows:" % (args.big, -(-args.big // args.big_per_node), args.big_per_node,
                                        args.big_processes))
            print(table(big, HEAD))
            for row in big:
                if row[0] != "ranks":
                    print("%s through the helpers: median %s s, goal <= 2 s: %s" % (row[0], row[5],
                                                                                  verdict(float(row[5]) <= 2.0)))
    finally:
        for name in os.listdir(runtime):
            try:
                os.unlink(os.path.join(runtime, name))
            except OSError:
                pass
        os.rmdir(runtime)


if __name__ == "__main__":
    main()
