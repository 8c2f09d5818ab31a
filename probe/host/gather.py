"""``POST /v1/gather``: a node helper asks its own ranks, and answers for all of them at once.

Across many nodes, a client that speaks to every rank itself does work that grows with the ranks: a
connection, a request and an answer to parse each. Through the node helpers it sends one request a
node; each helper asks its local ranks over their unix sockets (the same HTTP API, with the client of
``probe.client.client``: a rank that cannot answer is read from outside as for ``probe PID``), at most
``max_in_flight`` at once and within ``deadline`` seconds, and answers with its part already reduced:

    {"op": "backtrace", "deadline": 5}     the distinct stacks of each thread name with the ranks that
                                           have each: {"threads": {NAME: [[FRAMES, RANKS], ...]}, FRAMES
                                           the JSON text of [[func, file, line], ...], innermost first,
                                           "outside": [[RANK, NOTE], ...], "failed": [...]}
    {"op": "query", "sql": "...",          each rank's rows (JSON, as the agent sends them): {"parts":
     "max_rows": N, "timeout": S,          [{"rank", "columns", "rows", "truncated", "row_cap"}],
     "query_id": ID}                       "outside": [{"rank", "code", "message", "hint", "note", "stacks"}],
                                           "failed": [...]}
    {"op": "evidence", "since_s": S,       ``probe diagnose``'s evidence of each rank, its distinct stacks
     "ahead": [RANK, ...],                 sent once: {"evidence": {"stacks": [...], "ranks": [...]},
     "prefetch": true,                     "failed": [...]} (``probe.diagnose.gathered``); the ranks in
     "known": [DIGEST, ...]}               ``ahead`` take their straggler samples before the look (those
                                           ``prefetch`` had taken after the look before: probe.host.prefetch);
                                           the stacks ``known`` names are sent as ``#DIGEST``

``ranks`` (a list of rank numbers) asks only those of this node's ranks. A rank that gave no answer is
in ``failed`` with the error's ``code``, ``message`` and ``hint`` (for a dead rank, how it died, as
``GET /v1/outside/PID`` says); a rank whose agent cannot answer a query but whose stacks were read from
outside is in ``outside`` with its stacks, for the client to run the SQL on (this process imports no
DuckDB); a rank whose agent cannot run SQL itself is failed with ``sql_unavailable``, which the client
takes as "ask it directly". The helper (an object with ``local_members()`` and ``outside(pid_text)``,
see ``probe.host.helper``) checked the job's token over TCP before this runs.

Bounded: at most ``MAX_GATHERS`` gathers at once (more: 503 busy), the answer at ``MAX_ANSWER_BYTES``
(the ranks past it are failed ``too_large``), each field of the request checked (400 with what is wrong).
"""

import json
import math
import queue
import re
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from probe.agent.http import Request, Response
from probe.client.results import thread_stacks
from probe.errors import BadRequest, Busy, ProbeError, TooLarge

__all__ = ["gather", "MAX_GATHERS", "MAX_ANSWER_BYTES", "GATHER_SHAPE"]

MAX_GATHERS = 4
READ_GATHERS = 2  # of those, at most this many for read-token holders (see gather)
MAX_ANSWER_BYTES = 192 << 20  # below the client's 256 MiB a target (probe.client.transport)
MAX_IN_FLIGHT = 64
DEFAULT_IN_FLIGHT = 8  # unix sockets on one node: a few at once keeps the ranks' caches warm
MAX_DEADLINE_S = 600.0
MAX_SQL_CHARS = 256 << 10
MAX_RANKS = 1 << 16
RAMP_S = 0.005  # how long one runner asks the ranks alone before the others join (see _fan_out)
_MARGIN_S = 0.3  # a rank's own socket waits this much past the deadline, so the deadline names it first
_GATHER_SHAPE = ('{"op": "backtrace" | "query" | "evidence", "deadline": SECONDS, "max_in_flight": N, "ranks": [RANK, ...], '
                 '"sql": "...", "max_rows": N, "timeout": SECONDS, "query_id": "...", "since_s": SECONDS, '
                 '"ahead": [RANK, ...], "prefetch": true, "known": [DIGEST, ...]}')
GATHER_SHAPE = _GATHER_SHAPE

_slots_lock = threading.Lock()
_DIGEST = re.compile(r"[0-9a-f]{16}")  # a stack's digest (probe.diagnose.gathered.digest)

Key = Tuple[Tuple[str, str, int], ...]


class _Asked:
    """A checked gather request."""

    def __init__(self, body: Dict[str, Any]) -> None:
        op = body.get("op")
        if op not in ("backtrace", "query", "evidence"):
            raise BadRequest("a gather's op must be \"backtrace\", \"query\" or \"evidence\", not %s" % _shown(op),
                             hint=_GATHER_SHAPE)
        self.op: str = op
        self.deadline = _seconds(body, "deadline", 10.0, MAX_DEADLINE_S)
        self.max_in_flight = _int(body, "max_in_flight", DEFAULT_IN_FLIGHT, 1, MAX_IN_FLIGHT)
        ranks = body.get("ranks")
        if ranks is not None and not (isinstance(ranks, list) and len(ranks) <= MAX_RANKS and all(
                isinstance(r, int) and not isinstance(r, bool) and 0 <= r < 1 << 31 for r in ranks)):
            raise BadRequest("a gather's ranks must be a list of at most %d rank numbers" % MAX_RANKS, hint=_GATHER_SHAPE)
        self.ranks: Optional[List[int]] = ranks
        self.sql = ""
        self.max_rows: Optional[int] = None
        self.timeout: Optional[float] = None
        self.query_id: Optional[str] = None
        self.scope = "read"
        self.since_s = _seconds(body, "since_s", None, MAX_DEADLINE_S) if body.get("since_s") != 0 else 0.0
        ahead = body.get("ahead", [])
        if not (isinstance(ahead, list) and len(ahead) <= MAX_RANKS and all(
                isinstance(r, int) and not isinstance(r, bool) for r in ahead)):
            raise BadRequest("a gather's ahead must be a list of rank numbers", hint=_GATHER_SHAPE)
        self.ahead = frozenset(ahead)
        prefetch = body.get("prefetch", False)
        if not isinstance(prefetch, bool):
            raise BadRequest("a gather's prefetch must be true or false", hint=_GATHER_SHAPE)
        self.prefetch = prefetch
        known = body.get("known", [])
        if not (isinstance(known, list) and len(known) <= 256 and all(
                isinstance(k, str) and _DIGEST.fullmatch(k) for k in known)):
            raise BadRequest("a gather's known must be a list of at most 256 stack digests (16 hex digits)",
                             hint=_GATHER_SHAPE)
        self.known = frozenset(known)
        if op == "query":
            sql = body.get("sql")
            if not isinstance(sql, str) or not sql.strip() or len(sql) > MAX_SQL_CHARS:
                raise BadRequest("a gathered query needs sql: a string of at most %d characters" % MAX_SQL_CHARS,
                                 hint=_GATHER_SHAPE)
            self.sql = sql
            self.max_rows = _int(body, "max_rows", None, 0, 1 << 40)
            self.timeout = _seconds(body, "timeout", None, MAX_DEADLINE_S)
            query_id = body.get("query_id")
            if query_id is not None and not (isinstance(query_id, str) and 0 < len(query_id) <= 64):
                raise BadRequest("a gather's query_id must be a short string, not %s" % _shown(query_id))
            self.query_id = query_id


def gather(helper: Any, request: Request) -> Response:
    """Answer ``POST /v1/gather`` for ``helper``'s local ranks (see the module's docstring). Whoever holds
    only the read token has ``READ_GATHERS`` of the ``MAX_GATHERS`` slots: a read token passed around a
    team cannot fill them with long gathers and keep the job's owner from diagnosing it."""
    asked = _Asked(request.json())
    asked.scope = _asker_scope(helper, request)
    with _slots_lock:  # a helper's own bound (a process may hold several helpers: the bench's do)
        slots = helper.__dict__.setdefault("_gather_slots", threading.BoundedSemaphore(MAX_GATHERS))
        read_slots = helper.__dict__.setdefault("_read_gather_slots", threading.BoundedSemaphore(READ_GATHERS))
    reader = _read_token_only(request)
    if reader and not read_slots.acquire(blocking=False):
        raise Busy("this node helper is already gathering for %d clients with the read token" % READ_GATHERS,
                   hint="retry in a moment, or ask the ranks directly (--via direct)")
    try:
        if not slots.acquire(blocking=False):
            raise Busy("this node helper is already gathering for %d clients" % MAX_GATHERS,
                       hint="retry in a moment, or ask the ranks directly (--via direct)")
        try:
            answer = _gather(helper, asked)
        finally:
            slots.release()
    finally:
        if reader:
            read_slots.release()
    if answer.status == 200:
        _next_nonce(helper, request, answer)
    return answer


def _read_token_only(request: Request) -> bool:
    """Whether the asker's credential gives read alone (a read token), whatever scope it asked for."""
    from probe.agent.scopes import READ

    if request.transport == "unix":
        return False
    return request.grant is None or request.grant.scope <= READ


NEXT_HEADER = "X-Probe-Next-Nonce"
"""A gather's request may carry a fresh client nonce here; its answer then carries, under the same name, what
a hello would answer for it (a server nonce and this helper's proofs, as compact JSON): the client's next
gather to this helper needs no hello (``probe.client.proof.keep_next``). At 16k ranks a look was 2,048 hellos
and 2,048 gathers; the next look, only the gathers. Issued only to a request whose MAC was checked, from the
same store as a hello's nonces (single-use, ``NONCE_LIFE_S``, ``MAX_NONCES``)."""


def _next_nonce(helper: Any, request: Request, answer: Response) -> None:
    """Put a next nonce in ``answer`` where the request asked for one over TCP (see ``NEXT_HEADER``)."""
    from probe.agent import handshake
    from probe.agent.scopes import NAMES

    cn = request.headers.get(NEXT_HEADER.lower())
    credentials = getattr(helper, "_credentials", None)
    if cn is None or request.transport != "tcp" or request.grant is None or credentials is None:
        return
    try:
        creds = credentials()
        hello = handshake.hello(creds.tokens, NAMES, creds.nonces, {handshake.NONCE_HEADER.lower(): cn}, request.local)
    except ProbeError:  # a malformed nonce: no next one, and the answer stands
        return
    answer.headers[NEXT_HEADER] = json.dumps({k: hello[k] for k in ("nonce", "address", "proofs")},
                                             separators=(",", ":"))


class _Pool:
    """A helper's worker threads, kept between gathers (a thread started for each rank of each gather cost
    more than asking the rank): at most ``MAX_IN_FLIGHT``, each leaving after ``IDLE_S`` without work."""

    IDLE_S = 30.0

    def __init__(self) -> None:
        self._tasks: "queue.Queue[Any]" = queue.Queue()
        self._lock = threading.Lock()
        self._idle = 0
        self._workers = 0

    def run(self, task: Any) -> None:
        with self._lock:
            start = self._idle == 0 and self._workers < MAX_IN_FLIGHT * MAX_GATHERS
            if start:
                self._workers += 1
            else:
                self._idle -= 1
        self._tasks.put(task)
        if start:
            threading.Thread(target=self._work, name="probe-gather", daemon=True).start()

    def _work(self) -> None:
        while True:
            try:
                task = self._tasks.get(timeout=self.IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:  # no task is promised to an idle worker: leave
                        self._idle -= 1
                        self._workers -= 1
                        return
                continue
            try:
                task()
            except BaseException:  # noqa: BLE001 -- a task records its own outcome; nothing may end a worker
                pass
            with self._lock:
                self._idle += 1


def _fan_out(helper: Any, members: List[Dict[str, Any]], work: Any, in_flight: int, deadline: float) -> List[Any]:
    """``work(member)`` for each member, at most ``in_flight`` at once on the helper's pool, within
    ``deadline`` seconds: an ``Outcome`` (``probe.client.fanout``'s) per member, a ``Timeout`` for those
    not done by then."""
    from probe.client.fanout import Outcome, _without_frames
    from probe.errors import Timeout

    with _slots_lock:
        pool = helper.__dict__.setdefault("_gather_pool", _Pool())
    outcomes: List[Any] = [None] * len(members)
    state = {"next": 0, "done": 0}
    done = threading.Condition()
    end = time.monotonic() + deadline

    def runner() -> None:
        while True:
            with done:
                i = state["next"]
                if i >= len(members) or time.monotonic() >= end:
                    return
                state["next"] += 1
            t0 = time.monotonic()
            try:
                outcome = Outcome(work(members[i]), None, time.monotonic() - t0)
            except ProbeError as exc:
                outcome = Outcome(None, _without_frames(exc), time.monotonic() - t0)
            except Exception as exc:  # noqa: BLE001 -- that rank's failure only
                outcome = Outcome(None, ProbeError("%s: %s" % (type(exc).__name__, exc)), time.monotonic() - t0)
            with done:
                outcomes[i] = outcome
                state["done"] += 1
                if state["done"] == len(members):
                    done.notify_all()

    # One runner first: ranks that answer at once are asked one after another, with no thread switch between
    # them (many runnable threads in one process cost more than the answers). The others join once the
    # first has not finished within RAMP_S: a slow or blocked rank then holds up no other.
    pool.run(runner)
    with done:
        if state["done"] < len(members):
            done.wait(min(RAMP_S, max(end - time.monotonic(), 0)))
    for _ in range(min(in_flight, len(members)) - 1):
        if state["done"] >= len(members):
            break
        pool.run(runner)
    with done:
        while state["done"] < len(members):
            left = end - time.monotonic()
            if left <= 0:
                break
            done.wait(left)
        result = list(outcomes)
    return [o if o is not None else Outcome(None, Timeout("no answer within the node helper's deadline of %.1f s"
                                                          % deadline, hint="raise --deadline"), deadline)
            for o in result]


def _gather(helper: Any, asked: _Asked) -> Response:
    members = helper.local_members()
    if asked.ranks is not None:
        wanted = set(asked.ranks)
        present = {m["rank"] for m in members}
        chosen = [m for m in members if m["rank"] in wanted]
        missing = sorted(wanted - present)
    else:
        chosen, missing = list(members), []
    failed: List[Dict[str, Any]] = [{"rank": r, "code": "not_found", "message": "rank %d is not a rank of this node "
                                     "(its helper lists %d)" % (r, len(members))} for r in missing[:1024]]
    budget = _Budget(MAX_ANSWER_BYTES)
    work = {"backtrace": _backtrace, "query": _query, "evidence": _evidence}[asked.op]
    started = time.monotonic()
    outcomes = _fan_out(helper, chosen, lambda m: work(m, asked, budget), asked.max_in_flight, asked.deadline)
    out: Dict[str, Any] = {"op": asked.op, "ranks": [m["rank"] for m in chosen]}
    outside: List[Any] = []
    if asked.op == "evidence":  # diagnose's evidence of each rank, its stacks shared (probe.diagnose.gathered)
        from probe.diagnose.gathered import encode

        evs = []
        for member, outcome in zip(chosen, outcomes):
            if outcome.error is None:
                evs.append(outcome.value)
            else:
                failed.append(_failure(member, outcome.error, helper))
        keep_after = started - (asked.since_s or 0.0)
        out.update(evidence=encode(evs, keep_after, asked.known), failed=failed, seconds=round(time.monotonic() - started, 4))
        body = json.dumps(out, default=str).encode("utf-8")
        if len(body) > MAX_ANSWER_BYTES:
            raise TooLarge("this node's evidence would take its answer past %d MB" % (MAX_ANSWER_BYTES >> 20),
                           hint="ask the ranks directly (--via direct)")
        return Response(200, body)
    if asked.op == "backtrace":
        threads: Dict[str, Dict[Key, List[int]]] = {}
        for member, outcome in zip(chosen, outcomes):
            if outcome.error is not None:
                read = _read_outside(helper, member, outcome.error)
                if isinstance(read, dict):
                    failed.append(read)
                    continue
                stacks, note = read
            else:
                stacks, note = outcome.value
            for name, key in stacks.items():
                threads.setdefault(name, {}).setdefault(key, []).append(member["rank"])
            if note:
                outside.append([member["rank"], note])
        # each stack as the JSON text of its frames: the client reads and checks each distinct text once,
        # however many nodes send it
        out["threads"] = {name: [[json.dumps([list(f) for f in key]), ranks] for key, ranks in groups.items()]
                          for name, groups in threads.items()}
        out["outside"] = outside
        out["failed"] = failed
        out["seconds"] = round(time.monotonic() - started, 4)
        return Response.json(out)
    parts: List[bytes] = []
    for member, outcome in zip(chosen, outcomes):
        if outcome.error is None:
            kind, value = outcome.value
            if kind == "rows":
                parts.append(value)
            else:
                outside.append(value)
            continue
        failed.append(_failure(member, outcome.error, helper))
    head = json.dumps({"op": asked.op, "ranks": out["ranks"], "outside": outside, "failed": failed,
                       "seconds": round(time.monotonic() - started, 4)}).encode("utf-8")
    body = bytearray(head[:-1])
    body += b', "parts": ['
    for i, part in enumerate(parts):
        if i:
            body += b", "
        body += part
    body += b"]}"
    return Response(200, body)


def _client(member: Dict[str, Any], asked: _Asked) -> Any:
    from probe.client.client import Client
    from probe.client.targets import parse_target

    client = Client(parse_target(str(member["pid"])), None, asked.deadline + _MARGIN_S)
    client.scope_cap = asked.scope  # the helper has every scope on its ranks' sockets: ask with the asker's
    return client


def _asker_scope(helper: Any, request: Request) -> str:
    """The scope of whoever asked the gather (its token's, or the unix peer's: every scope), lowered by its
    own ``X-Probe-Scope``: the ranks answer the helper as they would answer the asker."""
    from probe.agent.scopes import EVAL, NAMES, READ, Grant, capped

    grant = Grant(EVAL, "unix socket owner")
    if request.transport != "unix":  # the helper checked its proof (single-use) before the route ran
        grant = request.grant if request.grant is not None else Grant(READ, "")
    try:
        return NAMES[capped(grant, request.headers).scope]
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def _backtrace(member: Dict[str, Any], asked: _Asked, budget: "_Budget") -> Tuple[Dict[str, Key], Optional[str]]:
    client = _client(member, asked)
    frames = client.backtrace()
    stacks = thread_stacks(frames)
    budget.take(sum(40 + sum(len(f[0]) + len(f[1]) + 12 for f in key) for key in stacks.values()), member)
    return stacks, client.note


def _evidence(member: Dict[str, Any], asked: _Asked, budget: "_Budget") -> Any:
    """The rank's evidence for ``probe diagnose`` (``probe.diagnose.gather.collect``: never raises), asked
    over its unix socket; read from outside here where its agent cannot answer."""
    from probe.diagnose import straggler
    from probe.diagnose.gather import collect
    from probe.host import prefetch

    rank, pid = member["rank"], member.get("pid")
    # Samples begun after this diagnosis's first look only (since_s: seconds since it began, and 1 more).
    not_before = time.monotonic() - asked.since_s if asked.since_s else None
    taken = prefetch.take((pid, rank), 2 * straggler.AHEAD_S + 0.2, not_before) if rank in asked.ahead else None
    # A first look that prefetches answers without its straggler samples: they are taken right after it,
    # with the next look's, and come with that look (as many in all, and all between the two looks).
    ev = collect(_client(member, asked), rank, str(member.get("host")), pid, member.get("state"),
                 rank in asked.ahead and taken is None, [] if asked.prefetch and taken is None else taken)
    if asked.prefetch and ev.state == "answering" and straggler.ahead(ev):
        ev.prefetching = prefetch.start((pid, rank), lambda: straggler.sample_main(_client(member, asked),
                                                                                   2 * straggler.SAMPLES))
    return ev


def _query(member: Dict[str, Any], asked: _Asked, budget: "_Budget") -> Tuple[str, Any]:
    """("rows", the rank's part as JSON bytes) or ("outside", {rank, note, stacks}) for the client to run
    the SQL on the stacks read from outside."""
    from probe.client.client import query_body as _query_body
    from probe.client.fallback import note_for as _note_for, outside_stacks as _outside_stacks
    from probe.reader.wire import stacks_to_json

    client = _client(member, asked)
    body = _query_body(asked.sql, asked.max_rows, asked.timeout, asked.query_id)
    try:
        raw = client._json("POST", "/v1/query", body, timeout=client._answer_wait(asked.timeout, 10.0))
    except ProbeError as exc:
        stacks = _outside_stacks(exc, agentless=True)
        if stacks is None or exc.code == "sql_unavailable":
            raise
        return "outside", {"rank": member["rank"], "code": exc.code, "message": exc.message[:1000],
                           "hint": (exc.hint or "")[:1000] or None, "note": _note_for(exc, stacks),
                           "stacks": stacks_to_json(stacks)}
    columns, rows = raw.get("columns"), raw.get("rows")
    if not isinstance(columns, list) or not isinstance(rows, list):
        raise ProbeError("rank %d's agent answered a query without columns and rows" % member["rank"])
    part = json.dumps({"rank": member["rank"], "columns": [[c.get("name"), c.get("type")] if isinstance(c, dict)
                                                           else c for c in columns],
                       "rows": rows, "truncated": bool(raw.get("truncated")),
                       "row_cap": (raw.get("limits") or {}).get("max_rows") if isinstance(raw.get("limits"), dict)
                       else None}, default=str).encode("utf-8")
    del raw, rows
    budget.take(len(part), member)
    return "rows", part


class _Budget:
    """Bytes of answer taken so far; a rank whose part would pass the bound is failed ``too_large``."""

    def __init__(self, limit: int) -> None:
        self.left = limit
        self._lock = threading.Lock()

    def take(self, size: int, member: Dict[str, Any]) -> None:
        with self._lock:
            if size > self.left:
                raise TooLarge("rank %d's answer would take this node helper's answer past %d MB"
                               % (member["rank"], MAX_ANSWER_BYTES >> 20),
                               hint="ask for fewer rows (a LIMIT, --max-rows), or ask the ranks directly (--via direct)")
            self.left -= size


def _read_outside(helper: Any, member: Dict[str, Any], error: ProbeError) -> Any:
    """A rank that gave no answer, looked at from outside: (its stacks by thread, the note) where they
    could be read (its last stacks, from its crash record, for a dead one), else its failure."""
    from probe.client.fallback import frames_of as _frames_of
    from probe.reader.wire import stacks_from_json

    seen = _outside(helper, member)
    if seen is not None and seen.get("stacks") is not None:
        try:
            stacks = stacks_from_json(seen["stacks"], "rank %d, read by its node helper" % member["rank"])
        except ValueError:
            stacks = None
        if stacks is not None:
            return thread_stacks(_frames_of(stacks)), "%s%s" % (seen.get("message"), "; " + str(seen["hint"])
                                                                  if seen.get("hint") else "")
    return _failure(member, error, helper, seen)


def _outside(helper: Any, member: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    try:
        seen = helper.outside(str(member["pid"]))
    except Exception:  # noqa: BLE001 -- what the agent's client said stands then
        return None
    return seen if isinstance(seen, dict) else None


def _failure(member: Dict[str, Any], error: ProbeError, helper: Any,
             seen: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """A rank that gave no answer: the error's code, message and hint; for a rank that is dead, stopped or
    holds its GIL, what its helper reads from outside says instead (how it died)."""
    if seen is None and error.code in ("connect_error", "process_dead", "agent_blocked", "timeout"):
        seen = _outside(helper, member)
    if seen is not None and seen.get("state") in ("dead", "stopped", "gil_held"):
        code = "process_dead" if seen["state"] == "dead" else "agent_blocked"
        return {"rank": member["rank"], "code": code, "message": str(seen.get("message"))[:1000],
                "hint": str(seen.get("hint") or "")[:1000] or None}
    return {"rank": member["rank"], "code": error.code, "message": error.message[:1000],
            "hint": (error.hint or "")[:1000] or None}


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(body: Dict[str, Any], key: str, default: Optional[int], low: int, high: int) -> Optional[int]:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise BadRequest("a gather's %s must be an integer from %d to %d, not %s" % (key, low, high, _shown(value)),
                         hint=_GATHER_SHAPE)
    return value


def _seconds(body: Dict[str, Any], key: str, default: Optional[float], high: float) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
            or not 0 < value <= high):
        raise BadRequest("a gather's %s must be seconds, more than 0 and at most %g, not %s"
                         % (key, high, _shown(value)), hint=_GATHER_SHAPE)
    return float(value)
