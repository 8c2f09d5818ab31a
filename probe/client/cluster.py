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

import os
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from probe import _paths
from probe.client import transport
from probe.client.client import DEFAULT_TIMEOUT, Client, _read_token
from probe.client.fanout import Outcome, Progress, fan_out
from probe.client.helped import HostHelper
from probe.client.results import EvalResult, Frame, Rows
from probe.client.targets import parse_target
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
    call that did not answer, and why."""

    def __init__(self, members: Sequence[Member], token: Optional[str], timeout: float = DEFAULT_TIMEOUT,
                 deadline: float = DEFAULT_DEADLINE, max_in_flight: int = DEFAULT_IN_FLIGHT,
                 token_file: Optional[str] = None) -> None:
        self.members = list(members)
        self.timeout = timeout
        self.deadline = deadline
        self.max_in_flight = max_in_flight
        self.token_file = token_file
        self.progress: Optional[Progress] = None
        self.failures: List[RankFailure] = []
        self._token = token
        self._clients = [self._client(m) for m in self.members]

    def __repr__(self) -> str:
        return "<probe.Cluster %d ranks>" % len(self.members)

    def _client(self, member: Member) -> Client:
        # A little past the deadline, so that a rank still silent at the deadline is named by it (the
        # client's own limit bounds the whole answer from the start: it would race the deadline).
        client = Client(parse_target(member.address), self._token, min(self.timeout, self.deadline + _MARGIN_S))
        if member.helper and member.pid is not None:
            host, _, port = member.helper.rpartition(":")
            client.helper = HostHelper(transport.TcpAddress(host, int(port)), self._token)
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
        return Cluster([m for m in self.members if m.rank in wanted], self._token, self.timeout, self.deadline,
                       self.max_in_flight, self.token_file)

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
        answers = self._answered(self.map(lambda c: c.query_rows(sql, max_rows=max_rows, timeout=timeout,
                                                                 query_id=query_id)), empty_if_none)
        parts = [a.value.with_column("host", a.member.host).with_column("rank", a.member.rank) for a in answers]
        if parts:
            parts = [Rows((("rank", "BIGINT"),) + p.columns[1:], p.rows, p.truncated) for p in parts]
        return Rows.concat(parts)

    def query(self, sql: str, max_rows: Optional[int] = None, timeout: Optional[float] = None,
              query_id: Optional[str] = None, empty_if_none: bool = False) -> Any:
        """One ``pyarrow.Table``: every rank's rows with ``rank`` and ``host`` columns first. Where no rank
        answered: :class:`NoRankAnswered`, or with ``empty_if_none`` a table of no rows (``failures`` says why)."""
        import pyarrow as pa

        answers = self._answered(self.map(lambda c: c.query(sql, max_rows=max_rows, timeout=timeout,
                                                            query_id=query_id)), empty_if_none)
        tables = []
        for answer in answers:
            table = answer.value.replace_schema_metadata(None)
            n = table.num_rows
            table = table.add_column(0, "host", pa.array([answer.member.host] * n, pa.string()))
            tables.append(table.add_column(0, "rank", pa.array([answer.member.rank] * n, pa.int64())))
        if not tables:
            return pa.table({"rank": pa.array([], pa.int64()), "host": pa.array([], pa.string())})
        return pa.concat_tables(tables, promote_options="permissive")

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


def discover(target: str, token: Optional[str], timeout: float = 5.0) -> Tuple[List[Member], Dict[str, Any]]:
    """The ranks the host helper next to ``target`` (``host:PROBE_PORT``; the helper is on port - 1) knows."""
    import json

    parsed = parse_target(target)
    if not isinstance(parsed.address, transport.TcpAddress):
        raise UsageError("discovery needs the master's HOST:PORT (PROBE_PORT), not %s" % target,
                         hint="or list the targets: %s" % option("-t HOST:PORT several times, or --hosts FILE",
                                                                  "connect_all([\"HOST:PORT\", ...])"))
    host, port = parsed.address.host, parsed.address.port
    given_helper = os.environ.get("PROBE_HELPER_PORT")
    helper = transport.TcpAddress(host, int(given_helper or port - 1))
    headers = {"Authorization": "Bearer %s" % token} if token else {}

    def wrong_port() -> None:
        """Raise a usage error naming the job, where PORT is known here to be a rank's or a helper's port."""
        found = None if given_helper else _port_of_a_local_job(host, port)
        if found is not None:
            what, job = found
            raise UsageError("%s is %s of the job with PROBE_PORT=%d on this host, not the job's address"
                             % (target, what, job), hint=option("probe %s ranks", "connect_all(\"%s\")")
                             % _with_port(host, job))

    try:
        answer = transport.request(helper, "GET", "/v1/ranks", None, headers, timeout)
    except ConnectError as exc:
        wrong_port()
        raise ConnectError("no host helper at %s to list the job's ranks (%s)" % (helper, exc.message),
                           hint="start the job as PROBE_PORT=%d torchrun ...; or list the targets (%s)"
                           % (port, option("-t several times, or --hosts", "connect_all([\"HOST:PORT\", ...])"))) from None
    try:
        raw = json.loads(answer.body.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise ProbeError("the host helper at %s sent an answer that is not JSON" % (helper,)) from None
    if answer.status >= 400:
        from probe.errors import error_from_code

        wrong_port()
        if answer.status == 404:  # an agent answers there (a rank's port), not a host helper
            raise UsageError("%s is a rank's agent, not a job's host helper: %s is not the job's PROBE_PORT"
                             % (helper, target), hint="give the job's PROBE_PORT: rank 0's port (the helper listens "
                                                      "one below it); or ask this rank alone: %s"
                                                      % (option("probe %s ...", "connect(\"%s\")") % target))
        error = raw.get("error", {}) if isinstance(raw, dict) else {}
        raise error_from_code(str(error.get("code", "internal")), "host helper at %s: %s" % (
            helper, str(error.get("message", ""))[:300]), error.get("hint"))
    if not isinstance(raw, dict) or not isinstance(raw.get("members"), list):
        raise ProbeError("the host helper at %s sent no member list" % (helper,))
    own = str(raw.get("host"))
    members = [_member(m, host, own, helper) for m in raw["members"][:100000] if isinstance(m, dict)]
    return [m for m in members if m is not None], raw


def _port_of_a_local_job(host: str, port: int) -> Optional[Tuple[str, int]]:
    """``("rank 1's port", 9700)`` or ``("the host helper's port", 9700)`` where ``host:port`` is on this
    host and belongs to a job of this host without being its PROBE_PORT; else None. Known from the job
    token files this host's helpers keep, and the member list of the helper beside each (asked with that
    token): only for a mistyped address, never on the way to an answer."""
    import json
    import re
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
                                       {"Authorization": "Bearer %s" % token} if token else {}, 2.0)
            raw = json.loads(answer.body.decode("utf-8"))
        except (ProbeError, ValueError, UnicodeDecodeError):
            continue
        if answer.status != 200 or not isinstance(raw, dict) or not isinstance(raw.get("members"), list):
            continue
        if port == job - 1:
            return "the host helper's port", job
        own = raw.get("host")
        for member in raw["members"]:
            if isinstance(member, dict) and member.get("port") == port and member.get("host") == own:
                return "rank %s's port" % member.get("rank"), job
    return None


def _with_port(host: str, port: int) -> str:
    return "%s:%d" % ("[%s]" % host if ":" in host else host, port)


def _int(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _member(raw: Dict[str, Any], typed_host: str, helper_host: str, helper: transport.TcpAddress) -> Optional[Member]:
    rank, port = _int(raw.get("rank")), _int(raw.get("port"))
    if rank is None or port is None or not 0 < port < 65536:
        return None
    host = str(raw.get("host"))[:255]
    same_node = host == helper_host
    reach = typed_host if same_node else host  # the master's ranks: at the address the user gave
    node_helper = "%s:%d" % (helper.host, helper.port) if same_node else str(raw.get("helper") or "")[:300] or None
    age = raw.get("heartbeat_age")
    return Member(rank, host, "%s:%d" % ("[%s]" % reach if ":" in reach else reach, port), port,
                  _int(raw.get("pid")), str(raw.get("state"))[:20], _int(raw.get("local_rank")),
                  _int(raw.get("node")), _int(raw.get("world_size")), _int(raw.get("restarts")),
                  age if isinstance(age, (int, float)) and not isinstance(age, bool) else None, node_helper)


def connect_all(targets: Union[str, Sequence[str]], token: Optional[str] = None, token_file: Optional[str] = None,
                timeout: float = DEFAULT_TIMEOUT, deadline: float = DEFAULT_DEADLINE,
                max_in_flight: int = DEFAULT_IN_FLIGHT) -> Cluster:
    """A client of every rank: ``"master:PROBE_PORT"`` (discovered through the host helper) or a list of
    targets (``rank`` is the position in the list). The token: given, ``token_file``, ``$PROBE_TOKEN_FILE``,
    ``$PROBE_TOKEN``, or the job's token file on this host."""
    secret = _read_token(token, token_file)
    if isinstance(targets, str):
        parsed = parse_target(targets)
        port = getattr(parsed.address, "port", None)
        if secret is None and port is not None:
            secret = _job_token(port)
        members, raw = discover(targets, secret, min(timeout, deadline))
        if not members:
            raise ProbeError("the host helper at %s knows no rank yet (the job is starting?)" % targets,
                             hint="retry in a moment")
        return Cluster(members, secret, timeout, deadline, max_in_flight, raw.get("token_file"))
    members = [Member(i, t, t) for i, t in enumerate(targets)]
    if not members:
        raise UsageError("no targets given")
    return Cluster(members, secret, timeout, deadline, max_in_flight)


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
