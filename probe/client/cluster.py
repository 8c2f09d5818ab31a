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

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Union

from probe import _paths
import probe.client.transport as transport
from probe.client.client import DEFAULT_TIMEOUT, Client
from probe.client.connection import read_token as _read_token
from probe.client.fanout import Outcome, Progress, fan_out
from probe.client.helped import HostHelper
from probe.client.listing import _STATE, Discovered, _int, _MAX_INT, discover, discover_whole, job_token
from probe.client.members import (MAX_RANKS, MEMBER_COLUMNS, Member, NoRankAnswered, RankFailure, _host_of,
                                  compact_ranks, parse_rank_list)
from probe.client.results import EvalResult, Frame, Rows
from probe.client.sources import kind_for
from probe.client.targets import Target, parse_target
from probe.errors import ProbeError, UsageError

__all__ = ["Member", "RankFailure", "RankAnswer", "Cluster", "NoRankAnswered", "connect_all", "parse_rank_list",
           "compact_ranks", "Discovered", "discover", "MAX_RANKS", "MEMBER_COLUMNS"]

DEFAULT_DEADLINE = 10.0
DEFAULT_IN_FLIGHT = 32  # young requests at once; see probe.client.fanout
_MARGIN_S = 0.5

class RankAnswer(NamedTuple):
    """One rank's answer; ``note`` says where it came from when not from its agent (read from outside)."""

    member: Member
    value: Any
    note: Optional[str]
    client: Client



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
        self._made: Optional[List[Client]] = None
        if any(m.port is None for m in self.members):  # a list of targets: one that cannot be parsed is said now
            self._made = [self._client(m) for m in self.members]

    @property
    def _clients(self) -> List[Client]:
        """A client per rank, made at the first call that asks the ranks themselves: through the node
        helpers (diagnose's looks at 16k ranks, each with its own selection of the job) no rank's client is
        ever used, and making them cost a fifth of a second a selection."""
        if self._made is None:
            self._made = [self._client(m) for m in self.members]
        return self._made

    @_clients.setter
    def _clients(self, clients: List[Client]) -> None:
        self._made = list(clients)

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

    def plain(self, members: Sequence[Member]) -> "Cluster":
        """A plain cluster of ``members`` asked directly, with this one's token and limits (the ranks a node
        helper could not gather for: ``probe.client.via_helpers``)."""
        sub = Cluster(members, self._token, self.timeout, self.deadline, self.max_in_flight, self.token_file)
        sub.via = "direct"
        return sub

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

    def stack_history(self) -> Any:
        """``cluster.stack_history`` as a ``pyarrow.Table``: where each rank has been, as its node helper
        sampled it (``probe.client.stack_history``)."""
        from probe.client.stack_history import fetch, to_arrow

        return to_arrow(fetch(self))

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
        import probe.client.via_helpers as via_helpers

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

        import probe.client.via_helpers as via_helpers

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
        import probe.client.via_helpers as via_helpers
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


def connect_all(targets: Union[str, Sequence[str]], token: Optional[str] = None, token_file: Optional[str] = None,
                timeout: float = DEFAULT_TIMEOUT, deadline: float = DEFAULT_DEADLINE,
                max_in_flight: int = DEFAULT_IN_FLIGHT) -> Cluster:
    """A client of every rank: ``"master:PROBE_PORT"`` (discovered through the host helper) or a list of
    targets (``rank`` is the position in the list). The token: given, ``token_file``, ``$PROBE_TOKEN_FILE``,
    ``$PROBE_TOKEN``, or the job's token file on this host. ``"slurm:JOBID[:PORT]"``: the nodes of a Slurm
    job from Slurm itself, each node's helper lists its ranks (see :mod:`probe.client.slurm`)."""
    if isinstance(targets, str) and targets.strip().startswith("slurm:"):
        from probe.client.slurm import list_job

        job = list_job(targets, token, token_file, timeout, deadline, max_in_flight)
        cluster = Cluster(job.members, job.secret, timeout, deadline, max_in_flight, job.token_file, job.left_out)
        cluster.slurm = job.job  # type: ignore[attr-defined]
        return cluster
    kind = kind_for(targets) if isinstance(targets, str) else None
    if kind is not None and kind.every is not None:  # a kind registered from above (snapshot:PATH: the ranks recorded)
        return kind.every(targets, deadline, max_in_flight)  # type: ignore[no-any-return]
    secret = _read_token(token, token_file)
    if isinstance(targets, str):
        parsed = parse_target(targets)
        port = getattr(parsed.address, "port", None)
        here = None  # the job's token file on this host, where the token came from it (a helper names none over TCP)
        if secret is None and port is not None:
            secret = job_token(port)
            here = _paths.job_token_path(port) if secret is not None else None
        found = discover_whole(targets, secret, min(timeout, deadline))
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

