"""The host helper's server: who the node's ranks are, and what a rank that cannot answer is doing.

One per node and job (``PROBE_PORT``), in one of two homes: a process of its own (``python -m
probe.host``, see ``probe.host.node``), started by the first rank of the node that finds none, under any
launcher; or, under torchrun, threads of torchrun's launcher process (started by the ``.pth`` hook),
which also finds the ranks among its children. Either way it serves on the agent's own small HTTP server:
TCP on ``PROBE_PORT - 1`` (token required, the job's token) and unix sockets beside the agents' (owner
only, peer uid checked): ``node-PORT.sock``, where the ranks find it, and ``host-PID.sock``, by which
``probe list`` knows it. It reads a rank from outside only when a client asks about one, and only its own
ranks. Nothing here may block or crash a launcher: every failure is written to stderr once.

    GET  /v1/health            who the helper is
    GET  /v1/ranks             every rank of the job (on the master node; elsewhere this node's)
    GET  /v1/outside/PID       a rank's state read from outside, with its stacks when it cannot answer
    POST /v1/register          (unix) a rank of this node says who it is and where it serves
    POST /v1/nodes             (master) another node's helper reports its ranks
    GET  /v1/stack_history     the ranks' sampled stacks of the last hour (``probe.host.history``)

A node report comes from a token holder, who may be buggy or hostile: every field is checked (types,
ranges, ``helper`` a HOST:PORT), what is kept is bounded as a whole (``MAX_NODES`` nodes, at most
``MAX_MEMBERS`` ranks each and ``MAX_RANKS`` in all, or the job's world size where this node knows it,
packed at 8 bytes a field), reports are taken one at a time, and a node that stops reporting is
forgotten ``PROBE_HELPER_FORGET_S`` seconds (default 300) after its last report; until then it is listed
as ``unreported`` once its report is older than ``NODE_STALE_S``.
"""

import json
import math
import os
import re
import threading
import time
from array import array
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from probe import _paths
from probe.agent.http import Request, Response
from probe.errors import BadRequest, Forbidden, NotFound, ProbeError
from probe.host.members import Members, node_host
from probe._stderr import say as _say

__all__ = ["Helper", "helper_port", "start_in_launcher", "job_token", "REPORT_EVERY_S"]

REPORT_EVERY_S = 1.0
NODE_STALE_S = 5.0
FORGET_AFTER_S = 300.0  # a node that has not reported for this long is dropped ($PROBE_HELPER_FORGET_S)
MAX_NODES = 4096
MAX_MEMBERS = 1024  # ranks of one node
MAX_RANKS = 1 << 17  # ranks of all the other nodes together, where the world size is not known here
MAX_PID = 1 << 22  # the kernel's PID_MAX_LIMIT
MAX_NOTES = 64  # members of one report whose note (their port was taken: by whom) is kept
RANKS_CACHE_S = 0.5  # a member list made this recently serves the next request too, while one is being sent

_STATES = ("running", "silent", "stopped", "starting", "dead")  # what a node says of its ranks
_HOST = re.compile(r"^[A-Za-z0-9._:%\[\]-]{1,253}$")  # a host name or address (IPv6 with or without [])
_FIELDS = ("rank", "local_rank", "port", "pid", "restarts", "state", "age_ms")  # one packed member
_POSITIONS = 4096  # ranks of one source (node) that a sort key can tell apart: 12 bits; the sources (this
# node and MAX_NODES others) take 13 bits above them, the rank the rest (see _write_members)


class _SharedBody:
    """A member list being sent to ``users`` requests at once."""

    def __init__(self, made: float, body: bytearray) -> None:
        self.made = made
        self.body = body
        self.users = 0


class _Report(NamedTuple):
    """What is kept of one node's report: checked, and packed (``_FIELDS`` per member, 8 bytes each)."""

    heard: float  # time.monotonic() when it came
    host: str
    helper: str
    world_size: int
    packed: "array[int]"
    notes: Dict[int, str]  # rank -> why it serves off its port (``port 9701 taken by uid N; ...``), a few at most

    @property
    def count(self) -> int:
        return len(self.packed) // len(_FIELDS)


def helper_port(probe_port: int) -> int:
    """The helper's TCP port: ``$PROBE_HELPER_PORT``, else the one below the ranks' first."""
    explicit = os.environ.get("PROBE_HELPER_PORT", "")
    return int(explicit) if explicit.isdigit() else probe_port - 1


class Helper:
    """The node's helper: its ranks, other nodes' reports (on the master), and outside reads."""

    def __init__(self, base_port: int, token: str, token_file: Optional[str], kind: str = "launcher") -> None:
        self.base_port = base_port
        self.port = helper_port(base_port)
        self.token_file = token_file
        self.kind = kind  # "launcher" (threads of torchrun's launcher) or "node" (a process of its own)
        self.members = Members(base_port, children=kind == "launcher")
        self.tcp_address: Optional[str] = None
        self.tcp_error = ""
        self._token = token.encode("utf-8")
        self._nodes: Dict[int, _Report] = {}  # the other nodes' last reports
        self._nodes_lock = threading.Lock()
        self._report_lock = threading.Lock()  # one report parsed at a time: its JSON costs far more than its bytes
        self._ranks_lock = threading.Lock()
        self._ranks_shared: Optional[_SharedBody] = None  # the member list being sent now, to share
        self._forget_after = _seconds(os.environ.get("PROBE_HELPER_FORGET_S"), FORGET_AFTER_S)
        self._listeners: List[Any] = []
        self._complained = False  # a failed report to the master is said once

    # -- serving ----------------------------------------------------------------------------------

    def serve(self, host: str) -> None:
        """Listen on the unix sockets and TCP (where the port is free) and start serving, in daemon threads."""
        from probe.agent.listener import Listener, keep_stdio_open

        keep_stdio_open()  # a launcher started with 0-2 closed must not get our sockets as its stdio
        _paths.ensure_runtime_dir()
        if not self.listen_tcp(host):  # first: whoever sees the unix sockets may count on TCP being there too
            _say("probe: the host helper serves no TCP on %s:%d (%s); clients elsewhere cannot list this "
                 "node's ranks%s" % (host, self.port, self.tcp_error, "" if self.kind == "launcher" else
                                     " until it is free (tried again every second)"))
        unix_paths = [_paths.helper_socket_path(os.getpid())]
        node_path = _paths.node_socket_path(self.base_port)
        if _paths.socket_state(node_path) not in ("listening", "unknown"):  # else a node helper of this job serves
            try:
                os.unlink(node_path)
            except OSError:
                pass
            unix_paths.append(node_path)
        for unix_path in unix_paths:
            self._listeners.append(Listener.unix(unix_path, self))
        for listener in self._listeners:
            if listener.transport == "unix":
                listener.start()
        import atexit

        atexit.register(self.stop, unix_paths)
        from probe.host import metrics

        metrics.start(self, host)  # PROBE_METRICS_PORT: Prometheus's /metrics of this node (docs/metrics.md)

    def listen_tcp(self, host: str) -> bool:
        """Serve TCP on the helper's port (``tcp_address``) where it is free; False and ``tcp_error`` where
        not (another job's helper, or this job's previous one still lingering)."""
        from probe.agent.listener import Listener

        try:
            # TLS where PROBE_TLS_CERT says so, as the ranks' agents; a plain one keeps a connection for the
            # client's next request (a node's gather after its hello, the next look's): probe.agent.listener
            tcp = Listener.tcp(host, self.port, self, keep_alive=True)
        except OSError as exc:
            self.tcp_error = exc.strerror or str(exc)
            return False
        except ProbeError as exc:  # a TLS certificate that cannot be used: no TCP rather than plain TCP
            self.tcp_error = str(exc)
            return False
        self._listeners.append(tcp)
        tcp.start()
        self.tcp_address = "%s:%d" % (host, tcp.port)
        return True

    def stop(self, unix_paths: List[str]) -> None:
        for listener in self._listeners:
            listener.close()
        for unix_path in unix_paths:
            try:
                os.unlink(unix_path)
            except OSError:
                pass

    def __call__(self, request: Request) -> Response:
        try:
            if request.path == "/v1/hello" and request.method == "GET" and request.transport == "tcp":
                return Response.json(self._credentials().hello(request))  # no token: it proves it has one
            self._authorize(request)
            return self._route(request)
        except ProbeError as exc:
            return Response.error(exc)
        except Exception as exc:  # a bug of ours: say so, keep serving
            return Response.error(ProbeError("host helper error: %s: %s" % (type(exc).__name__, exc)))

    def _authorize(self, request: Request) -> None:
        """The job's tokens with their scopes (``probe.agent.scopes``), as the ranks take them: the full
        token, and the read and control tokens of this process's environment; the unix peer (checked by the
        listener) has every scope. Every route the helper serves is a read but a node's report (full token)."""
        from probe.agent.scopes import HELPER_ROUTES, check

        if request.transport == "unix":
            return  # the listener checked the peer's uid
        credentials = self._credentials()
        request.grant, _ = check(credentials, HELPER_ROUTES, request, request.json, "the host helper")

    def _credentials(self) -> Any:
        """The tokens TCP takes (``probe.agent.scopes.Credentials``), made at the first TCP request."""
        from probe.agent.scopes import helper_credentials

        credentials = self.__dict__.get("_tcp_credentials")
        if credentials is None:
            credentials = self.__dict__["_tcp_credentials"] = helper_credentials(self._token, self.token_file)
        return credentials

    def _route(self, request: Request) -> Response:
        path = request.path.split("?", 1)[0]
        if request.method == "GET" and path == "/v1/health":
            return Response.json(self._identity(request.transport == "unix"))
        if request.method == "GET" and path == "/v1/ranks":
            if request.transport == "unix":  # the owner's: with the token file's path, made for it alone
                return Response(200, self._ranks_body(True))
            return self._ranks_response()
        if request.method == "GET" and path.startswith("/v1/outside/"):
            return Response.json(self.outside(path[len("/v1/outside/"):]))
        if request.method == "POST" and path == "/v1/register":
            if request.transport != "unix":
                raise Forbidden("a rank registers over its node's unix socket, not TCP")
            self._take_registration(request.json())
            return Response.json({"ok": True, "helper_pid": os.getpid()})
        if request.method == "POST" and path == "/v1/nodes":
            with self._report_lock:
                self._take_report(request.json())
            return Response.json({"ok": True})
        if request.method == "POST" and path == "/v1/gather":  # this node's ranks asked at once: probe.host.gather
            from probe.host.gather import gather

            return gather(self, request)
        if request.method == "GET" and path == "/v1/stack_history":  # cluster.stack_history: probe.host.history
            from probe.host import history
            return Response.json(history.answer(self, request.path))
        raise NotFound("no such endpoint on the host helper: %s %s" % (request.method, path[:200]))

    def _identity(self, owner: bool = False) -> Dict[str, Any]:
        """Who this helper is; ``owner`` (the unix socket's peer) also learns where the job's token is kept:
        a TCP caller holds a token already, maybe a weaker one, and is not told the full one's file."""
        return {"helper": True, "kind": self.kind, "pid": os.getpid(), "host": node_host(), "node": self.members.node_key(),
                "probe_port": self.base_port, "helper_port": self.port,
                "token_file": self.token_file if owner else None}

    # -- members ----------------------------------------------------------------------------------

    def local_members(self) -> List[Dict[str, Any]]:
        helper = "%s:%d" % (node_host(), self.port)
        return [dict(m.to_json(), helper=helper) for m in self.members.scan()]

    def all_members(self) -> List[Dict[str, Any]]:
        """This node's ranks and those the other nodes reported, in rank order (``GET /v1/ranks``'s)."""
        body = bytearray()
        self._write_members(body)
        return json.loads(body)

    def _write_members(self, out: bytearray) -> None:
        """Append the JSON list of every rank, in rank order: this node's, then for each other rank the
        newest report that names it (marked ``unreported`` when that report is old).

        Written straight from the packed reports, with no dict, list or set per rank: at ``MAX_RANKS``
        ranks those would cost the launcher a hundred megabytes for a moment. The order comes from one
        sorted list of integers: rank, then where it came from (this node first, then the newest report).
        """
        mine = self.local_members()[:_POSITIONS]
        local = [json.dumps(m) for m in mine]
        now = time.monotonic()
        with self._nodes_lock:
            self._forget_old(now)
            reports = sorted(self._nodes.items(), key=lambda item: -item[1].heard)
        width = len(_FIELDS)
        keys = [(m["rank"] << 25) | i for i, m in enumerate(mine)]  # source 0: this node; position i
        for source, (_, report) in enumerate(reports, 1):
            packed = report.packed
            keys.extend((packed[at] << 25) | (source << 12) | (at // width) for at in range(0, len(packed), width))
        keys.sort()
        heads = [(json.dumps(r.host), json.dumps(r.helper), now - r.heard > NODE_STALE_S) for _, r in reports]
        out += b"["
        last = -1
        for key in keys:
            rank, source, at = key >> 25, (key >> 12) & 0x1FFF, (key & 0xFFF) * width
            if rank == last:
                continue  # named by a newer source already
            if last >= 0:
                out += b", "
            last = rank
            if source == 0:
                out += local[at // width].encode("utf-8")
                continue
            node, report = reports[source - 1]
            host, helper, stale = heads[source - 1]
            _, local_rank, port, pid, restarts, state, age_ms = report.packed[at:at + width]
            out += ('{"rank": %d, "local_rank": %s, "world_size": %d, "node": %d, "host": %s, "port": %d, '
                    '"pid": %d, "state": "%s", "restarts": %d, "heartbeat_age": %s, "helper": %s}' % (
                        rank, "null" if local_rank < 0 else local_rank, report.world_size, node, host, port, pid,
                        "unreported" if stale else _STATES[state], restarts,
                        "null" if age_ms < 0 else "%.2f" % (age_ms / 1000.0), helper)).encode("utf-8")
            if rank in report.notes:
                out[-1:] = (', "note": %s}' % json.dumps(report.notes[rank])).encode("utf-8")
        out += b"]"

    def _ranks_response(self) -> Response:
        """``GET /v1/ranks``: made one at a time, and shared by the requests that come while it is being
        sent (within ``RANKS_CACHE_S`` of its making): many clients at once hold one body, not one each.
        Once the last of them is sent it is dropped: an idle launcher keeps no member list."""
        with self._ranks_lock:
            shared = self._ranks_shared
            if shared is None or time.monotonic() - shared.made >= RANKS_CACHE_S:
                self._ranks_shared = shared = None  # the old one goes with its last request
                shared = _SharedBody(time.monotonic(), self._ranks_body(False))
                self._ranks_shared = shared
            shared.users += 1

        def sent() -> None:
            with self._ranks_lock:
                shared.users -= 1
                if shared.users <= 0 and self._ranks_shared is shared:
                    self._ranks_shared = None

        return Response(200, shared.body, on_sent=sent)

    def _ranks_body(self, owner: bool) -> bytearray:
        body = bytearray(json.dumps(dict(self._identity(owner), nodes=self._node_list())).encode("utf-8"))
        body[-1:] = b', "members": '
        self._write_members(body)
        body += b"}"
        return body

    def _node_list(self) -> List[Dict[str, Any]]:
        now = time.monotonic()
        with self._nodes_lock:
            return [{"node": n, "host": r.host, "helper": r.helper, "ranks": r.count,
                     "report_age": round(now - r.heard, 2)} for n, r in sorted(self._nodes.items())]

    def _forget_old(self, now: float) -> None:
        """Drop the reports of nodes that stopped reporting (called with ``_nodes_lock`` held)."""
        for node in [n for n, r in self._nodes.items() if now - r.heard > self._forget_after]:
            del self._nodes[node]

    def _take_report(self, body: Dict[str, Any]) -> None:
        """Check a node's report field by field, and keep it packed within the bounds; refuse it whole
        (400: malformed, 403: over a bound) with what is wrong."""
        world = self.members.world_size()
        bound = min(world, MAX_RANKS) if world else MAX_RANKS
        node = _int_in(body, "node", 1, bound - 1, "a node report")  # a node number, or its lowest rank (mpirun)
        host = _host(body.get("host"), "the report's host")
        helper = _host_port(body.get("helper"), "the report's helper")
        members = body.get("members")
        if not isinstance(members, list) or len(members) > MAX_MEMBERS:
            raise BadRequest("a node report's members are a list of at most %d ranks" % MAX_MEMBERS,
                             hint=_REPORT_SHAPE)
        world_size = world or 0
        packed = array("q")
        for i, member in enumerate(members):
            what = "member %d of node %d's report" % (i, node)
            if not isinstance(member, dict):
                raise BadRequest("%s is not an object" % what, hint=_REPORT_SHAPE)
            size = _int_in(member, "world_size", 1, (1 << 31) - 1, what)
            if world_size and size != world_size:
                raise BadRequest("%s has world size %d; the job's is %d" % (what, size, world_size))
            world_size = size
            for key, expected in (("node", node), ("host", host), ("helper", helper)):
                if key in member and member[key] != expected:
                    raise BadRequest("%s has %s %s, not its report's %s" % (what, key, _shown(member[key]),
                                                                             _shown(expected)))
            state = member.get("state")
            if state not in _STATES:
                raise BadRequest("%s has state %s, not one of %s" % (what, _shown(state), ", ".join(_STATES)))
            age = member.get("heartbeat_age")
            if age is not None and not (isinstance(age, (int, float)) and not isinstance(age, bool)
                                        and math.isfinite(age) and 0 <= age < 1e9):
                raise BadRequest("%s has heartbeat_age %s, not null or seconds" % (what, _shown(age)))
            packed.extend((_int_in(member, "rank", 0, size - 1, what),
                           -1 if member.get("local_rank") is None else _int_in(member, "local_rank", 0,
                                                                               MAX_MEMBERS - 1, what),
                           _int_in(member, "port", 1, 65535, what), _int_in(member, "pid", 1, MAX_PID, what),
                           _int_in(member, "restarts", 0, (1 << 31) - 1, what), _STATES.index(state),
                           -1 if age is None else int(age * 1000)))
        if len(packed) // len(_FIELDS) != len({packed[i] for i in range(0, len(packed), len(_FIELDS))}):
            raise BadRequest("node %d's report names a rank twice" % node)
        notes: Dict[int, str] = {}
        for member in members:  # checked above; a note is words for a person: short and printable, or dropped
            note = member.get("note")
            if isinstance(note, str) and len(note) <= 300 and note.isprintable() and len(notes) < MAX_NOTES:
                notes[member["rank"]] = note
        report = _Report(time.monotonic(), host, helper, world_size, packed, notes)
        with self._nodes_lock:
            self._forget_old(report.heard)
            others = [r for n, r in self._nodes.items() if n != node]
            if len(others) >= MAX_NODES:
                raise Forbidden("this host helper keeps the reports of at most %d nodes" % MAX_NODES)
            held = sum(r.count for r in others)
            if held + report.count > bound:
                raise Forbidden("this host helper already keeps %d ranks of other nodes; node %d's %d more would "
                                "pass the bound of %d (%s)" % (held, node, report.count, bound,
                                                               "the job's world size" if bound == world else
                                                               "MAX_RANKS of probe.host.helper"))
            self._nodes[node] = report
        self._ranks_shared = None  # the next member list has this report

    def _take_registration(self, body: Dict[str, Any]) -> None:
        """A rank of this node says who it is (``probe.agent.registration``): checked, then remembered. Only a
        live process of this helper's user may be registered: the helper reads it from outside later."""
        what = "a registration"
        pid = _int_in(body, "pid", 1, MAX_PID, what)
        try:
            owner = os.stat("/proc/%d" % pid).st_uid
        except OSError:
            raise BadRequest("process %d does not exist" % pid)
        if owner != os.getuid():
            raise Forbidden("process %d is not this helper's user's" % pid)
        world = body.get("world_size")
        world_size = None if world is None else _int_in(body, "world_size", 1, (1 << 31) - 1, what)
        optional = {key: None if body.get(key) is None else _int_in(body, key, low, high, what)
                    for key, low, high in (("local_rank", 0, MAX_MEMBERS - 1), ("node", 0, MAX_NODES - 1),
                                           ("port", 1, 65535))}
        if body.get("rank") is None:  # a process of the job that knows no rank yet
            self.members.candidate(pid, optional["port"], optional["local_rank"])
            return
        rank = _int_in(body, "rank", 0, (world_size or (1 << 31)) - 1, what)
        restarts = _int_in(body, "restarts", 0, (1 << 31) - 1, what) if body.get("restarts") is not None else 0
        master = body.get("master_addr")
        master_addr = None if master is None else _host(master, "a registration's master_addr")
        source = body.get("source")
        if not isinstance(source, str) or not re.fullmatch(r"[a-z._]{1,40}", source):
            raise BadRequest("a registration's source must be a word such as torchrun, not %s" % _shown(source))
        self.members.register(pid, rank, optional["local_rank"], world_size, optional["node"], optional["port"],
                              restarts, master_addr, source)
        self._ranks_shared = None  # the next member list has it

    # -- reading a rank from outside --------------------------------------------------------------

    def outside(self, pid_text: str) -> Dict[str, Any]:
        """A rank's state from outside: dead (how), stopped, a GIL held in C, or running."""
        if not pid_text.isdigit() or not self.members.pid_of(int(pid_text)):
            raise Forbidden("process %s is not a rank of this node" % pid_text[:20],
                            hint="the host helper reads only the ranks its launcher started")
        pid = int(pid_text)
        from probe.reader import proc
        from probe.reader.wire import stacks_to_json

        if proc.state(pid) in (None, "Z", "X"):
            return _dead(pid)
        from probe.client.outside import diagnose_now

        diagnosis = diagnose_now(pid, _paths.socket_path(pid))
        out: Dict[str, Any] = {"state": diagnosis.state, "message": diagnosis.message, "hint": diagnosis.hint}
        if diagnosis.stacks is not None and diagnosis.state != "running":
            out["stacks"] = stacks_to_json(diagnosis.stacks)
        return out

    # -- reporting to the master ------------------------------------------------------------------

    def report_forever(self) -> None:
        """On a node other than the master: send this node's ranks to the master's helper every second."""
        while True:
            time.sleep(REPORT_EVERY_S)
            self.report_once()

    def report_once(self) -> None:
        """Send this node's ranks to the master's helper, where this is not the master's node (the node of
        rank 0, or node 0) and the master's address is known (``MASTER_ADDR`` of the ranks); never raises."""
        from probe.client import transport

        try:
            members = [m for m in self.local_members() if m["port"] is not None]
            master = self.members.master_addr
            node = self.members.node_key()
            if not members or node in (None, 0) or not master:
                return
            body = json.dumps({"node": node, "host": node_host(), "members": members,
                               "helper": "%s:%d" % (node_host(), self.port)}).encode("utf-8")
            address = transport.TcpAddress(master, int(os.environ.get("PROBE_MASTER_HELPER_PORT") or self.port))
            answer = transport.request(address, "POST", "/v1/nodes", body, None, 2.0,
                                       token=self._token.decode("utf-8"))
            if answer.status >= 400 and not self._complained:
                self._complained = True
                if answer.status == 401:
                    why = "give every node the same PROBE_TOKEN"
                else:
                    try:
                        why = str(json.loads(bytes(answer.body))["error"]["message"])[:300]
                    except (ValueError, KeyError, TypeError):
                        why = "no reason given"
                _say("probe: the master's host helper at %s refused this node's report (HTTP %d): %s"
                     % (address, answer.status, why))
        except Exception as exc:
            if not self._complained:
                self._complained = True
                same = "; give every node the same PROBE_TOKEN" if getattr(exc, "code", "") == "unauthorized" else ""
                _say("probe: cannot report this node's ranks to the master's host helper: %s%s" % (exc, same))


_REPORT_SHAPE = ('{"node": N, "host": H, "helper": "H:PORT", "members": [{"rank", "local_rank", "world_size", '
                 '"port", "pid", "state", "restarts", "heartbeat_age"}, ...]}')


def _shown(value: Any) -> str:
    """A value a client sent, short enough to quote in an error."""
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 64 else "an integer of %d bits" % (
        value.bit_length())
    return text if len(text) <= 60 else text[:57] + "..."


def _int_in(raw: Dict[str, Any], key: str, low: int, high: int, what: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise BadRequest("%s: %s must be an integer from %d to %d, not %s" % (what, key, low, high, _shown(value)),
                         hint=_REPORT_SHAPE)
    return value


def _host(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _HOST.match(value):
        raise BadRequest("%s must be a host name or address, not %s" % (what, _shown(value)), hint=_REPORT_SHAPE)
    return value


def _host_port(value: Any, what: str) -> str:
    """``HOST:PORT`` (the host may be an IPv6 address, bracketed or not), port 1-65535."""
    if isinstance(value, str):
        host, sep, port = value.rpartition(":")
        if sep and _HOST.match(host) and port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536:
            return value
    raise BadRequest("%s must be HOST:PORT, not %s" % (what, _shown(value)), hint=_REPORT_SHAPE)


def _seconds(raw: Optional[str], default: float) -> float:
    try:
        value = float(raw) if raw else default
    except ValueError:
        return default
    return value if math.isfinite(value) and value > 0 else default


def _dead(pid: int) -> Dict[str, Any]:
    """A rank that exited: how (the exit status its parent has not reaped yet, or its crash record)."""
    from probe.reader import crash
    from probe.reader.wire import stacks_to_json

    how = _exit_status(pid)
    record = crash.dead_record(pid)
    cause = how or (record.cause if record is not None else "")
    out: Dict[str, Any] = {"state": "dead", "message": "process %d exited%s" % (pid, ": " + cause if cause else "")}
    if record is not None and record.has_stacks:
        out["stacks"] = stacks_to_json(record.stacks())
        out["hint"] = "its last stacks are from its crash record"
    return out


def _exit_status(pid: int) -> str:
    """``killed by signal 9`` / ``exit code 1`` for a zombie, from /proc/PID/stat's exit_code field."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as handle:
            stat = handle.read()
        status = int(stat[stat.rindex(b")") + 2:].split()[49])
    except (OSError, ValueError, IndexError):
        return ""
    if status & 0x7F:
        return "killed by signal %d" % (status & 0x7F)
    return "exit code %d" % (status >> 8)


def job_token(base_port: int) -> Tuple[str, Optional[str]]:
    """The job's token: ``$PROBE_TOKEN``, or the token file the ranks of this node share."""
    if os.environ.get("PROBE_TOKEN"):
        return os.environ["PROBE_TOKEN"], None
    from probe.agent.agent import _token_from_file

    path = os.environ.get("PROBE_TOKEN_FILE") or _paths.job_token_path(base_port)
    _paths.ensure_runtime_dir()
    return _token_from_file(path), path


def start_in_launcher(probe_port: str) -> None:
    """From the start-up hook in torchrun's launcher: the helper in daemon threads; never raises."""
    from probe.host import exits

    exits.observe_launcher()  # its ranks' exit codes, from its own log records, for the records of deaths
    def run() -> None:
        try:
            from probe.agent.options import binds_every_interface, probe_port_binding

            host, base = probe_port_binding(dict(os.environ, PROBE_PORT=probe_port))
            token, token_file = job_token(base)
            helper = Helper(base, token, token_file)
            helper.serve(host)
            from probe.host import watch

            watch.start(helper)  # the stall watch (PROBE_SNAPSHOT=0: none)
            from probe.host import history
            history.start(helper)  # where each rank has been (PROBE_STACK_EVERY=0: nowhere)
            if binds_every_interface(host) and helper.tcp_address:
                _say("probe: the host helper serves TCP on every interface (%s; token required)" % helper.tcp_address)
            if token_file:
                _say("probe: host helper on %s; the job's token is in %s" % (helper.tcp_address, token_file))
            helper.report_forever()
        except BaseException as exc:
            message = getattr(exc, "message", None) or "%s: %s" % (type(exc).__name__, exc)
            _say("probe: no host helper in process %d: %s" % (os.getpid(), message))

    try:
        threading.Thread(target=run, name="probe-host", daemon=True).start()
    except BaseException as exc:
        _say("probe: no host helper: %s" % exc)
