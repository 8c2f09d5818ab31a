"""What every command shares: the targets, how to reach them, and how errors end the command."""

import os
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, TypeVar

from probe.cli.output import say
from probe.cli.render import visible
from probe.client import Client, connect
from probe.errors import ConnectError, ConnectionRefused, ProbeError, UsageError

__all__ = ["CliContext", "each_target", "open_kinds"]  # and pass_cli, made on first use (below)


def open_kinds(targets: List[str]) -> None:
    """Register the source kinds defined above the client that ``targets`` name (the client opens them
    through ``probe.client.sources``, never importing them); only then, so that the loop commands on a
    pid or HOST:PORT import none of them."""
    if any(t.strip().startswith("snapshot:") for t in targets):
        import probe.snapshot.target  # noqa: F401  (registers snapshot:PATH)

T = TypeVar("T")


class CliContext:
    """The command line's global options, and how the command is going (failures, exit code). A plain
    class, not a dataclass: ``dataclasses`` imports ``inspect``, some 5 ms of every command's start-up."""

    def __init__(self, targets: Optional[List[str]] = None, token: Optional[str] = None,
                 token_file: Optional[str] = None, timeout: float = 30.0, failures: int = 0, exit_code: int = 0,
                 wait: Optional[float] = None, executable: Optional[str] = None, timeout_given: bool = False,
                 all_ranks: bool = False, ranks: Optional[str] = None, hosts: Optional[str] = None,
                 deadline: Optional[float] = None, max_in_flight: int = 32, via: str = "auto") -> None:
        self.targets: List[str] = [] if targets is None else targets
        self.token = token
        self.token_file = token_file
        self.timeout = timeout
        self.failures = failures
        self.exit_code = exit_code
        self.wait = wait
        self.executable = executable
        self.timeout_given = timeout_given  # --timeout was given: it bounds every answer (else the work's own limit does)
        self.all_ranks = all_ranks
        self.ranks = ranks  # --ranks LIST
        self.hosts = hosts  # --hosts FILE
        self.deadline = deadline
        self.max_in_flight = max_in_flight
        self.via = via  # --via: across ranks, through the node helpers or directly
        self._cluster: Optional[Any] = None
        self._labels: Dict[int, str] = {}  # id(client) -> "rank N (HOST:PORT)", across ranks
        self._members: Dict[int, Any] = {}  # id(client) -> its rank's Member, across ranks
        self.judged_alone: Optional[Dict[str, Any]] = None  # one rank of several, asked alone (try_job_at_master)

    def label(self, client: Client) -> str:
        """How output names a target: ``rank N (HOST:PORT)`` across ranks, else the target as written."""
        return self._labels.get(id(client), client.target.label)

    def cluster_member(self, client: Client) -> Optional[Any]:
        """The rank (``Member``) a client of a command across ranks speaks to; None for others."""
        return self._members.get(id(client))

    @property
    def is_cluster(self) -> bool:
        """Every rank at once (``--all-ranks``, ``--ranks``, ``--hosts``): concurrent, grouped output."""
        return self.all_ranks or self.ranks is not None or self.hosts is not None

    def cluster(self) -> Any:
        """The ranks this command runs on: discovered from the one target, or the listed targets."""
        if self._cluster is not None:
            return self._cluster
        from probe.cli.progress import progress_line
        from probe.client.cluster import DEFAULT_DEADLINE, connect_all, parse_rank_list

        targets = list(self.targets)
        if self.hosts:
            targets += _read_hosts(self.hosts)
        if not targets and os.environ.get("PROBE_TARGET"):
            targets = [os.environ["PROBE_TARGET"]]
        if not targets:
            raise UsageError("no target given", hint="give the master's HOST:PROBE_PORT, -t several times, or --hosts FILE")
        deadline = self.deadline or min(DEFAULT_DEADLINE, self.timeout)
        open_kinds(targets)
        if any(t.strip().startswith("snapshot:") for t in targets) and (len(targets) > 1 or self.hosts):
            raise UsageError("a snapshot is read alone, not beside other targets",
                             hint="give one snapshot:PATH, without -t or --hosts")
        else:  # snapshot:PATH: the ranks as recorded, through the kind probe.snapshot.target registered
            cluster = connect_all(targets[0] if len(targets) == 1 and not self.hosts else targets, self.token,
                                  self.token_file, self.timeout, deadline, self.max_in_flight)
        for line in cluster.left_out:  # members the host helper listed in a form that cannot be used
            say("probe: " + visible(line), err=True)
        if cluster.left_out:  # ranks (or a node's) not asked: whatever the others answer is partial
            self.exit_code = self.exit_code or PARTIAL
        if cluster.numbering:
            say("probe: " + visible(cluster.numbering), err=True)
        if self.ranks is not None:
            cluster = cluster.select(parse_rank_list(self.ranks))
        cluster.progress = progress_line()
        cluster.via = self.via
        self._cluster = cluster
        return cluster

    def master_port(self) -> Optional[int]:
        """The port of the one target where it is written HOST:PORT (a job's master, or one agent), else None."""
        targets = self.targets or ([os.environ["PROBE_TARGET"]] if os.environ.get("PROBE_TARGET") else [])
        if len(targets) != 1 or targets[0].strip().startswith(("slurm:", "snapshot:")):
            return None
        from probe.client.targets import parse_target

        try:
            parsed = parse_target(targets[0])
        except ProbeError:
            return None
        if parsed.pid is None and parsed.core is None and hasattr(parsed.address, "port"):
            return int(parsed.address.port)
        return None

    def try_job_at_master(self) -> bool:
        """Whether the one HOST:PORT target is a job's master with a node helper answering beside it (then
        ``cluster()`` is its ranks). The command goes on for the one agent there only where no helper is
        there (nothing listens at PORT-1, or a rank's agent does), or where a helper failed and the agent
        says it is alone (no world of several): a rank's answer must not pass for the whole job's. A helper
        that hangs up or times out is asked again for ``HELPER_RETRY_S``. Where the agent is one rank of
        several and goes on alone, ``judged_alone`` says so (the command says it beside its answer)."""
        if self.master_port() is None:
            return False
        self.all_ranks = True
        until = time.monotonic() + HELPER_RETRY_S
        failed: Optional[ConnectError] = None
        why = ""
        while True:
            try:
                self.cluster()
                return True
            except UsageError as exc:  # a rank's agent at PORT-1, not a helper: PORT is no job's address
                why = exc.message
                break
            except ConnectError as exc:
                if getattr(exc, "nothing_listens", False):
                    why = exc.message
                    break
                failed = exc
                if time.monotonic() >= until:
                    break
                time.sleep(0.3)
        self.all_ranks = False
        self._cluster = None
        target = self.targets[0] if self.targets else os.environ.get("PROBE_TARGET", "")
        try:
            said = self.clients()[0].health(fallback=False)
        except ProbeError as exc:
            if failed is None:
                return False  # no helper: the command meets the agent's own error, as for any one target
            raise ConnectError("%s; and the agent at %s did not say whether it is one rank of several (%s), so "
                               "its answer alone could pass for the job's" % (failed.message, target, exc.message),
                               hint="retry in a moment (a loaded node's helper may be slow to answer); "
                                    "`probe list` shows the job's ranks on this host") from None
        size = said.get("world_size") if isinstance(said, dict) else None
        rank = said.get("rank") if isinstance(said, dict) else None
        if not (isinstance(size, int) and size > 1):
            return False
        if failed is not None:
            raise ConnectError("%s; the agent at %s is one rank of a job of %d, and its answer alone would not "
                               "speak for the job" % (failed.message, target, size),
                               hint="retry in a moment (a loaded node's helper may be slow to answer); "
                                    "`probe list` shows the job's ranks on this host")
        self.judged_alone = {"rank": rank if isinstance(rank, int) else None, "world_size": size, "why": why}
        return False

    def clients(self) -> List[Client]:
        import os

        targets = self.targets or ([os.environ["PROBE_TARGET"]] if os.environ.get("PROBE_TARGET") else [])
        if not targets:
            raise UsageError("no target given", hint="write `probe PID COMMAND`, `probe HOST:PORT COMMAND`, "
                                                     "use -t, or set PROBE_TARGET")
        pids = [int(t) for t in targets if t.isdigit()]
        if pids:  # this command looks at the runtime directory: clear what dead agents left there
            from probe._paths import remove_stale_files

            remove_stale_files(keep=pids)
        open_kinds(targets)
        return [connect(t, token=self.token, token_file=self.token_file,
                        timeout=self.timeout if self.timeout_given else None, wait=self.wait,
                        executable=self.executable) for t in targets]

    def _died_here(self) -> Optional[str]:
        """For the one HOST:PORT target that refused: a record of a job that died there, if one was kept."""
        from probe.client.targets import parse_target

        port = self.master_port()
        if port is None:
            return None
        from probe.cli.dead_job import died_here

        written = (self.targets or [os.environ.get("PROBE_TARGET", "")])[0]
        return died_here(parse_target(written).address.host, port)

    def record(self, exc: ProbeError, label: Optional[str] = None) -> None:
        """Report one target's error and remember the exit code; the other targets still run."""
        prefix = "probe: %s: " % label if label else "probe: "
        if isinstance(exc, ConnectionRefused) and not exc.hint and not label and len(self.targets) == 1:
            from probe.client.refused import where_to_ask

            exc.hint = self._died_here() or where_to_ask(self.targets[0], self.token, self.token_file)
        from probe._words import for_target

        message = exc.message + (" -- %s" % exc.hint if exc.hint else "")
        message = for_target(message, label or (self.targets[0] if len(self.targets) == 1 else None))
        say(prefix + "error: " + message, err=True)
        self.failures += 1
        self.exit_code = self.exit_code or exc.exit_code


def __getattr__(name: str) -> Any:
    """``pass_cli``, the click decorator that hands a command its ``CliContext``, made on first use: the
    commands ``probe.cli.fast`` runs import no click."""
    if name != "pass_cli":
        raise AttributeError("module %r has no attribute %r" % (__name__, name))
    import click

    decorator = click.make_pass_decorator(CliContext)
    globals()["pass_cli"] = decorator
    return decorator


def each_target(cli: CliContext, work: Callable[[Client], T]) -> Iterator[Tuple[Client, T]]:
    """Run ``work`` against the target, or against several at once; an error is reported and the others run.

    Across ranks (``cli.is_cluster``) every rank runs at once, the answers come in rank order, and the
    ranks that did not answer are named at the end (exit 7 when others answered)."""
    if cli.is_cluster:
        yield from _each_rank(cli, work)
        return
    clients = cli.clients()
    if len(clients) > 1:
        yield from _each_of_several(cli, clients, work)
        return
    try:
        result = work(clients[0])
    except ProbeError as exc:
        cli.record(exc)
        return
    if getattr(clients[0], "note", None):  # the answer did not come from the agent: say where from
        say("probe: " + str(clients[0].note), err=True)
    yield clients[0], result


def _each_of_several(cli: CliContext, clients: List[Client], work: Callable[[Client], T]) -> Iterator[Tuple[Client, T]]:
    """Several ``-t``: every target at once (``--max-in-flight``), each within its own timeout and the whole
    within ``--deadline`` when given; the answers in the order given, each failure named with its target,
    exit 7 when some answered and others did not."""
    from probe.client.fanout import fan_out

    outcomes = fan_out(clients, work, cli.max_in_flight,
                       cli.deadline if cli.deadline is not None else float("inf"))
    failed = 0
    for client, outcome in zip(clients, outcomes):
        if outcome.error is not None:
            cli.record(outcome.error, client.target.label)
            failed += 1
            continue
        if getattr(client, "note", None):
            say("probe: %s: %s" % (client.target.label, client.note), err=True)
        yield client, outcome.value
    if 0 < failed < len(clients):
        cli.exit_code = PARTIAL


def _each_rank(cli: CliContext, work: Callable[[Client], T]) -> Iterator[Tuple[Client, T]]:
    cluster = cli.cluster()
    answers = cluster.map(work)
    if cluster.progress is not None:
        cluster.progress(-1, 0, [])  # clear the line
    for answer in answers:
        cli._labels[id(answer.client)] = answer.member.label
        cli._members[id(answer.client)] = answer.member
        if answer.note:
            say("probe: %s: %s" % (answer.member.label, answer.note.splitlines()[0]), err=True)
        yield answer.client, answer.value
    report_failures(cli, cluster.failures, len(cluster.members))


def report_failures(cli: CliContext, failures: List[Any], total: int) -> None:
    """Name each rank that gave no result (silent, refused, failed), with why; exit 7 for a partial
    answer, else the error's code."""
    if not failures:
        return
    from probe.cli.render_cluster import ranks_word

    say("probe: %d of %d rank%s gave no result (%s):" % (
        len(failures), total, "" if total == 1 else "s", ranks_word([f.rank for f in failures])), err=True)
    for failure in failures:
        say("  rank %d (%s): %s" % (failure.rank, visible(str(failure.host)), failure.reason), err=True)
    cli.failures += len(failures)
    cli.exit_code = cli.exit_code or (PARTIAL if len(failures) < total else failures[0].exit_code)


def stopped_on_ranks(cluster: Any, kind: str, run_id: str) -> str:
    """After a Ctrl-C: ask every rank to stop the query or snippet ``run_id``; what became of it, in words,
    ranks grouped by outcome ("the query was stopped on ranks 0-6; it may run on until its time limit on
    rank 7 (why)")."""
    from probe.client.cluster import compact_ranks

    what = "query" if kind == "query" else "snippet"
    groups: Dict[str, List[int]] = {}
    for rank, state in sorted(cluster.interrupt(kind, run_id).items()):
        if state in ("interrupted", "cancelled"):
            said = "the %s was stopped" % what
        elif state == "finished":
            said = "the %s had ended" % what
        elif state == "stopping":
            said = "the %s was told to stop but is inside a call into C, and stops once it returns" % what
        elif state.startswith("unreachable: "):
            said = "it may run on until its time limit (%s)" % state[len("unreachable: "):]
        else:
            said = "the agent knows no such %s" % what
        groups.setdefault(said, []).append(rank)
    return "; ".join("%s on rank%s %s" % (said, "s" if len(ranks) > 1 else "", compact_ranks(ranks))
                     for said, ranks in groups.items())


def stop_where_unanswered(cluster: Any, kind: str, run_id: str) -> None:
    """The ranks that did not answer in time may still run the query or snippet: ask them to stop it
    (within a second: a rank that cannot answer cannot be stopped either), and add to each one's reason
    what became of it. The single-target commands do the same when they give up waiting."""
    waited = [f.rank for f in cluster.failures if f.code == "timeout" and "not asked" not in f.reason]
    if not waited:
        return
    what = "query" if kind == "query" else "snippet"
    states = cluster.interrupt(kind, run_id, deadline=1.0, ranks=waited)
    said = {"interrupted": "the %s was stopped there" % what, "cancelled": "the %s was stopped there" % what,
            "finished": "the %s had ended there" % what,
            "stopping": "the %s was told to stop there, and stops once the call into C it is in returns" % what}

    def told(reason: str, rank: int) -> str:
        message, dash, hint = reason.partition(" -- ")  # what became of it goes with the message, before the hint
        return message + "; " + said.get(states[rank], "it may run on there until its time limit") + dash + hint

    cluster.failures = [f._replace(reason=told(f.reason, f.rank)) if f.rank in states else f for f in cluster.failures]


PARTIAL = 7
HELPER_RETRY_S = 4.0  # how long a job's helper that hung up or timed out is asked again
"""Exit code of a command across ranks or several targets that some answered and others did not."""


def _read_hosts(path: str) -> List[str]:
    """Targets from a file, one per line; blank lines and ``#`` comments skipped."""
    try:
        with open(path) as handle:
            lines = [line.split("#", 1)[0].strip() for line in handle]
    except OSError as exc:
        raise UsageError("cannot read the hosts file %s: %s" % (path, exc.strerror or exc)) from None
    return [line for line in lines if line]
