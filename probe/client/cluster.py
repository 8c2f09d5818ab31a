"""Every rank of a job at once: discovery through the master's host helper, or an explicit list.

    cluster = probe.connect_all("master:9700")        # or a list of targets
    cluster.ranks                                     # rank, host, port, pid, state of each
    table = cluster.query("SELECT max(step) AS step FROM python.torch_trace")   # a row per rank
    cluster.failures                                  # the ranks that did not answer, and why

Where some ranks answer, a call returns their answers and ``failures`` names the others; where none
does, it raises :class:`NoRankAnswered` (``failures`` on the error too), rather than return an empty
table that would read as "no rows".

Under torchrun with ``PROBE_PORT=P`` each node's launcher runs a host helper on ``P - 1`` that knows the
node's ranks (the master's knows every node's); the client asks it once, then speaks to each rank's
agent directly, and asks the rank's helper about a rank that does not answer (``probe.client.helped``).
With an explicit list there is no discovery: ``rank`` is the target's position in the list.
"""

import math
import os
import re
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from probe import _paths
from probe.client import transport
from probe.client.client import DEFAULT_TIMEOUT, Client, _read_token
from probe.client.fanout import Outcome, Progress, fan_out
from probe.client.helped import HostHelper
from probe.client.results import EvalResult, Frame, Rows
from probe.client.targets import Target, parse_target
from probe.client.wording import option
from probe.errors import ConnectError, ProbeError, UsageError

__all__ = ["Member", "RankFailure", "RankAnswer", "Cluster", "NoRankAnswered", "connect_all", "parse_rank_list",
           "compact_ranks"]

DEFAULT_DEADLINE = 10.0
DEFAULT_IN_FLIGHT = 32  # young requests at once; see probe.client.fanout
_MARGIN_S = 0.5
MAX_RANKS = 1 << 20  # in a --ranks list: more is a typo, and would fill the client's memory
MEMBER_COLUMNS = ("rank", "host", "port", "pid", "state", "local_rank", "node", "world_size", "restarts",
                  "heartbeat_age")


class Member(NamedTuple):
    rank: int
    host: str  # the node's name (or the target as written, for an explicit list)
    address: str  # how the client reaches the agent: HOST:PORT
    port: Optional[int] = None
    pid: Optional[int] = None
    state: Optional[str] = None
    local_rank: Optional[int] = None
    node: Optional[int] = None
    world_size: Optional[int] = None
    restarts: Optional[int] = None
    heartbeat_age: Optional[float] = None
    helper: Optional[str] = None  # HOST:PORT of its node's host helper
    note: Optional[str] = None  # its port was taken (by whom), as its node's helper says

    @property
    def label(self) -> str:
        return "rank %d (%s)" % (self.rank, self.address)


class RankFailure(NamedTuple):
    """A rank that gave no answer: its rank, host, the error's code, what happened, and its exit code."""

    rank: int
    host: str
    code: str
    reason: str
    exit_code: int


class RankAnswer(NamedTuple):
    """One rank's answer; ``note`` says where it came from when not from its agent (read from outside)."""

    member: Member
    value: Any
    note: Optional[str]
    client: Client


class NoRankAnswered(ProbeError):
    """No rank answered a call: each one's reason is in ``failures`` (and in the message). The exit code is
    the first rank's, as the CLI's is when no rank answers."""

    code = "no_rank_answered"
    exit_code = 3

    def __init__(self, failures: Sequence[RankFailure], deadline: float) -> None:
        shown = ["rank %d (%s): %s" % (f.rank, f.host, f.reason) for f in failures[:3]]
        if len(failures) > 3:
            shown.append("and %d more" % (len(failures) - 3))
        timed_out = all(f.code == "timeout" for f in failures)
        super().__init__("none of the %d ranks answered: %s" % (len(failures), "; ".join(shown)),
                         hint=("none answered within the deadline of %.1f s: raise %s" % (deadline, option("--deadline",
                               "deadline=")) if timed_out else "`failures` names every rank and why"))
        self.failures = list(failures)
        if failures:
            self.exit_code = failures[0].exit_code


class Cluster:
    """A client of many agents. Each call fans out concurrently; ``failures`` names the ranks of the last
    call that did not answer, and why. ``left_out`` says which members the host helper listed in a form
    that cannot be used (a field that is not what a helper sends), and why: they are not in ``members``."""

    def __init__(self, members: Sequence[Member], token: Optional[str], timeout: float = DEFAULT_TIMEOUT,
                 deadline: float = DEFAULT_DEADLINE, max_in_flight: int = DEFAULT_IN_FLIGHT,
                 token_file: Optional[str] = None, left_out: Sequence[str] = ()) -> None:
        self.members = list(members)
        self.left_out = list(left_out)
        self.timeout = timeout
        self.deadline = deadline
        self.max_in_flight = max_in_flight
        self.token_file = token_file
        self.progress: Optional[Progress] = None
        self.numbering: Optional[str] = None  # for a list of targets: why its ranks are places in the list
        self.failures: List[RankFailure] = []
        self.via = "auto"
        self.asked_directly: List[str] = []  # node helpers that could not gather, their ranks asked directly
        """Across ranks: ``direct`` (a request a rank), ``helpers`` (one a node, through its node helper) or
        ``auto`` (through the helpers past ``probe.client.via_helpers.AUTO_ABOVE`` ranks)."""
        self._token = token
        self._clients = [self._client(m) for m in self.members]

    def __repr__(self) -> str:
        return "<probe.Cluster %d ranks>" % len(self.members)

    def _client(self, member: Member) -> Client:
        # A little past the deadline, so that a rank still silent at the deadline is named by it (the
        # client's own limit bounds the whole answer from the start: it would race the deadline).
        # A discovered rank is TCP whatever its host is called (parse_target would read a node named
        # "core" or "unix" as a file); its fields were checked as they came (see _member).
        target = (parse_target(member.address) if member.port is None else
                  Target(member.address, transport.TcpAddress(_host_of(member.address), member.port)))
        client = Client(target, self._token, min(self.timeout, self.deadline + _MARGIN_S))
        if member.helper and member.pid is not None:
            client.helper = HostHelper(transport.TcpAddress(_host_of(member.helper),
                                                            int(member.helper.rpartition(":")[2])), self._token)
            client.remote_pid = member.pid
        return client

    @property
    def clients(self) -> List[Client]:
        """A client per rank, in the order of ``members``."""
        return list(self._clients)

    def select(self, ranks: Sequence[int]) -> "Cluster":
        """The same job, only these ranks (``--ranks 0-3,8``); an unknown rank is a usage error."""
        wanted = set(ranks)
        missing = wanted - {m.rank for m in self.members}
        if missing:
            raise UsageError("no rank %s in this job (ranks %s)" % (compact_ranks(sorted(missing)),
                                                                    compact_ranks([m.rank for m in self.members])))
        chosen = Cluster([m for m in self.members if m.rank in wanted], self._token, self.timeout, self.deadline,
                         self.max_in_flight, self.token_file, self.left_out)
        chosen.via = self.via
        return chosen

    @property
    def ranks(self) -> Any:
        """The member list as a ``pyarrow.Table`` (see :meth:`ranks_rows` for plain rows)."""
        import pyarrow as pa

        rows = self.ranks_rows()
        return pa.Table.from_pylist(rows.as_dicts())

    def ranks_rows(self) -> Rows:
        columns = tuple((c, "") for c in MEMBER_COLUMNS)
        return Rows(columns, [[getattr(m, c) for c in MEMBER_COLUMNS] for m in self.members])

    # -- the fan-out --------------------------------------------------------------------------------

    def map(self, work: Callable[[Client], Any]) -> List[RankAnswer]:
        """``work(client)`` on every rank concurrently; the answers in rank order. Ranks that failed are in
        ``failures`` (and not in the answers); where none answered, the list is empty (the other calls
        raise :class:`NoRankAnswered` instead)."""
        progress, ranks = self.progress, [m.rank for m in self.members]
        shown = None if progress is None else (lambda n, total, waiting: progress(n, total, [ranks[i] for i in waiting]))
        outcomes: List[Outcome] = fan_out(self._clients, lambda c: (work(c), c.note), self.max_in_flight,
                                          self.deadline, shown)
        answers, failures = [], []
        for member, client, outcome in zip(self.members, self._clients, outcomes):
            if outcome.error is None:
                answers.append(RankAnswer(member, outcome.value[0], outcome.value[1], client))
            else:
                exc = outcome.error
                reason = exc.message + (" -- %s" % exc.hint if exc.hint else "")
                failures.append(RankFailure(member.rank, member.host, exc.code, reason, exc.exit_code))
        self.failures = failures
        return answers

    def _answered(self, answers: List[RankAnswer], empty_if_none: bool = False) -> List[RankAnswer]:
        """``answers``, or :class:`NoRankAnswered` where there are none (and ranks to answer)."""
        if answers or empty_if_none or not self.failures:
            return answers
        raise NoRankAnswered(self.failures, self.deadline)

    def interrupt(self, kind: str, run_id: str, deadline: float = 3.0,
                  ranks: Optional[Sequence[int]] = None) -> Dict[int, str]:
        """Ask every rank (or ``ranks``) to stop the query (``kind="query"``) or snippet (``"eval"``) sent
        with ``run_id``, as a Ctrl-C does: rank -> the agent's word (``interrupted``, ``cancelled``: it
        stops as it starts, ``finished``) or why it could not be asked. Leaves ``failures`` as they were."""
        wanted = None if ranks is None else set(ranks)
        chosen = [(m, c) for m, c in zip(self.members, self._clients) if wanted is None or m.rank in wanted]
        stop = (lambda c: c.interrupt_query(run_id)) if kind == "query" else (lambda c: c.interrupt_eval(run_id))
        outcomes = fan_out([c for _, c in chosen], stop, max(1, min(len(chosen), 256)), deadline)  # not 1024 threads
        return {m.rank: (str(o.value) if o.error is None else "unreachable: %s" % o.error.message)
                for (m, _), o in zip(chosen, outcomes)}

    def query_rows(self, sql: str, max_rows: Optional[int] = None, timeout: Optional[float] = None,
                   query_id: Optional[str] = None, empty_if_none: bool = False) -> Rows:
        """Every rank's rows of ``sql``, with ``rank`` and ``host`` first (no pyarrow needed). ``query_id``
        names the query on every rank, for :meth:`interrupt`. Where no rank answered: :class:`NoRankAnswered`,
        or with ``empty_if_none`` no rows (``failures`` says why)."""
        from probe.client import via_helpers

        if via_helpers.through_helpers(self):
            rows = via_helpers.query_rows(self, sql, max_rows, timeout, query_id)
            if not rows.rows and not rows.columns:
                self._answered([], empty_if_none)
            return rows
        answers = self._answered(self.map(lambda c: c.query_rows(sql, max_rows=max_rows, timeout=timeout,
                                                                 query_id=query_id)), empty_if_none)
        from probe.client.results import by_rank

        return by_rank([(a.member.rank, a.member.host, a.value) for a in answers])

    def query(self, sql: str, max_rows: Optional[int] = None, timeout: Optional[float] = None,
              query_id: Optional[str] = None, empty_if_none: bool = False) -> Any:
        """One ``pyarrow.Table``: every rank's rows with ``rank`` and ``host`` columns first. Where no rank
        answered: :class:`NoRankAnswered`, or with ``empty_if_none`` a table of no rows (``failures`` says why)."""
        import pyarrow as pa

        from probe.client import via_helpers

        if via_helpers.through_helpers(self):
            return via_helpers.rows_to_arrow(self.query_rows(sql, max_rows, timeout, query_id, empty_if_none))
        answers = self._answered(self.map(lambda c: c.query(sql, max_rows=max_rows, timeout=timeout,
                                                            query_id=query_id)), empty_if_none)
        from probe.client.results import own_columns

        tables = []
        own = own_columns([(a.member.rank, a.member.host, a.value) for a in answers])
        for answer in answers:
            table = answer.value.replace_schema_metadata(None)
            for key, keep in own.items():  # the table's own rank/host: once (see results.by_rank)
                at = table.column_names.index(key)
                table = table.rename_columns([("table_" + n if i == at else n) for i, n in enumerate(
                    table.column_names)]) if keep else table.remove_column(at)
            n = table.num_rows
            table = table.add_column(0, "host", pa.array([answer.member.host] * n, pa.string()))
            tables.append(table.add_column(0, "rank", pa.array([answer.member.rank] * n, pa.int64())))
        if not tables:
            return pa.table({"rank": pa.array([], pa.int64()), "host": pa.array([], pa.string())})
        return pa.concat_tables(tables, promote_options="permissive")

    def backtrace_groups(self) -> Any:
        """Every rank's stacks grouped by thread name: each distinct stack with its ranks
        (``probe.client.via_helpers.Grouped``), through the node helpers or directly (``via``)."""
        from probe.client import via_helpers
        from probe.client.results import thread_stacks

        if via_helpers.through_helpers(self):
            grouped = via_helpers.backtrace_groups(self)
        else:
            threads: Dict[str, Dict[Any, List[int]]] = {}
            answers = self.map(lambda c: c.backtrace())
            for answer in answers:
                for name, key in thread_stacks(answer.value).items():
                    threads.setdefault(name, {}).setdefault(key, []).append(answer.member.rank)
            grouped = via_helpers.Grouped(threads, {a.member.rank: a.note for a in answers if a.note}, len(answers))
        if not grouped.answered and self.failures:
            raise NoRankAnswered(self.failures, self.deadline)
        return grouped

    def backtraces(self) -> List[RankAnswer]:
        """Every rank's frames (a list of :class:`Frame`); a rank read from outside has a ``note``."""
        return self._answered(self.map(lambda c: c.backtrace()))

    def backtrace(self) -> Any:
        """One ``pyarrow.Table`` of every rank's python.backtrace rows, with ``rank``, ``host`` and
        ``source`` (``agent``, or where the stacks were read from outside)."""
        import pyarrow as pa

        return pa.Table.from_pylist(backtrace_records(self.backtraces()))

    def evals(self, code: str, **options: Any) -> List[RankAnswer]:
        """``code`` run on every rank (see :meth:`Client.eval`): an :class:`EvalResult` per rank that answered."""
        return self._answered(self.map(lambda c: c.eval(code, **options)))

    def eval(self, code: str, **options: Any) -> Any:
        """One ``pyarrow.Table``: ``rank``, ``host``, ``stdout``, ``stderr``, ``value``, ``error`` per rank;
        ``value`` is a string, the ``repr()`` of the snippet's last expression (see :class:`EvalResult`)."""
        import pyarrow as pa

        return pa.Table.from_pylist(eval_records(self.evals(code, **options)))


def backtrace_records(answers: Sequence[RankAnswer]) -> List[Dict[str, Any]]:
    out = []
    for answer in answers:
        frames: List[Frame] = answer.value
        for frame in frames:
            out.append(dict(rank=answer.member.rank, host=answer.member.host,
                            source="agent" if answer.note is None else "outside", **frame.as_row()))
    return out


def eval_records(answers: Sequence[RankAnswer]) -> List[Dict[str, Any]]:
    out = []
    for answer in answers:
        result: EvalResult = answer.value
        out.append({"rank": answer.member.rank, "host": answer.member.host, "stdout": result.stdout,
                    "stderr": result.stderr, "value": result.value, "error": result.error, "ok": result.ok})
    return out


# -- discovery ------------------------------------------------------------------------------------


def _job_token(port: int) -> Optional[str]:
    """The job's token file on this host (the master, when the client runs there), when it is ours alone."""
    from probe.client.discovery import read_own_secret

    return read_own_secret(_paths.job_token_path(port))


class Discovered(NamedTuple):
    """What a host helper's ``GET /v1/ranks`` gave: the members that can be used, the job's token file
    (where the helper named one), and lines that say which members were left out, and why."""

    members: List[Member]
    token_file: Optional[str]
    left_out: List[str]


def discover(target: str, token: Optional[str], timeout: float = 5.0) -> Discovered:
    """The ranks the host helper next to ``target`` (``host:PROBE_PORT``; the helper is on port - 1) knows.

    The answer is checked field by field, as the helper checks a node's report: a helper may be older,
    buggy or not ours. A member with a field that is not what a helper sends is left out (``left_out``
    says which and why); an answer with no usable member, or not of a member list's shape, is refused
    with an error naming the helper."""

    parsed = parse_target(target)
    if not isinstance(parsed.address, transport.TcpAddress):
        raise UsageError("discovery needs the master's HOST:PORT (PROBE_PORT), not %s" % target,
                         hint="or list the targets: %s" % option("-t HOST:PORT several times, or --hosts FILE",
                                                                  "connect_all([\"HOST:PORT\", ...])"))
    host, port = parsed.address.host, parsed.address.port
    given_helper = os.environ.get("PROBE_HELPER_PORT")
    if given_helper and not (given_helper.isascii() and given_helper.isdigit() and 0 < int(given_helper) < 65536):
        raise UsageError("PROBE_HELPER_PORT=%s is not a port" % _shown(given_helper),
                         hint="unset it (the helper listens one below PROBE_PORT), or give a number from 1 to 65535")
    helper = transport.TcpAddress(host, int(given_helper or port - 1))

    def wrong_port() -> None:
        """Raise a usage error naming the job, where PORT is known here to be a rank's or a helper's port."""
        found = None if given_helper else _port_of_a_local_job(host, port)
        if found is not None:
            what, job = found
            raise UsageError("%s is %s of the job with PROBE_PORT=%d on this host, not the job's address"
                             % (target, what, job), hint=option("probe %s ranks", "connect_all(\"%s\")")
                             % _with_port(host, job))

    def unusable(why: str) -> ConnectError:
        return ConnectError("the host helper at %s sent %s" % (helper, why),
                            hint="is it a host helper of this probe's version? Upgrade probe where the job's launcher "
                                 "runs, or list the targets (%s)" % option("-t several times, or --hosts",
                                                                          "connect_all([\"HOST:PORT\", ...])"))

    try:
        answer = transport.request(helper, "GET", "/v1/ranks", None, None, timeout, token=token)
    except ConnectError as exc:
        wrong_port()
        raise ConnectError("no host helper at %s to list the job's ranks (%s)" % (helper, exc.message),
                           hint="start the job with PROBE=1 PROBE_PORT=%d (under any launcher); or list the targets (%s)"
                           % (port, option("-t several times, or --hosts", "connect_all([\"HOST:PORT\", ...])"))) from None
    raw = _json(answer.body)
    if answer.status >= 400:
        from probe.errors import error_from_code

        wrong_port()
        if answer.status == 404:  # an agent answers there (a rank's port), not a host helper
            raise UsageError("%s is a rank's agent, not a job's host helper: %s is not the job's PROBE_PORT"
                             % (helper, target), hint="give the job's PROBE_PORT: rank 0's port (the helper listens "
                                                      "one below it); or ask this rank alone: %s"
                                                      % (option("probe %s ...", "connect(\"%s\")") % target))
        error = raw.get("error") if isinstance(raw, dict) else None
        code = error.get("code") if isinstance(error, dict) else None
        if not isinstance(code, str):
            raise unusable("HTTP %d without an error of probe's form" % answer.status)
        message, hint = error.get("message"), error.get("hint")  # type: ignore[union-attr]
        raise error_from_code(code if len(code) < 40 else "internal",
                              "host helper at %s: %s" % (helper, message[:300] if isinstance(message, str) else
                                                         "HTTP %d" % answer.status),
                              hint[:300] if isinstance(hint, str) else None)
    if raw is _NOT_JSON:
        raise unusable("an answer that is not JSON")
    if not isinstance(raw, dict) or not isinstance(raw.get("members"), list):
        raise unusable("no member list")
    listed = raw["members"]
    if len(listed) > MAX_LISTED:
        raise unusable("%d members, more than the %d a host helper lists" % (len(listed), MAX_LISTED))
    own = raw.get("host")
    if own is not None and not _is_host(own):
        raise unusable("its own host as %s, not a host name or address" % _shown(own))
    token_file = raw.get("token_file")
    if not (isinstance(token_file, str) and 0 < len(token_file) <= 4096 and token_file.isprintable()):
        token_file = None  # only ever shown: one that is no path is not
    members: List[Member] = []
    problems: List[str] = []
    seen = set()
    for i, item in enumerate(listed):
        try:
            member = _member(item, host, own, helper)
            if member.rank in seen:
                raise _Unusable("rank %d again" % member.rank)
        except _Unusable as exc:
            problems.append("member %d: %s" % (i, exc))
            continue
        seen.add(member.rank)
        members.append(member)
    if problems and not members:
        raise unusable("no member that can be used (%s)" % _summary(problems))
    left_out = []
    if problems:
        left_out.append("the host helper at %s listed %d member%s that cannot be used, left out: %s" % (
            helper, len(problems), "" if len(problems) == 1 else "s", _summary(problems)))
    return Discovered(members, token_file, left_out)


MAX_LISTED = 1 << 18  # members in one helper's answer: the master's keeps 131072 of other nodes at most
_MAX_INT = (1 << 31) - 1
_MAX_PID = 1 << 22  # the kernel's PID_MAX_LIMIT
_HOST = re.compile(r"[A-Za-z0-9._:%\[\]-]{1,253}")  # a host name or address (IPv6 with or without [])
_STATE = re.compile(r"[a-z_]{1,20}")  # running, silent, ...: a word, so that a newer helper's is shown too
_NOT_JSON = object()


class _Unusable(Exception):
    """A member of a helper's answer that cannot be used, and why."""


def _json(body: bytes) -> Any:
    import json

    try:
        return json.loads(bytes(body).decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested too deeply
        return _NOT_JSON


def _shown(value: Any) -> str:
    """A value from a helper, short and printable enough to quote in an error (repr escapes controls)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() >= 64:
        return "an integer of %d bits" % value.bit_length()
    text = repr(value if not isinstance(value, (list, dict)) or len(value) < 8 else type(value)())
    text = text if text.isascii() else ascii(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _summary(problems: List[str], shown: int = 5) -> str:
    more = len(problems) - shown
    return "; ".join(problems[:shown]) + ("; and %d more" % more if more > 0 else "")


def _is_host(value: Any) -> bool:
    return isinstance(value, str) and _HOST.fullmatch(value) is not None


def _is_host_port(value: Any) -> bool:
    """``HOST:PORT`` (the host may be an IPv6 address, bracketed or not), port 1-65535."""
    if not isinstance(value, str):
        return False
    host, sep, port = value.rpartition(":")
    return bool(sep) and _is_host(host) and port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536


def _host_of(address: str) -> str:
    """The host of a checked ``HOST:PORT``, without the brackets of an IPv6 address."""
    return address.rpartition(":")[0].strip("[]")


def _int(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _field(raw: Dict[str, Any], key: str, low: int, high: int, needed: bool = False) -> Optional[int]:
    """``raw[key]``, an integer from ``low`` to ``high``; None where absent (or null) and not ``needed``."""
    value = raw.get(key)
    if value is None and not needed:
        return None
    number = _int(value)
    if number is None or not low <= number <= high:
        raise _Unusable("%s is %s, not an integer from %d to %d" % (key, _shown(value), low, high))
    return number


def _member(raw: Any, typed_host: str, helper_host: Optional[str], helper: transport.TcpAddress) -> Member:
    """One member of a helper's answer, every field checked (see :func:`discover`); ``_Unusable`` if not."""
    if not isinstance(raw, dict):
        raise _Unusable("%s, not an object" % _shown(raw))
    rank = _field(raw, "rank", 0, _MAX_INT, needed=True)
    port = _field(raw, "port", 1, 65535, needed=True)
    host = raw.get("host")
    if not _is_host(host):
        raise _Unusable("host is %s, not a host name or address" % _shown(host))
    world_size = _field(raw, "world_size", 1, _MAX_INT)
    if world_size is not None and rank >= world_size:  # type: ignore[operator]
        raise _Unusable("rank %d is not below its world size %d" % (rank, world_size))
    pid = _field(raw, "pid", 1, _MAX_PID)
    local_rank, node = _field(raw, "local_rank", 0, _MAX_INT), _field(raw, "node", 0, _MAX_INT)
    restarts = _field(raw, "restarts", 0, _MAX_INT)
    state = raw.get("state")
    if state is not None and not (isinstance(state, str) and _STATE.fullmatch(state)):
        raise _Unusable("state is %s, not a word such as running" % _shown(state))
    age = raw.get("heartbeat_age")
    if age is not None and not (isinstance(age, (int, float)) and not isinstance(age, bool) and math.isfinite(age)
                                and 0 <= age < 1e9):
        raise _Unusable("heartbeat_age is %s, not null or seconds" % _shown(age))
    node_helper = raw.get("helper")
    if node_helper is not None and not _is_host_port(node_helper):
        raise _Unusable("helper is %s, not HOST:PORT" % _shown(node_helper))
    same_node = host == helper_host
    reach = typed_host if same_node else host  # the master's ranks: at the address the user gave
    if same_node:
        node_helper = "%s:%d" % ("[%s]" % helper.host if ":" in helper.host else helper.host, helper.port)
    note = raw.get("note")
    return Member(rank, host, _with_port(reach.strip("[]"), port), port, pid, state, local_rank,  # type: ignore[arg-type]
                  node, world_size, restarts, age, node_helper or None, note[:300] if isinstance(note, str) else None)


def _port_of_a_local_job(host: str, port: int) -> Optional[Tuple[str, int]]:
    """``("rank 1's port", 9700)`` or ``("the host helper's port", 9700)`` where ``host:port`` is on this
    host and belongs to a job of this host without being its PROBE_PORT; else None. Known from the job
    token files this host's helpers keep, and the member list of the helper beside each (asked with that
    token): only for a mistyped address, never on the way to an answer."""
    import socket

    try:
        address = socket.gethostbyname(host)
        if not address.startswith("127.") and address != socket.gethostbyname(socket.gethostname()):
            return None
        names = os.listdir(_paths.runtime_dir())
    except OSError:
        return None
    for job in sorted(int(m.group(1)) for m in (re.fullmatch(r"job-(\d+)\.token", n) for n in names) if m):
        if job == port or not job - 1 <= port < job + 4096:
            continue
        token = _job_token(job)
        try:
            answer = transport.request(transport.TcpAddress("127.0.0.1", job - 1), "GET", "/v1/ranks", None,
                                       None, 2.0, token=token)
        except ProbeError:
            continue
        raw = _json(answer.body)
        if answer.status != 200 or not isinstance(raw, dict) or not isinstance(raw.get("members"), list):
            continue
        if port == job - 1:
            return "the host helper's port", job
        own = raw.get("host")
        for member in raw["members"]:
            if isinstance(member, dict) and member.get("port") == port and member.get("host") == own:
                rank = _int(member.get("rank"))
                return ("rank %d's port" % rank if rank is not None else "a rank's port"), job
    return None


def _with_port(host: str, port: int) -> str:
    return "%s:%d" % ("[%s]" % host if ":" in host else host, port)


def connect_all(targets: Union[str, Sequence[str]], token: Optional[str] = None, token_file: Optional[str] = None,
                timeout: float = DEFAULT_TIMEOUT, deadline: float = DEFAULT_DEADLINE,
                max_in_flight: int = DEFAULT_IN_FLIGHT) -> Cluster:
    """A client of every rank: ``"master:PROBE_PORT"`` (discovered through the host helper) or a list of
    targets (``rank`` is the position in the list). The token: given, ``token_file``, ``$PROBE_TOKEN_FILE``,
    ``$PROBE_TOKEN``, or the job's token file on this host. ``"slurm:JOBID[:PORT]"``: the nodes of a Slurm
    job from Slurm itself, each node's helper lists its ranks (see :mod:`probe.client.slurm`)."""
    if isinstance(targets, str) and targets.strip().startswith("slurm:"):
        from probe.client.slurm import connect_job

        return connect_job(targets, token, token_file, timeout, deadline, max_in_flight)
    secret = _read_token(token, token_file)
    if isinstance(targets, str):
        parsed = parse_target(targets)
        port = getattr(parsed.address, "port", None)
        here = None  # the job's token file on this host, where the token came from it (a helper names none over TCP)
        if secret is None and port is not None:
            secret = _job_token(port)
            here = _paths.job_token_path(port) if secret is not None else None
        found = _discover_whole(targets, secret, min(timeout, deadline))
        if not found.members:
            raise ProbeError("the host helper at %s knows no rank yet (the job is starting?)" % targets,
                             hint="retry in a moment")
        return Cluster(found.members, secret, timeout, deadline, max_in_flight, found.token_file or here,
                       found.left_out)
    members = [Member(i, t, t) for i, t in enumerate(targets)]
    if not members:
        raise UsageError("no targets given")
    cluster = Cluster(members, secret, timeout, deadline, max_in_flight)
    return _numbered_by_their_ranks(cluster)


WHOLE_LIST_S = 1.5
"""How long a listing that lacks ranks of the job's world size is asked for again: a rank registers with
its node's helper a moment after it learns its rank (under Lightning's ddp, only from
``init_process_group``), so a command run just then would otherwise ask fewer ranks and say nothing."""


def _discover_whole(target: str, secret: Optional[str], timeout: float) -> Discovered:
    """The helper's listing, asked again every 0.1 s for up to ``WHOLE_LIST_S`` while it lists no rank or
    fewer ranks than the world size its members report; the ranks still missing then are said in
    ``left_out`` (the command exits 7: its answer is partial)."""
    import time

    give_up = time.monotonic() + min(WHOLE_LIST_S, timeout)
    while True:
        found = discover(target, secret, timeout)
        missing = _unlisted(found.members)
        if (found.members and not missing) or time.monotonic() >= give_up:
            break
        time.sleep(0.1)
    if found.members and missing:
        size = max(m.world_size or 0 for m in found.members)
        line = ("rank%s %s of the job's %d %s not listed by its helpers (not registered yet: starting, or on a "
                "node whose helper is not known); the answer covers the listed ranks only"
                % ("s" if len(missing) > 1 else "", compact_ranks(missing), size, "are" if len(missing) > 1 else "is"))
        found = found._replace(left_out=list(found.left_out) + [line])
    return found


def _unlisted(members: Sequence[Member]) -> List[int]:
    """The ranks below the largest world size the members report that no member is (capped: a world size
    is the members' word, not trusted to size a list)."""
    sizes = [m.world_size for m in members if isinstance(m.world_size, int) and 0 < m.world_size <= MAX_RANKS]
    if not sizes:
        return []
    listed = {m.rank for m in members}
    return [r for r in range(max(sizes)) if r not in listed]


RANK_ASK_S = 2.0  # how long a listed target may take to say its rank


def _numbered_by_their_ranks(cluster: Cluster) -> Cluster:
    """A list of targets numbered by the ranks their agents say they are (``health``), asked at once and
    within ``RANK_ASK_S``: rank 5 is rank 5, not the sixth target written. Where a target does not say
    its rank (no agent answers, no rank) or two say the same, every target keeps its place in the list as
    its rank, and ``numbering`` says why."""
    outcomes = fan_out(cluster.clients, lambda c: c.health(), cluster.max_in_flight, min(RANK_ASK_S, cluster.deadline))
    ranks: List[Optional[int]] = []
    for i, outcome in enumerate(outcomes):
        value = outcome.value if outcome.error is None else None
        value = value if isinstance(value, dict) else {}
        number = {key: _int(value.get(key)) for key in ("rank", "local_rank", "world_size", "node", "pid")}
        number = {k: v if v is not None and 0 <= v <= _MAX_INT else None for k, v in number.items()}
        ranks.append(number["rank"])
        if value:  # what the target said of itself fills in its row of `ranks`
            state = value.get("state")
            cluster.members[i] = cluster.members[i]._replace(
                pid=number["pid"], local_rank=number["local_rank"], world_size=number["world_size"],
                node=number["node"], state=state if isinstance(state, str) and _STATE.fullmatch(state) else "running")
    silent = [m.host for m, r in zip(cluster.members, ranks) if r is None]
    if silent or len(set(ranks)) != len(ranks):
        why = ("%s did not say %s rank" % (", ".join(silent[:3]) + (" and %d more" % (len(silent) - 3) if len(silent) > 3
                                                                       else ""), "its" if len(silent) == 1 else "their")
               if silent else "two targets say they are the same rank")
        cluster.numbering = "the ranks shown are places in the list of targets (from 0): %s" % why
        return cluster
    numbered = sorted(((r, m, c) for r, m, c in zip(ranks, cluster.members, cluster.clients)), key=lambda x: x[0])
    cluster.members = [m._replace(rank=r) for r, m, _ in numbered]  # type: ignore[misc]
    cluster._clients = [c for _, _, c in numbered]
    return cluster


def parse_rank_list(text: str) -> List[int]:
    """``"0-3,8"`` -> [0, 1, 2, 3, 8]."""
    out: List[int] = []
    for part in text.split(","):
        part = part.strip()
        low, dash, high = part.partition("-")
        if low.isdigit() and (not dash or high.isdigit()):
            first, last = int(low), int(high if dash else low)
            if last < first:
                raise UsageError("the rank range %s is empty: it ends before it starts" % part,
                                 hint="write the lower rank first, e.g. --ranks %d-%d" % (last, first))
            if last - first > MAX_RANKS or len(out) > MAX_RANKS:
                raise UsageError("the rank list %r names more than %d ranks" % (text, MAX_RANKS),
                                 hint="e.g. --ranks 0-3,8, or --all-ranks")
            out.extend(range(first, last + 1))
            continue
        raise UsageError("cannot read the rank list %r" % text, hint="e.g. --ranks 0-3,8")
    return sorted(set(out))


def compact_ranks(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 3, 8] -> ``"0-3,8"``."""
    values = sorted(set(ranks))
    parts = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else "%d-%d" % (values[i], values[j]))
        i = j + 1
    return ",".join(parts)
