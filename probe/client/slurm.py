"""``slurm:JOBID``: every rank of a Slurm job, found from a login node through Slurm itself.

    probe slurm:12345 ranks              # PROBE_PORT from the client's environment
    probe slurm:12345:9700 --all-ranks backtrace

Slurm says which nodes run the job (``scontrol show job -o JOBID``: ``JobState``, ``NodeList``) and how
to reach each (``scontrol show node -o NODELIST``: ``NodeAddr``); each node's helper (TCP on
``PROBE_PORT - 1``, the job's token) lists its ranks (``GET /v1/ranks``, checked as for ``HOST:PORT``
discovery), and the job's ranks are the union. A node whose helper does not answer is named, not
dropped: its ranks are unknown. The port is not something Slurm keeps (it is in the job's environment
only): ``slurm:JOBID:PORT``, else ``$PROBE_PORT`` where the client runs.
"""

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from probe.client.wording import option
from probe.errors import ConnectError, Forbidden, NotFound, ProbeError, Unauthorized, UsageError

__all__ = ["SlurmJob", "SlurmNode", "parse_slurm_target", "job", "list_job", "JobListing", "is_slurm_target"]

PREFIX = "slurm:"
SCONTROL_TIMEOUT_S = 20.0
_JOB_ID = re.compile(r"[0-9]+(?:_[0-9]+|\+[0-9]+)?")  # 12345, an array task 12345_7, a het component 12345+1
_FIELD = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/:]*)=(\S*)")


class SlurmNode(NamedTuple):
    name: str  # NodeName, as Slurm lists it
    address: str  # NodeAddr: where its node helper is reached (the name where Slurm gives no other)


class SlurmJob(NamedTuple):
    """What Slurm says of a job: its id, state (RUNNING, PENDING, ...), why it waits (``reason``), its
    node list as Slurm writes it (``node_list``) and each node (``nodes``)."""

    job_id: str
    state: str
    reason: Optional[str]
    node_list: str
    nodes: List[SlurmNode]

    def as_dict(self) -> Dict[str, Any]:
        return {"job_id": self.job_id, "state": self.state, "reason": self.reason, "node_list": self.node_list,
                "nodes": [n._asdict() for n in self.nodes]}


def is_slurm_target(text: str) -> bool:
    return text.strip().startswith(PREFIX)


def parse_slurm_target(text: str, environ: Optional[Dict[str, str]] = None) -> Tuple[str, int]:
    """``"slurm:12345"`` -> ("12345", $PROBE_PORT); ``"slurm:12345:9700"`` -> ("12345", 9700)."""
    env = os.environ if environ is None else environ
    rest = text.strip()[len(PREFIX):]
    job_id, _, port_text = rest.partition(":")
    if not _JOB_ID.fullmatch(job_id):
        raise UsageError("cannot read the Slurm job id in %r" % text,
                         hint="write slurm:JOBID or slurm:JOBID:PROBE_PORT, e.g. slurm:12345:9700 (squeue --me lists yours)")
    if port_text:
        port = _port(port_text)
        if port is None:
            raise UsageError("%r: %r is not a port" % (text, port_text), hint="write slurm:JOBID:PROBE_PORT, e.g. slurm:%s:9700"
                             % job_id)
        return job_id, port
    given = env.get("PROBE_PORT", "")
    port = _port(given.rpartition(":")[2]) if given else None  # PROBE_PORT may be HOST:PORT
    if port is None:
        raise UsageError("which port the job's ranks serve on is not known here: Slurm does not keep it, and "
                         + ("PROBE_PORT=%r is not a port" % given if given else "PROBE_PORT is not set"),
                         hint="write slurm:%s:PORT with the job's PROBE_PORT, or set PROBE_PORT as the job did" % job_id)
    return job_id, port


def _port(text: str) -> Optional[int]:
    if text.isascii() and text.isdigit() and len(text) <= 5 and 1 < int(text) < 65536:
        return int(text)  # 1 is no PROBE_PORT: its helper would listen on 0
    return None


def _scontrol(args: Sequence[str], timeout: float) -> str:
    """The output of ``scontrol ARGS``; a clear error where there is no scontrol or it fails."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        raise UsageError("slurm:JOBID needs Slurm's scontrol, and there is none on PATH",
                         hint="run probe on a login or compute node of the cluster, or give the master's HOST:PROBE_PORT")
    try:
        done = subprocess.run([scontrol, *args], capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ConnectError("scontrol %s gave no answer within %.0f s (is slurmctld reachable?)"
                           % (" ".join(args), timeout)) from None
    except OSError as exc:
        raise ConnectError("cannot run %s: %s" % (scontrol, exc.strerror or exc)) from None
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip() or "exit code %d" % done.returncode).splitlines()[-1][:300]
        raise _ScontrolFailed(said)
    return done.stdout


class _ScontrolFailed(Exception):
    """scontrol ran and failed: its last line."""


def job(job_id: str, timeout: float = SCONTROL_TIMEOUT_S) -> SlurmJob:
    """What Slurm says of job ``job_id``, its nodes with their addresses. Raises :class:`NotFound` where
    Slurm knows no such job (or no longer: a job ended minutes ago is forgotten)."""
    try:
        text = _scontrol(["show", "job", "-o", job_id], timeout)
    except _ScontrolFailed as exc:
        if "invalid job id" in str(exc).lower():
            raise NotFound("Slurm knows no job %s (scontrol: %s)" % (job_id, exc),
                           hint="squeue --me lists your jobs; a job that ended a while ago is no longer known") from None
        raise ConnectError("scontrol show job %s failed: %s" % (job_id, exc)) from None
    records = [dict(_FIELD.findall(line)) for line in text.splitlines() if "JobId=" in line]
    if not records:
        raise NotFound("Slurm knows no job %s (scontrol printed no job)" % job_id)
    # A heterogeneous job or an array lists a record per component: the job runs where any of them runs.
    states = [r.get("JobState", "UNKNOWN") for r in records]
    running = [r for r in records if r.get("JobState") == "RUNNING"]
    state = "RUNNING" if running else states[0]
    reason = next((r["Reason"] for r in records if r.get("Reason") not in (None, "None", "(null)")), None)
    node_list = ",".join(r["NodeList"] for r in running if r.get("NodeList") not in (None, "", "(null)"))
    nodes = _nodes(node_list, timeout) if node_list else []
    return SlurmJob(job_id, state, reason, node_list, nodes)


def _nodes(node_list: str, timeout: float) -> List[SlurmNode]:
    """Each node of ``node_list`` ("gpu[01-04],cpu7") with its NodeAddr, in Slurm's order."""
    names = _scontrol(["show", "hostnames", node_list], timeout).split()
    addresses: Dict[str, str] = {}
    try:
        for line in _scontrol(["show", "node", "-o", node_list], timeout).splitlines():
            fields = dict(_FIELD.findall(line))
            if fields.get("NodeName"):
                addresses[fields["NodeName"]] = fields.get("NodeAddr") or fields["NodeName"]
    except _ScontrolFailed:
        pass  # the names alone, then: a node is reached by its name
    seen, nodes = set(), []
    for name in names:
        if name not in seen:
            seen.add(name)
            nodes.append(SlurmNode(name, addresses.get(name, name)))
    return nodes


def running_job(job_id: str, timeout: float = SCONTROL_TIMEOUT_S) -> SlurmJob:
    """:func:`job`, or an error that says why a job that is not running has no ranks to reach."""
    found = job(job_id, timeout)
    if found.state == "RUNNING" and found.nodes:
        return found
    why = " (%s)" % found.reason if found.reason else ""
    if found.state in ("PENDING", "CONFIGURING", "REQUEUED", "RESIZING"):
        raise ProbeError("Slurm job %s is %s%s: it runs on no node yet" % (job_id, found.state.lower(), why),
                         hint="wait until squeue -j %s shows it running (R), then ask again" % job_id)
    if found.state == "SUSPENDED":
        raise ProbeError("Slurm job %s is suspended%s: its ranks are stopped" % (job_id, why),
                         hint="scontrol resume %s, then ask again" % job_id)
    raise ProbeError("Slurm job %s is %s%s: it runs no rank" % (job_id, found.state.lower(), why),
                     hint="what it left: its output files; a rank's crash record: probe list --all on its node")


class JobListing(NamedTuple):
    """Every rank of a Slurm job as its nodes' helpers list them, and what a cluster of them needs."""

    members: List[Any]  # probe.client.members.Member, by rank
    secret: Optional[str]
    token_file: Optional[str]
    left_out: List[str]
    job: "SlurmJob"


def list_job(target: str, token: Optional[str] = None, token_file: Optional[str] = None,
             timeout: float = 30.0, deadline: float = 10.0, max_in_flight: int = 32) -> JobListing:
    """Every rank of the Slurm job ``slurm:JOBID[:PORT]``, for :func:`probe.client.cluster.connect_all`:
    the union of what each of its nodes' helpers lists. ``left_out`` names each node whose helper did
    not answer (its ranks are unknown); where none answered, the error names them all. The cluster's
    ``slurm`` is the :class:`SlurmJob`."""
    from probe.client import listing
    from probe.client.connection import read_token as _read_token
    from probe.client.members import _with_port

    job_id, port = parse_slurm_target(target)
    found = running_job(job_id, min(SCONTROL_TIMEOUT_S, max(timeout, 1.0)))
    secret = _read_token(token, token_file) or listing.job_token(port)  # on a node of the job: its token file

    def ask(node: SlurmNode) -> Any:
        try:
            return listing.discover(_with_port(node.address, port), secret, min(timeout, deadline))
        except ProbeError as exc:
            return exc

    workers = max(1, min(len(found.nodes), max_in_flight, 64))
    with ThreadPoolExecutor(workers) as pool:
        answers = list(pool.map(ask, found.nodes))
    members: Dict[int, Any] = {}
    left_out: List[str] = []
    silent: List[Tuple[SlurmNode, ProbeError]] = []
    token_files = []
    for node, answer in zip(found.nodes, answers):
        if isinstance(answer, ProbeError):
            silent.append((node, answer))
            continue
        left_out.extend(answer.left_out)
        if answer.token_file:
            token_files.append(answer.token_file)
        for member in answer.members:
            known = members.get(member.rank)
            if known is None or (known.host != node.name and member.host in (node.name, node.address)):
                members[member.rank] = member  # a node's own helper knows its ranks first-hand
    for node, exc in silent:
        left_out.append("Slurm job %s runs on node %s, whose node helper at %s did not answer: %s; its ranks "
                        "are not listed" % (job_id, _node_label(node), _with_port(node.address, port - 1),
                                            _one_line(exc)))
    if not members:
        if silent and len(silent) == len(found.nodes):
            raise _none_answered(job_id, port, silent)
        raise ProbeError("the node helpers of Slurm job %s know no rank yet (the job is starting?)" % job_id,
                         hint="retry in a moment")
    return JobListing([members[r] for r in sorted(members)], secret, token_files[0] if token_files else None,
                      left_out, found)


def _none_answered(job_id: str, port: int, silent: List[Tuple[SlurmNode, ProbeError]]) -> ProbeError:
    """The error where no node helper of the job answered: of the kind every node's was where they agree
    (a token refused everywhere is exit 4, not "nothing there"), naming the nodes and why."""
    shown = "; ".join("%s: %s" % (_node_label(n), _one_line(e)) for n, e in silent[:5])
    more = " and %d more" % (len(silent) - 5) if len(silent) > 5 else ""
    kinds = {type(e) for _, e in silent}
    kind = kinds.pop() if len(kinds) == 1 else ConnectError
    hint: Optional[str]
    if issubclass(kind, (Unauthorized, Forbidden)):
        hint = ("give the job's token: %s (PROBE_TOKEN_FILE, on a shared file system, as the job had it) or "
                "PROBE_TOKEN" % option("--token-file FILE", "token_file="))
        what = "refused this client"
    elif issubclass(kind, ConnectError):
        hint = ("was the job started with PROBE=1 PROBE_PORT=%d (srun passes the environment on, --export=ALL)? "
                "Is %d its PROBE_PORT? The ranks need a moment to start" % (port, port))
        what = "answered"
    else:
        hint = silent[0][1].hint
        what = "answered"
    return kind("no node helper of Slurm job %s %s on port %d (%s%s)" % (job_id, what, port - 1, shown, more),
                hint=hint)


def _node_label(node: SlurmNode) -> str:
    return node.name if node.address == node.name else "%s (%s)" % (node.name, node.address)


def _one_line(exc: ProbeError) -> str:
    return exc.message.splitlines()[0][:300] if exc.message else exc.code
