"""The host helper's server: who the node's ranks are, and what a rank that cannot answer is doing.

Runs in torchrun's launcher process (started by the ``.pth`` hook when ``PROBE_PORT`` is set), in
daemon threads only, on the agent's own small HTTP server: TCP on ``PROBE_PORT - 1`` (token required,
the job's token) and a unix socket beside the agents' (owner only, peer uid checked). It reads ranks
from outside only when a client asks about one, and only its own children. Nothing here may block or
crash the launcher: every failure is written to stderr once and the launcher goes on.

    GET  /v1/health            who the helper is
    GET  /v1/ranks             every rank of the job (on the master node; elsewhere this node's)
    GET  /v1/outside/PID       a rank's state read from outside, with its stacks when it cannot answer
    POST /v1/nodes             (master) another node's helper reports its ranks
"""

import hmac
import json
import os
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from probe import _paths
from probe.agent.http import Request, Response
from probe.errors import BadRequest, Forbidden, NotFound, ProbeError, Unauthorized
from probe.host.members import Members, node_host

__all__ = ["Helper", "helper_port", "start_in_launcher", "REPORT_EVERY_S"]

REPORT_EVERY_S = 1.0
NODE_STALE_S = 5.0
MAX_NODES = 4096
MAX_MEMBERS = 1024


def helper_port(probe_port: int) -> int:
    """The helper's TCP port: ``$PROBE_HELPER_PORT``, else the one below the ranks' first."""
    explicit = os.environ.get("PROBE_HELPER_PORT", "")
    return int(explicit) if explicit.isdigit() else probe_port - 1


class Helper:
    """The node's helper: its ranks, other nodes' reports (on the master), and outside reads."""

    def __init__(self, base_port: int, token: str, token_file: Optional[str]) -> None:
        self.base_port = base_port
        self.port = helper_port(base_port)
        self.token_file = token_file
        self.members = Members(base_port)
        self.tcp_address: Optional[str] = None
        self._token = token.encode("utf-8")
        self._nodes: Dict[int, Tuple[float, Dict[str, Any]]] = {}  # node -> (when heard, its report)
        self._nodes_lock = threading.Lock()
        self._listeners: List[Any] = []

    # -- serving ----------------------------------------------------------------------------------

    def serve(self, host: str) -> None:
        from probe.agent.listener import Listener, keep_stdio_open

        keep_stdio_open()  # a launcher started with 0-2 closed must not get our sockets as its stdio
        _paths.ensure_runtime_dir()
        unix_path = _paths.helper_socket_path(os.getpid())
        self._listeners.append(Listener.unix(unix_path, self))
        try:
            tcp = Listener.tcp(host, self.port, self)
        except OSError as exc:
            _say("probe: the host helper serves no TCP on %s:%d (%s); clients elsewhere cannot list this "
                 "node's ranks" % (host, self.port, exc.strerror or exc))
        else:
            self._listeners.append(tcp)
            self.tcp_address = "%s:%d" % (host, tcp.port)
        for listener in self._listeners:
            listener.start()
        import atexit

        atexit.register(self.stop, unix_path)

    def stop(self, unix_path: str) -> None:
        for listener in self._listeners:
            listener.close()
        try:
            os.unlink(unix_path)
        except OSError:
            pass

    def __call__(self, request: Request) -> Response:
        try:
            self._authorize(request)
            return self._route(request)
        except ProbeError as exc:
            return Response.error(exc)
        except Exception as exc:  # a bug of ours: say so, keep serving
            return Response.error(ProbeError("host helper error: %s: %s" % (type(exc).__name__, exc)))

    def _authorize(self, request: Request) -> None:
        if request.transport == "unix":
            return  # the listener checked the peer's uid
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode("utf-8"), self._token):
            raise Unauthorized("the host helper requires the job's token",
                               hint="pass --token-file FILE (on the master host: %s)" % (self.token_file or "?"))

    def _route(self, request: Request) -> Response:
        path = request.path.split("?", 1)[0]
        if request.method == "GET" and path == "/v1/health":
            return Response.json(self._identity())
        if request.method == "GET" and path == "/v1/ranks":
            return Response.json(dict(self._identity(), members=self.all_members(),
                                      nodes=self._node_list()))
        if request.method == "GET" and path.startswith("/v1/outside/"):
            return Response.json(self.outside(path[len("/v1/outside/"):]))
        if request.method == "POST" and path == "/v1/nodes":
            self._take_report(request.json())
            return Response.json({"ok": True})
        raise NotFound("no such endpoint on the host helper: %s %s" % (request.method, path[:200]))

    def _identity(self) -> Dict[str, Any]:
        return {"helper": True, "pid": os.getpid(), "host": node_host(), "node": self.members.node,
                "probe_port": self.base_port, "helper_port": self.port, "token_file": self.token_file}

    # -- members ----------------------------------------------------------------------------------

    def local_members(self) -> List[Dict[str, Any]]:
        helper = "%s:%d" % (node_host(), self.port)
        return [dict(m.to_json(), helper=helper) for m in self.members.scan()]

    def all_members(self) -> List[Dict[str, Any]]:
        """This node's ranks, then those the other nodes reported (marked when their report is old)."""
        out = self.local_members()
        now = time.monotonic()
        with self._nodes_lock:
            reports = sorted(self._nodes.items())
        mine = {m["rank"] for m in out}
        for _node, (heard, report) in reports:
            for member in report.get("members", []):
                if member.get("rank") in mine:
                    continue
                if now - heard > NODE_STALE_S:
                    member = dict(member, state="unreported")
                out.append(member)
        return sorted(out, key=lambda m: m.get("rank", -1))

    def _node_list(self) -> List[Dict[str, Any]]:
        now = time.monotonic()
        with self._nodes_lock:
            return [{"node": n, "host": r.get("host"), "helper": r.get("helper"), "report_age": round(now - t, 2)}
                    for n, (t, r) in sorted(self._nodes.items())]

    def _take_report(self, body: Dict[str, Any]) -> None:
        node, members = body.get("node"), body.get("members")
        if not isinstance(node, int) or not isinstance(members, list) or len(members) > MAX_MEMBERS:
            raise BadRequest("a node report is {\"node\": N, \"host\": H, \"helper\": H:P, \"members\": [...]}")
        clean = [_clean_member(m) for m in members]
        with self._nodes_lock:
            if node not in self._nodes and len(self._nodes) >= MAX_NODES:
                raise Forbidden("too many nodes reported to this helper")
            self._nodes[node] = (time.monotonic(), {"host": str(body.get("host"))[:256],
                                                    "helper": str(body.get("helper"))[:300], "members": clean})

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
        from probe.client import transport

        complained = False
        while True:
            time.sleep(REPORT_EVERY_S)
            try:
                members = self.local_members()
                master = self.members.master_addr
                if not members or self.members.node in (None, 0) or not master:
                    continue
                body = json.dumps({"node": self.members.node, "host": node_host(), "members": members,
                                   "helper": "%s:%d" % (node_host(), self.port)}).encode("utf-8")
                address = transport.TcpAddress(master, int(os.environ.get("PROBE_MASTER_HELPER_PORT") or self.port))
                answer = transport.request(address, "POST", "/v1/nodes", body,
                                           {"Authorization": "Bearer %s" % self._token.decode("utf-8")}, 2.0)
                if answer.status >= 400 and not complained:
                    complained = True
                    _say("probe: the master's host helper at %s refused this node's report (HTTP %d): give every "
                         "node the same PROBE_TOKEN" % (address, answer.status))
            except Exception as exc:
                if not complained:
                    complained = True
                    _say("probe: cannot report this node's ranks to the master's host helper: %s" % exc)


def _clean_member(raw: Any) -> Dict[str, Any]:
    """A member another node reported, with only known fields of the right types."""
    if not isinstance(raw, dict):
        raise BadRequest("a member is an object")
    out: Dict[str, Any] = {}
    for key in ("rank", "local_rank", "world_size", "node", "port", "pid", "restarts"):
        value = raw.get(key)
        out[key] = value if isinstance(value, int) and not isinstance(value, bool) else -1
    for key in ("host", "state", "helper"):
        out[key] = str(raw.get(key))[:300]
    age = raw.get("heartbeat_age")
    out["heartbeat_age"] = age if isinstance(age, (int, float)) and not isinstance(age, bool) else None
    return out


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


def _say(line: str) -> None:
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except BaseException:
        pass


def _job_token(base_port: int) -> Tuple[str, Optional[str]]:
    """The job's token: ``$PROBE_TOKEN``, or the token file the ranks of this node share."""
    if os.environ.get("PROBE_TOKEN"):
        return os.environ["PROBE_TOKEN"], None
    from probe.agent.agent import _token_from_file

    path = os.environ.get("PROBE_TOKEN_FILE") or _paths.job_token_path(base_port)
    _paths.ensure_runtime_dir()
    return _token_from_file(path), path


def start_in_launcher(probe_port: str) -> None:
    """From the start-up hook in torchrun's launcher: the helper in daemon threads; never raises."""
    def run() -> None:
        try:
            from probe.agent.options import binds_every_interface, probe_port_binding

            host, base = probe_port_binding(dict(os.environ, PROBE_PORT=probe_port))
            token, token_file = _job_token(base)
            helper = Helper(base, token, token_file)
            helper.serve(host)
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
