"""Across ranks through the node helpers: one request a node, each helper asking its own ranks.

The direct fan-out (``probe.client.fanout``) costs the client a connection, a request and an answer to
parse for every rank. Here the client sends one ``POST /v1/gather`` to each node's helper (the
``helper`` of each member the master's helper listed); the helper asks its local ranks over their unix
sockets, reads a rank that cannot answer from outside, and answers with its part already reduced (see
``probe.host.gather``): for a backtrace the distinct stacks of each thread name with their ranks, for a
query its ranks' rows. So the client's work grows with the nodes and the distinct stacks, not the ranks
(a query's rows still are as many as the ranks send).

Which path: ``via="direct"``, ``"helpers"``, or ``"auto"``: through the helpers when the job has more
than ``AUTO_ABOVE`` ranks and every rank has a helper (discovered, not an explicit list). Up to that the
direct path was as fast or faster (bench/bench_fanout_helpers.py). A helper that cannot gather (an older
helper: 404; busy; refused) has its ranks asked directly instead; one that gives no answer within the
deadline has its ranks named as not answering, with why.

Everything a helper sends is checked as it is read: its ranks must be ones it was asked about, once each;
frames, names, codes and texts have bounded types and sizes; a helper that fails a check has its ranks
named with what was wrong, and the others stand.
"""

import json
import re
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

import probe.client.multiplex as multiplex
import probe.client.transport as transport
from probe.client.fanout import fan_out
from probe.client.results import Rows, by_rank
from probe.errors import ProbeError, Timeout, UsageError, error_from_code

if TYPE_CHECKING:  # the cluster calls this module: only its name here, for the signatures
    from probe.client.members import Member

Cluster = Any  # probe.client.cluster.Cluster

__all__ = ["VIA", "AUTO_ABOVE", "through_helpers", "Grouped", "backtrace_groups", "query_rows", "rows_to_arrow",
           "ask_helpers", "helper_failures", "unusable", "BadAnswer"]

VIA = ("auto", "helpers", "direct")
AUTO_ABOVE = 1024
"""``--via auto`` goes through the node helpers for more ranks than this. Measured on one 2-core machine
(bench/bench_fanout_helpers.py, bench/RESULTS.md), the direct path answered as fast or faster up to 1024
ranks (there the helpers share the client's cores), while through the helpers the client spent 2-7x less
CPU; the client's CPU and connections grow with the ranks directly, with the nodes through the helpers."""
_YOUNG_AT_ONCE = 64
"""Young gathers in flight at once on the one-thread path (``probe.client.multiplex``; one unanswered after
``fanout.SLOW_AFTER_S`` lets another start, up to ``fanout.MAX_OPEN``). Threads paced their requests by
themselves; one thread sends 512 at once, and at 16k simulated ranks (2,048 helpers in 8 processes on 2
cores, bench/bench_diagnose.py) that burst made a look 6.6 s where 64 (or 24) at once took 3.6 s."""
_MARGIN_S = 0.5  # the helpers' deadline is this much (at most a quarter) before the client's
_MAX_NAME = 1024
_MAX_TEXT = 4096
_MAX_FRAMES = 4096
_CODE = re.compile(r"[a-z_]{1,40}")

Key = Tuple[Tuple[str, str, int], ...]


class Grouped(NamedTuple):
    """A backtrace across ranks, grouped: per thread name, each distinct stack with its ranks; the ranks
    whose stacks were read from outside (rank -> why); how many ranks answered."""

    threads: Dict[str, Dict[Key, List[int]]]
    outside: Dict[int, str]
    answered: int


class _Bad(Exception):
    """A helper's answer failed a check: what was wrong."""


def through_helpers(cluster: Cluster) -> bool:
    """Whether this call goes through the node helpers (``cluster.via``); UsageError where ``helpers`` was
    asked for ranks that have no helper (an explicit list of targets)."""
    via = getattr(cluster, "via", "auto")
    every = bool(cluster.members) and all(m.helper and m.pid is not None for m in cluster.members)
    if via == "helpers":
        if not every:
            raise UsageError("--via helpers needs the ranks of a job found through its master's helper "
                             "(MASTER:PROBE_PORT); an explicit list of targets has no node helpers",
                             hint="leave out --via, or give the master's HOST:PROBE_PORT")
        return True
    return via == "auto" and every and len(cluster.members) > AUTO_ABOVE


def _by_helper(members: Sequence["Member"]) -> Dict[str, List["Member"]]:
    out: Dict[str, List["Member"]] = {}
    for member in members:
        out.setdefault(str(member.helper), []).append(member)
    return out


def _gather(cluster: Cluster, op: Dict[str, Any], in_flight: Optional[int] = None,
            own: Optional[Callable[[List["Member"]], Dict[str, Any]]] = None,
            then: Optional[Callable[[List["Member"], Any], Any]] = None) -> Tuple[List[Tuple[List["Member"], Any]], List["Member"], List[Any]]:
    """Ask every helper; (members, parsed answer) per helper that answered, the members to ask directly,
    and the failures of the ranks of helpers that did not answer in time. ``in_flight``: helpers asked at
    once (default ``cluster.max_in_flight``; a gather whose every answer takes long asks more). ``own``:
    fields of one helper's request, from its members (what concerns its ranks only). ``then``: what to make
    of a helper's parsed answer as soon as it came (its result stands for the answer; it must not raise),
    while the other helpers are still waited for."""
    from probe.client.members import RankFailure, _host_of

    helpers = _by_helper(cluster.members)
    deadline = cluster.deadline
    inner = max(deadline - min(_MARGIN_S, deadline / 4), 0.05)

    def request(item: Tuple[str, List["Member"]]) -> Tuple[Any, bytes]:
        helper, members = item
        address = transport.TcpAddress(_host_of(helper), int(helper.rpartition(":")[2]))
        body = json.dumps(dict(op, **(own(members) if own else {}), ranks=[m.rank for m in members],
                               deadline=round(inner, 3), max_in_flight=min(cluster.max_in_flight, 64))).encode("utf-8")
        return address, body

    timeout = min(cluster.timeout, deadline + 1.0)

    def ask(item: Tuple[str, List["Member"]]) -> Any:
        address, body = request(item)
        return read(item, _ask_gather(address, body, timeout, cluster._token))

    def talk(item: Tuple[str, List["Member"]]) -> Any:  # ask's steps, for multiplex.run (one thread for all)
        address, body = request(item)
        answer = yield from _gather_steps(address, body, timeout, cluster._token)
        return read(item, answer)

    def read(item: Tuple[str, List["Member"]], answer: transport.HttpResponse) -> Any:
        helper, members = item
        try:
            if answer.status != 200:
                raise _error_of(answer, helper)
            try:
                raw = json.loads(answer.body.decode("utf-8"))
            except (ValueError, UnicodeDecodeError, RecursionError):
                raise ProbeError("the node helper at %s answered a gather with something other than JSON" % helper)
        finally:
            transport.release(answer)
        if not isinstance(raw, dict) or raw.get("op") != op["op"]:
            raise ProbeError("the node helper at %s answered a gather with no %s" % (helper, op["op"]))
        return raw if then is None else then(members, raw)

    items = list(helpers.items())
    if multiplex.usable():  # plain TCP: every helper waited on from this thread
        outcomes = multiplex.run([(lambda item=item: talk(item)) for item in items],
                                 min(in_flight or cluster.max_in_flight, _YOUNG_AT_ONCE), deadline)
    else:  # TLS: a thread a request
        outcomes = fan_out(items, ask, in_flight or cluster.max_in_flight, deadline)
    answered, direct, failures = [], [], []
    for (helper, members), outcome in zip(items, outcomes):
        if outcome.error is None:
            answered.append((members, outcome.value))
        elif isinstance(outcome.error, Timeout):
            reason = "its node helper at %s gave no answer: %s" % (helper, outcome.error.message)
            failures.extend(RankFailure(m.rank, m.host, "timeout", reason, outcome.error.exit_code) for m in members)
        else:  # an older helper (no gather), busy, or refused: ask its ranks directly
            direct.extend(members)
            cluster.asked_directly.append("the node helper at %s did not gather (%s): its %d rank%s asked directly"
                                          % (helper, outcome.error.message[:300], len(members),
                                             " was" if len(members) == 1 else "s were"))
    return answered, direct, failures


def _ask_gather(address: Any, body: bytes, timeout: float, token: Optional[str]) -> transport.HttpResponse:
    """One ``POST /v1/gather``; over TCP with a token, asking for the next nonce (``probe.client.proof``:
    the next gather to this helper needs no hello), and once more with a hello where a nonce kept from
    the last answer is refused (the helper restarted since, or dropped it)."""
    from probe.client import proof

    for _ in range(2):
        asked = proof.ask_next() if token and isinstance(address, transport.TcpAddress) else {}
        answer = transport.request(address, "POST", "/v1/gather", body, asked or None, timeout, token=token)
        if answer.status == 401 and asked and proof.reused():
            transport.release(answer)
            continue
        if asked and answer.status == 200:
            proof.keep_next(address, str(token), asked, answer)
        return answer
    return answer


def _gather_steps(address: Any, body: bytes, timeout: float, token: Optional[str]) -> Any:
    """:func:`_ask_gather` as a conversation of ``probe.client.multiplex``: the same hello (or kept nonce),
    the same request, the same one retry with a hello where a kept nonce is refused."""
    from probe.client import multiplex, proof

    answer: Any = None
    for _ in range(2):
        end = time.monotonic() + timeout
        asked = proof.ask_next() if token else {}
        headers: Dict[str, str] = dict(asked)
        to, reused = None, False
        if token:
            steps = proof.hello_steps(address, token, "POST", "/v1/gather", body)
            try:
                path, hello = next(steps)
                got = yield multiplex.Exchange(address, None, transport.request_bytes(address, "GET", path, None, hello,
                                                                                      keep_alive=True), end, timeout)
                steps.send(got)
                raise ProbeError("the hello's steps went on past their answer")  # never: they end with it
            except StopIteration as stop:
                to, value, reused = stop.value
            headers["Authorization"] = value
        got = yield multiplex.Exchange(address, to, transport.request_bytes(address, "POST", "/v1/gather", body,
                                                                            headers or None, keep_alive=True), end, timeout)
        answer = got[0]
        if answer.status == 401 and asked and reused:
            transport.release(answer)
            continue
        if asked and answer.status == 200:
            proof.keep_next(address, str(token), asked, answer)
        return answer
    return answer


def _error_of(answer: transport.HttpResponse, helper: str) -> ProbeError:
    try:
        error = json.loads(answer.body.decode("utf-8"))["error"]
        message, code = str(error["message"])[:_MAX_TEXT], str(error["code"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError):
        return ProbeError("the node helper at %s answered HTTP %d" % (helper, answer.status))
    return error_from_code(code if _CODE.fullmatch(code) else "internal",
                           "the node helper at %s: %s" % (helper, message))


def _failures(raw: Any, asked: Dict[int, "Member"], helper: str) -> Dict[int, Any]:
    """rank -> RankFailure, from a helper's ``failed`` (checked)."""
    from probe.client.members import RankFailure

    out: Dict[int, Any] = {}
    if not isinstance(raw, list):
        raise _Bad("failed is not a list")
    for item in raw:
        if not isinstance(item, dict):
            raise _Bad("a failure is not an object")
        rank = _rank(item.get("rank"), asked)
        code, message, hint = item.get("code"), item.get("message"), item.get("hint")
        if not (isinstance(code, str) and _CODE.fullmatch(code)):
            raise _Bad("a failure's code is not a word")
        if not isinstance(message, str) or not (hint is None or isinstance(hint, str)):
            raise _Bad("a failure's message or hint is not text")
        exc = error_from_code(code, message[:_MAX_TEXT], (hint or "")[:_MAX_TEXT] or None)
        reason = exc.message + (" -- %s" % exc.hint if exc.hint else "")
        out[rank] = RankFailure(rank, asked[rank].host, exc.code, reason, exc.exit_code)
    return out


def _rank(value: Any, asked: Dict[int, "Member"]) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value not in asked:
        raise _Bad("it named rank %s, which it was not asked about" % _shown(value))
    return value


def _shown(value: Any) -> str:
    text = ascii(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _text(value: Any, limit: int, what: str) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise _Bad("%s is not a string of at most %d characters" % (what, limit))
    return value


def _key_of(text: Any, known: Dict[str, Key]) -> Key:
    """A stack from the JSON text of its frames, read and checked once per distinct text (``known``)."""
    if not isinstance(text, str) or len(text) > _MAX_FRAMES * 2 * _MAX_TEXT:
        raise _Bad("a stack is not the JSON text of its frames")
    key = known.get(text)
    if key is None:
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError):
            raise _Bad("a stack is not the JSON text of its frames") from None
        key = known[text] = _key(raw)
    return key


def _key(raw: Any) -> Key:
    if not isinstance(raw, list) or len(raw) > _MAX_FRAMES:
        raise _Bad("a stack is not a list of at most %d frames" % _MAX_FRAMES)
    out = []
    for frame in raw:
        if not (isinstance(frame, list) and len(frame) == 3 and isinstance(frame[2], int)
                and not isinstance(frame[2], bool)):
            raise _Bad("a frame is not [func, file, line]")
        out.append((_text(frame[0], _MAX_TEXT, "a frame's function"), _text(frame[1], _MAX_TEXT, "a frame's file"),
                    frame[2]))
    return tuple(out)


def _unusable(members: Sequence["Member"], helper: str, why: str) -> List[Any]:
    from probe.client.members import RankFailure

    reason = "its node helper at %s sent an answer that cannot be used: %s" % (helper, why)
    return [RankFailure(m.rank, m.host, "connect_error", reason, 3) for m in members]


def backtrace_groups(cluster: Cluster) -> Grouped:
    """Every rank's stacks, grouped, through the node helpers; ``cluster.failures`` names the ranks that
    gave no stacks, and why. Ranks of a helper that cannot gather are asked directly and grouped here."""
    from probe.client.members import RankFailure
    from probe.client.results import thread_stacks

    answered_helpers, direct, failures = _gather(cluster, {"op": "backtrace"})
    threads: Dict[str, Dict[Key, List[int]]] = {}
    outside: Dict[int, str] = {}
    answered: Set[int] = set()
    known: Dict[str, Key] = {}  # each distinct stack's text, read once
    for members, raw in answered_helpers:
        helper = str(members[0].helper)
        asked = {m.rank: m for m in members}
        try:
            mine, notes, failed = _check_backtrace(raw, asked, known)
        except _Bad as exc:
            failures.extend(_unusable(members, helper, str(exc)))
            continue
        seen = set()
        for name, groups in mine.items():
            into = threads.setdefault(name, {})
            for key, ranks in groups:
                into.setdefault(key, []).extend(ranks)
                seen.update(ranks)
        outside.update(notes)
        answered.update(seen)
        for rank, failure in failed.items():
            if rank not in seen:
                failures.append(failure)
        for member in members:
            if member.rank not in seen and member.rank not in failed:
                failures.append(RankFailure(member.rank, member.host, "internal", "its node helper at %s said nothing "
                                            "of it" % helper, 1))
    if direct:
        sub = _sub(cluster, direct)
        for answer in sub.map(lambda c: c.backtrace()):
            for name, key in thread_stacks(answer.value).items():
                threads.setdefault(name, {}).setdefault(key, []).append(answer.member.rank)
            if answer.note:
                outside[answer.member.rank] = answer.note
            answered.add(answer.member.rank)
        failures.extend(sub.failures)
    for groups in threads.values():
        for ranks in groups.values():
            ranks.sort()
    cluster.failures = sorted(failures, key=lambda f: f.rank)
    return Grouped(threads, outside, len(answered))


def _check_backtrace(raw: Dict[str, Any], asked: Dict[int, "Member"],
                     known: Dict[str, Key]) -> Tuple[Dict[str, List[Tuple[Key, List[int]]]], Dict[int, str], Dict[int, Any]]:
    threads = raw.get("threads")
    if not isinstance(threads, dict):
        raise _Bad("threads is not an object")
    out: Dict[str, List[Tuple[Key, List[int]]]] = {}
    for name, groups in threads.items():
        _text(name, _MAX_NAME, "a thread name")
        if not isinstance(groups, list):
            raise _Bad("the stacks of thread %s are not a list" % _shown(name))
        kept = []
        seen: Set[int] = set()
        for group in groups:
            if not (isinstance(group, list) and len(group) == 2 and isinstance(group[1], list)):
                raise _Bad("a stack of thread %s is not [frames, ranks]" % _shown(name))
            ranks = [_rank(r, asked) for r in group[1]]
            if seen.intersection(ranks) or len(set(ranks)) != len(ranks):
                raise _Bad("a rank has two stacks for thread %s" % _shown(name))
            seen.update(ranks)
            kept.append((_key_of(group[0], known), ranks))
        out[name] = kept
    notes: Dict[int, str] = {}
    raw_notes = raw.get("outside", [])
    if not isinstance(raw_notes, list):
        raise _Bad("outside is not a list")
    for item in raw_notes:
        if not (isinstance(item, list) and len(item) == 2):
            raise _Bad("an entry of outside is not [rank, note]")
        notes[_rank(item[0], asked)] = _text(item[1], _MAX_TEXT, "a note")
    return out, notes, _failures(raw.get("failed", []), asked, "")


def _sub(cluster: Cluster, members: Sequence["Member"]) -> Cluster:
    return cluster.plain(members)


def query_rows(cluster: Cluster, sql: str, max_rows: Optional[int], timeout: Optional[float],
               query_id: Optional[str]) -> Rows:
    """Every rank's rows of ``sql`` through the node helpers, ``rank`` and ``host`` first, in rank order;
    ``cluster.failures`` names the others. Ranks read from outside get the SQL run here on their stacks."""
    from probe.client.members import RankFailure
    from probe.client.local_sql import rows_of, run_on_stacks
    from probe.reader.wire import stacks_from_json

    op: Dict[str, Any] = {"op": "query", "sql": sql}
    for key, value in (("max_rows", max_rows), ("timeout", timeout), ("query_id", query_id)):
        if value is not None:
            op[key] = value
    answered_helpers, direct, failures = _gather(cluster, op)
    parts: Dict[int, Rows] = {}
    for members, raw in answered_helpers:
        helper = str(members[0].helper)
        asked = {m.rank: m for m in members}
        try:
            mine, outside, failed = _check_query(raw, asked)
        except _Bad as exc:
            failures.extend(_unusable(members, helper, str(exc)))
            continue
        for rank, (code, message, hint, stacks_raw) in outside.items():
            label = asked[rank].label
            try:
                stacks = stacks_from_json(stacks_raw, "%s, read by its node helper at %s" % (label, helper))
                why = error_from_code(code, message, hint)
                mine[rank] = rows_of(run_on_stacks(sql, stacks, max_rows, timeout, why, label))
            except ValueError:
                failed[rank] = RankFailure(rank, asked[rank].host, "connect_error", "its node helper at %s sent "
                                           "stacks that cannot be used" % helper, 3)
            except ProbeError as exc:
                failed[rank] = RankFailure(rank, asked[rank].host, exc.code,
                                           exc.message + (" -- %s" % exc.hint if exc.hint else ""), exc.exit_code)
        again = [asked[r] for r, f in failed.items() if f.code == "sql_unavailable" and r not in mine]
        direct.extend(again)
        failures.extend(f for r, f in failed.items() if r not in mine and f.code != "sql_unavailable")
        for member in members:
            if member.rank not in mine and member.rank not in failed:
                failures.append(RankFailure(member.rank, member.host, "internal", "its node helper at %s said nothing "
                                            "of it" % helper, 1))
        tagged = by_rank([(r, asked[r].host, mine[r]) for r in sorted(mine)])  # the table's own rank once
        for rank, rows in mine.items():
            parts[rank] = Rows(tagged.columns, [row for row in tagged.rows if row[0] == rank], rows.truncated)
    if direct:
        sub = _sub(cluster, direct)
        got = sub.query_rows(sql, max_rows=max_rows, timeout=timeout, query_id=query_id, empty_if_none=True)
        per_rank: Dict[int, List[List[Any]]] = {m.rank: [] for m in direct}
        for row in got.rows:  # split back per rank: the rank is the first column
            per_rank[row[0]].append(row)
        for rank in set(per_rank) - {f.rank for f in sub.failures}:
            parts[rank] = Rows(got.columns, per_rank[rank], got.truncated, got.row_cap)
        failures.extend(sub.failures)
    cluster.failures = sorted(failures, key=lambda f: f.rank)
    return Rows.concat([parts[r] for r in sorted(parts)])


def _check_query(raw: Dict[str, Any], asked: Dict[int, "Member"]) -> Tuple[Dict[int, Rows], Dict[int, Any], Dict[int, Any]]:
    parts = raw.get("parts")
    if not isinstance(parts, list):
        raise _Bad("parts is not a list")
    mine: Dict[int, Rows] = {}
    for part in parts:
        if not isinstance(part, dict):
            raise _Bad("a part is not an object")
        rank = _rank(part.get("rank"), asked)
        if rank in mine:
            raise _Bad("rank %d has two parts" % rank)
        columns, rows = part.get("columns"), part.get("rows")
        if not isinstance(columns, list) or not all(
                isinstance(c, list) and len(c) == 2 and isinstance(c[0], str) and isinstance(c[1], str) for c in columns):
            raise _Bad("rank %d's columns are not [name, type] pairs" % rank)
        width = len(columns)
        if not isinstance(rows, list) or not all(isinstance(r, list) and len(r) == width for r in rows):
            raise _Bad("rank %d's rows are not lists of %d values" % (rank, width))
        cap = part.get("row_cap")
        mine[rank] = Rows(tuple((c[0], c[1]) for c in columns), rows, part.get("truncated") is True,
                          cap if isinstance(cap, int) and not isinstance(cap, bool) else None)
    outside: Dict[int, Any] = {}
    raw_outside = raw.get("outside", [])
    if not isinstance(raw_outside, list):
        raise _Bad("outside is not a list")
    for item in raw_outside:
        if not isinstance(item, dict):
            raise _Bad("an entry of outside is not an object")
        rank = _rank(item.get("rank"), asked)
        code = item.get("code")
        if not (isinstance(code, str) and _CODE.fullmatch(code)):
            raise _Bad("an entry of outside has no code")
        hint = item.get("hint")
        outside[rank] = (code, _text(item.get("message"), _MAX_TEXT, "a message"),
                         _text(hint, _MAX_TEXT, "a hint") if hint is not None else None, item.get("stacks"))
    return mine, outside, _failures(raw.get("failed", []), asked, "")


_ARROW_TYPES = {"BIGINT": "int64", "INTEGER": "int32", "SMALLINT": "int16", "TINYINT": "int8", "UBIGINT": "uint64",
                "UINTEGER": "uint32", "DOUBLE": "float64", "FLOAT": "float32", "BOOLEAN": "bool", "VARCHAR": "string",
                "string": "string"}


def rows_to_arrow(rows: Rows) -> Any:
    """A ``pyarrow.Table`` of ``rows`` (JSON values), typed from the columns' SQL types where they are
    plain, inferred otherwise (text where values of one column do not agree)."""
    import datetime

    import pyarrow as pa

    arrays, names = [], []
    for i, (name, sql_type) in enumerate(rows.columns):
        values = [r[i] for r in rows.rows]
        if sql_type == "TIMESTAMP":
            values = [datetime.datetime.fromisoformat(v) if isinstance(v, str) else v for v in values]
        try:
            kind = _ARROW_TYPES.get(sql_type)
            array = pa.array(values, type=getattr(pa, kind)() if kind and kind != "bool" else
                             (pa.bool_() if kind else None))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
            array = pa.array([None if v is None else str(v) for v in values], pa.string())
        arrays.append(array)
        names.append(name)
    table = pa.Table.from_arrays(arrays, names=names)
    return table.replace_schema_metadata({"probe.truncated": "true" if rows.truncated else "false"})



# For a gather whose answer another part reads (``probe.diagnose.gathered``: diagnose's evidence): ask every
# helper, check its failures, name the ranks of an answer that cannot be used.
ask_helpers = _gather
BadAnswer = _Bad
unusable = _unusable


def helper_failures(raw: Any, asked: Dict[int, "Member"]) -> Dict[int, Any]:
    """rank -> RankFailure from a helper's ``failed`` (checked: :class:`BadAnswer` where it is not)."""
    return _failures(raw, asked, "")
