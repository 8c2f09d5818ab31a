"""Another local user against a job's node helper: its runtime files, its TCP routes without a token, the
Prometheus metrics port (open to all by design: what it shows, what it serves, and a flood of half-sent
requests), and hostile bytes on its routes from a token holder. A real rank (no launcher probe knows: it
starts a node helper process of its own, which serves metrics and holds the alert webhooks) in a runtime
directory of the module's own; the other user is a forked child that took uid ``nobody`` (needs root; the
tests skip elsewhere). The alert webhooks' bounds are at the end: a webhook that trickles its answer, one that
sends a huge one, and a password in a webhook's URL."""

import base64
import encodings.idna  # noqa: F401 -- a child that became nobody cannot import it from root's home later
import errno
import json
import os
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest

import hmac_auth
from procs import TARGETS, Proc, scaled, target_env
from test_cluster import _free_ports
from test_node_helper import _alive, _helper_pid, _until

NOBODY = 65534
READ_TOKEN = "r" * 20 + os.urandom(16).hex()  # a read token the job takes: given to this test, not to nobody
SECRET = "hunter2-in-the-url"

as_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user (setuid)")
needs_client = pytest.mark.skipif(__import__("importlib").util.find_spec("prometheus_client") is None,
                                  reason="prometheus_client is not installed")


def as_user(uid: int, work: Callable[[], str], timeout: float = 60.0, go: Optional[int] = None) -> str:
    """What ``work()`` returns, run in a forked child that became ``uid`` (and its group) first. The child may use
    only modules imported already: the interpreter's own files may be closed to ``uid``."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        outcome = "?"
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            outcome = work()
        except BaseException as exc:
            outcome = "child failed %s: %s" % (type(exc).__name__, exc)
        finally:
            os.write(write_end, outcome.encode("utf-8", "replace")[:60000])
            os._exit(0)
    os.close(write_end)
    try:
        deadline = time.monotonic() + scaled(timeout)
        while not os.waitpid(child, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                os.kill(child, signal.SIGKILL)
                os.waitpid(child, 0)
                raise TimeoutError("the uid-%d child did not finish in time" % uid)
            time.sleep(0.02)
        with os.fdopen(read_end, "rb") as handle:
            return handle.read().decode("utf-8", "replace")
    except BaseException:
        try:
            os.close(read_end)
        except OSError:
            pass
        raise


def _http(port: int, method: str, path: str, body: bytes = b"", headers: Optional[Dict[str, str]] = None,
          timeout: float = 30.0) -> Tuple[int, bytes]:
    """One raw request to 127.0.0.1:port; (status, body)."""
    lines = ["%s %s HTTP/1.1" % (method, path), "Host: 127.0.0.1", "Content-Length: %d" % len(body)]
    lines += ["%s: %s" % item for item in (headers or {}).items()]
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(("127.0.0.1", port))
        try:
            sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered (413) before the whole body was read: read that answer
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        sock.close()
    head, _, payload = b"".join(chunks).partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), payload


def _threads(pid: int) -> int:
    with open("/proc/%d/status" % pid) as handle:
        return int(next(line.split()[1] for line in handle if line.startswith("Threads:")))


@contextmanager
def _job(script: str = "dist_steps.py", wait_metrics: bool = True, **extra: str) -> Iterator[Dict[str, Any]]:
    """One rank as srun would start it (``dist_steps.py``: a gloo job of one rank that steps, so that its
    progress file, audit trail and stall record are there too), with PROBE_PORT, PROBE_METRICS_PORT, a read
    token and an alert webhook whose URL holds secrets; its node helper serves all of them. The runtime
    directory's parent may be crossed by others (0711), so that a test can open the directory itself to them
    and see each file refuse."""
    parent = tempfile.mkdtemp(prefix="probe-other-")
    os.chmod(parent, 0o711)
    runtime = os.path.join(parent, "run")
    os.mkdir(runtime, 0o700)
    control = os.path.join(parent, "control")
    port, metrics = _free_ports(1), _free_ports(1)
    hook = "http://user:%s@127.0.0.1:9/hook/%s?token=%s" % (SECRET, SECRET, SECRET)  # the discard port: refused
    env = target_env(PROBE_PORT="127.0.0.1:%d" % port, PROBE_RUNTIME_DIR=runtime, PROBE_HELPER_LINGER_S="2",
                     PROBE_METRICS_PORT=str(metrics), PROBE_READ_TOKEN=READ_TOKEN, PROBE_ALERT_WEBHOOK=hook,
                     PROBE_STACK_EVERY="1", PROBE_HANG_AFTER="3", PROBE_AUDIT_READS="1", SLURM_NTASKS="1",
                     SLURM_NODEID="0", SLURM_PROCID="0", SLURM_LOCALID="0", RANK="0", LOCAL_RANK="0",
                     WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_ports(1)),
                     DIAG_CONTROL=control, STEP_SLEEP="0.05")
    env.update(extra)
    metrics = int(env["PROBE_METRICS_PORT"])
    popen = subprocess.Popen([sys.executable, os.path.join(TARGETS, script)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env)
    rank = Proc(popen, script)
    helper = None
    try:
        assert rank.read_line(scaled(90)).startswith("READY")
        helper = _until(lambda: _helper_pid(runtime, port), 60, "the node helper")

        def metrics_served() -> bool:
            try:
                return _http(metrics, "GET", "/metrics", timeout=10)[0] == 200
            except OSError:
                return False

        if wait_metrics:
            _until(metrics_served, 60, "the metrics port")
        with open(os.path.join(runtime, "job-%d.token" % port)) as handle:
            token = handle.read().strip()
        yield {"port": port, "helper_port": port - 1, "metrics": metrics, "runtime": runtime, "rank": rank,
               "helper": helper, "token": token, "control": control}
    finally:
        rank.kill()
        if helper is not None:
            try:
                _until(lambda: not _alive(helper), 30, "the node helper to leave once its rank is gone")
            finally:
                if _alive(helper):
                    os.kill(helper, signal.SIGKILL)
        shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture(scope="module")
def job() -> Iterator[Dict[str, Any]]:
    with _job() as started:
        yield started


# -- another user, no token --------------------------------------------------------------------------------


@as_root
def test_another_user_can_open_none_of_the_helper_s_runtime_files(job: Dict[str, Any]) -> None:
    runtime = job["runtime"]
    # A stall, recorded by the node's watch: its record is among the files (runtime/snapshots/ID/...).
    with open(job["control"], "w") as handle:
        handle.write("nap 0\n")
    try:
        _until(lambda: any(name.startswith("meta-") for _, _, files in os.walk(os.path.join(runtime, "snapshots"))
                           for name in files), 90, "the stall recorded")
    finally:
        with open(job["control"], "w"):
            pass
    paths = sorted(os.path.join(top, name) for top, dirs, files in os.walk(runtime) for name in dirs + files)
    names = {os.path.basename(p) for p in paths}
    pid = job["rank"].pid
    for expected in ("job-%d.token" % job["port"], "node-%d.log" % job["port"], "node-%d.sock" % job["port"],
                     "progress-%d.bin" % pid, "%d.sock" % pid, "rank-00000.json"):
        assert any(n == expected or n.startswith(expected) for n in names), (expected, sorted(names))
    assert any(n.startswith("audit-%d-" % pid) for n in names), sorted(names)
    with open(os.path.join(runtime, "node-%d.log" % job["port"])) as handle:
        log = handle.read()
    assert "alerts go to http://127.0.0.1:9/…" in log and SECRET not in log, log  # the webhook's URL, masked

    def listing() -> str:
        try:
            return "listed %d" % len(os.listdir(runtime))
        except OSError as exc:
            return type(exc).__name__

    assert as_user(NOBODY, listing) == "PermissionError"
    # Opened to others on purpose (as a careless chmod would), each file and directory still refuses them.
    os.chmod(runtime, 0o711)
    try:
        for path in paths:
            info = os.lstat(path)
            assert stat.S_IMODE(info.st_mode) & 0o077 == 0, (path, oct(info.st_mode))

        def opened() -> str:
            out = []
            for path in paths:
                name = os.path.relpath(path, runtime)
                try:
                    if stat.S_ISSOCK(os.lstat(path).st_mode):
                        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                            sock.settimeout(5)
                            sock.connect(path)
                    elif os.path.isdir(path):
                        os.listdir(path)
                    else:
                        with open(path, "rb") as handle:
                            handle.read(1)
                    out.append("%s opened" % name)
                except OSError as exc:
                    out.append("%s %s" % (name, type(exc).__name__))
            return "\n".join(out)

        outcome = as_user(NOBODY, opened).splitlines()
    finally:
        os.chmod(runtime, 0o700)
    assert len(outcome) == len(paths) and all(line.endswith("PermissionError") for line in outcome), outcome


@as_root
def test_the_helper_s_tcp_routes_refuse_another_user_without_a_token(job: Dict[str, Any]) -> None:
    port = job["helper_port"]
    routes = [("GET", "/v1/health", b""), ("GET", "/v1/ranks", b""), ("GET", "/v1/stack_history", b""),
              ("GET", "/v1/stack_history?current=1", b""), ("GET", "/v1/outside/%d" % job["rank"].pid, b""),
              ("POST", "/v1/gather", b'{"op": "query", "sql": "SELECT * FROM process.env"}'),
              ("POST", "/v1/gather", b'{"op": "evidence"}'), ("POST", "/v1/nodes", b"{}"),
              ("POST", "/v1/register", b'{"pid": 1}'), ("POST", "/v1/torch/profile", b'{"action": "start"}')]

    def ask() -> str:
        out = []
        for method, path, body in routes:
            status, answer = _http(port, method, path, body)
            out.append("%s %s %d %s" % (method, path, status, answer[:200].decode("utf-8", "replace")))
        status, answer = _http(port, "GET", "/v1/health", headers={"Authorization": "Bearer " + READ_TOKEN})
        out.append("bearer %d %s" % (status, answer[:200].decode("utf-8", "replace")))
        return "\n".join(out)

    lines = as_user(NOBODY, ask).splitlines()
    assert len(lines) == len(routes) + 1, lines
    for line in lines:
        assert " 401 " in line and "unauthorized" in line, line
    assert all(job["token"] not in line and READ_TOKEN not in line for line in lines)


@as_root
@needs_client
def test_the_metrics_port_shows_another_user_numbers_only_and_serves_only_metrics(job: Dict[str, Any]) -> None:
    port = job["metrics"]

    def scrape() -> str:
        answers = {}
        for method, path in (("GET", "/metrics"), ("GET", "/"), ("GET", "/metrics/../v1/health"),
                             ("GET", "/favicon.ico"), ("POST", "/metrics"), ("PUT", "/metrics")):
            status, body = _http(port, method, path, b"x" if method != "GET" else b"")
            answers["%s %s" % (method, path)] = [status, body.decode("utf-8", "replace")]
        return json.dumps(answers)

    answers = json.loads(as_user(NOBODY, scrape))
    status, text = answers.pop("GET /metrics")
    assert status == 200 and "probe_ranks{" in text and "probe_rank_state{" in text, text[:400]
    assert {v[0] for v in answers.values()} <= {404, 405}, answers
    assert answers["POST /metrics"][0] == 405 and answers["GET /"][0] == 404, answers
    # What another user sees: the job's name, the host, rank numbers and numbers about them. No secret of the job
    # (its tokens, its webhook's URL), no path, no process id.
    for secret in (job["token"], READ_TOKEN, SECRET, job["runtime"], str(job["rank"].pid), str(job["helper"])):
        assert secret not in text, secret
    import re

    labels = re.findall(r'(\w+)="([^"]*)"', text)
    assert labels and {key for key, _ in labels} <= {"job", "node", "host", "rank", "local_rank", "state"}, labels
    assert all("/" not in value for _, value in labels), labels


def _while_another_user_floods(ports: List[int], per_port: int, look: Callable[[], Any]) -> Tuple[int, Any]:
    """(connections made, what ``look()`` gave) while uid nobody holds up to ``per_port`` connections to each
    port that each sent half a request and never the rest (those the server has not closed)."""

    def flood() -> List[socket.socket]:
        # Every connect of a port at once (non-blocking): one by one, each connect that met a full listen
        # backlog waited out the kernel's 1 s SYN retry alone, ten seconds a port for nothing.
        socks = []
        for port in ports:
            pending: Dict[int, socket.socket] = {}
            for _ in range(per_port):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setblocking(False)
                if sock.connect_ex(("127.0.0.1", port)) not in (0, errno.EINPROGRESS):
                    sock.close()
                    break
                pending[sock.fileno()] = sock
            poller = select.poll()  # not select(): more than 1024 descriptors
            for fd in pending:
                poller.register(fd, select.POLLOUT)
            deadline = time.monotonic() + 10
            while pending and time.monotonic() < deadline:
                for fd, _ in poller.poll(max(deadline - time.monotonic(), 0) * 1000):
                    poller.unregister(fd)
                    sock = pending.pop(fd)
                    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) in (errno.ECONNREFUSED, errno.ETIMEDOUT):
                        sock.close()  # never made
                        continue
                    socks.append(sock)
                    try:
                        sock.send(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
                    except OSError:
                        pass  # closed by the server already (a refused peer past the bound): it was made all the same
            for sock in pending.values():
                sock.close()  # not connected within 10 s
        return socks

    return _while_another_user_holds(flood, look)


def _while_another_user_holds(make: Callable[[], List[socket.socket]], look: Callable[[], Any]) -> Tuple[int, Any]:
    """(sockets held, what ``look()`` gave) while uid nobody holds the sockets ``make()`` opened."""
    go_read, go_write = os.pipe()
    said_read, said_write = os.pipe()
    result: List[str] = []

    def hold() -> str:
        socks = make()
        os.write(said_write, b"%d\n" % len(socks))
        select.select([go_read], [], [], scaled(120))  # held until the test has looked
        return "held %d" % len(socks)

    child = threading.Thread(target=lambda: result.append(as_user(NOBODY, hold, timeout=240)), daemon=True)
    child.start()
    try:
        ready, _, _ = select.select([said_read], [], [], scaled(120))
        assert ready, "the flood did not start"
        held = int(os.read(said_read, 64).split()[0])
        seen = look()
    finally:
        os.write(go_write, b"go")
        child.join(scaled(240))
        for fd in (go_read, go_write, said_read, said_write):
            os.close(fd)
    assert result and result[0] == "held %d" % held, result
    return held, seen


@as_root
@needs_client
def test_another_user_s_half_sent_requests_hold_no_thread_a_connection(job: Dict[str, Any]) -> None:
    """Nine hundred connections that never finish their request cost the helper a bounded number of threads,
    and a scrape and the helper's own port are answered meanwhile."""
    before = _threads(job["helper"])

    def look() -> Tuple[int, int]:
        during = _threads(job["helper"])
        status, text = _http(job["metrics"], "GET", "/metrics", timeout=scaled(60))
        assert status == 200 and b"probe_ranks{" in text
        status, _ = _http(job["helper_port"], "GET", "/v1/health", timeout=scaled(60))
        assert status == 401  # answered (no token here): the port is not held by the flood
        return during, _threads(job["helper"])

    held, (during, after) = _while_another_user_floods([job["metrics"], job["helper_port"]], 450, look)
    assert held >= 200, held
    # Each listener works a bounded number of connections at once (probe.agent.listener.MAX_CONNECTIONS): the
    # metrics port's and the helper's, whatever the flood.
    from probe.agent.listener import MAX_CONNECTIONS

    assert max(during, after) <= before + 2 * MAX_CONNECTIONS + 8, (before, during, after, held)


@as_root
def test_another_user_s_connections_to_a_page_take_a_few_threads_at_most(target_factory) -> None:
    """``probe PID page`` refuses other users; their connections, however many, get a few threads of its
    process (which count against its user's process limit, as the job's do), and its owner is served. (Each
    connection past the first few costs a read of the kernel's TCP table: slow where it lists thousands.)"""
    from probe.page.server import REFUSALS_AT_ONCE, UNCHECKED
    from test_page import _end, _get, _serve

    target = target_factory("idle.py")
    proc, url = _serve(str(target.pid), "page", "--refresh", "5")
    try:
        port = int(url.split(":")[2].split("/")[0])
        before = _threads(proc.pid)

        def look() -> Tuple[int, Any]:
            during = _threads(proc.pid)
            return during, _get(url, "/api/about")

        held, (during, about) = _while_another_user_floods([port], 150, look)
        assert held >= 100, held
        assert isinstance(about, dict) and about, about
        assert during <= before + UNCHECKED + REFUSALS_AT_ONCE + 4, (before, during, held)
    finally:
        _end(proc)


@as_root
def test_a_metrics_port_another_user_holds_is_named_with_its_uid() -> None:
    """Another user who binds the metrics port first would be scraped instead: the helper's log says whose the
    port is (and it binds it once it is free)."""
    port = _free_ports(1)

    def squat() -> List[socket.socket]:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", port))
        sock.listen(4)
        return [sock]

    def look() -> str:
        with _job("rank_states.py", wait_metrics=False, PROBE_METRICS_PORT=str(port)) as started:
            log = os.path.join(started["runtime"], "node-%d.log" % started["port"])

            def said() -> str:
                try:
                    with open(log) as handle:
                        return next((line for line in handle if "no metrics on" in line), "")
                except OSError:
                    return ""

            return _until(said, 60, "the helper's line about the metrics port")

    held, line = _while_another_user_holds(squat, look)
    assert held == 1
    assert "port %d taken by uid %d;" % (port, NOBODY) in line and "tried again every" in line, line


# -- hostile bytes from a token holder ---------------------------------------------------------------------


def test_hostile_bytes_on_the_helper_s_routes_keep_it_serving(job: Dict[str, Any]) -> None:
    port = job["helper_port"]

    def signed(method: str, path: str, body: bytes = b"") -> Tuple[int, Dict[str, Any]]:
        auth = hmac_auth.authorization(port, READ_TOKEN, method, path, body)
        status, answer = _http(port, method, path, body, {"Authorization": auth})
        return status, json.loads(answer)

    cases = [("POST", "/v1/gather", b'{"op": ', 400), ("POST", "/v1/gather", b"[1, 2]", 400),
             ("POST", "/v1/gather", b'{"op": "eval", "code": "1"}', 400),
             ("POST", "/v1/gather", b'{"op": "query", "sql": "SELECT 1", "deadline": 1e999}', 400),
             ("POST", "/v1/gather", b'{"op": "backtrace", "ranks": "all"}', 400),
             ("POST", "/v1/gather", b'{"op": "query"}' + b" " * (2 << 20), 413),
             ("POST", "/v1/gather", b"[" * 100000 + b"]" * 100000, 400),
             ("GET", "/v1/outside/../../etc/passwd", b"", 403), ("GET", "/v1/outside/99999999999999999999", b"", 403),
             ("POST", "/v1/nodes", b'{"node": 1}', 403), ("POST", "/v1/torch/profile", b'{"action": "start"}', 403)]
    for method, path, body, expected in cases:
        status, answer = signed(method, path, body)
        assert status == expected and "error" in answer, (path, body[:60], status, answer)
    assert signed("GET", "/v1/stack_history?current=x&current=1")[0] == 200
    status, health = signed("GET", "/v1/health")
    assert status == 200 and health["pid"] == job["helper"] and health["token_file"] is None, health


# -- the alert webhooks ------------------------------------------------------------------------------------


class _Hook:
    """A webhook on 127.0.0.1 that answers as ``mode`` says: ``trickle`` (its status line, then a byte every
    0.2 s, never the end of its headers), ``huge`` (a 200 with a 64 MB body) or ``redirect`` (a 302 to
    ``/elsewhere``); it keeps each request's path and Authorization header, a GET's too."""

    def __init__(self, mode: str) -> None:
        seen: List[Tuple[str, Optional[str]]] = []
        self.seen = seen
        stop = threading.Event()
        self.stop = stop

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 -- http.server's name
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                seen.append((self.path, self.headers.get("Authorization")))
                try:
                    if mode == "redirect":
                        self.send_response(302)
                        self.send_header("Location", "/elsewhere")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                    elif mode == "trickle":
                        self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                        while not stop.wait(0.2):
                            self.wfile.write(b"X")
                            self.wfile.flush()
                    else:
                        self.send_response(200)
                        self.send_header("Content-Length", str(64 << 20))
                        self.end_headers()
                        chunk = b"x" * (1 << 20)
                        for _ in range(64):
                            self.wfile.write(chunk)
                except OSError:
                    pass  # the post went: as it should

            def do_GET(self) -> None:  # noqa: N802 -- where a redirect followed would go
                seen.append((self.path, self.headers.get("Authorization")))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


def _post_one(url: str, timeout: float) -> Tuple[Any, List[str]]:
    from probe.host.alerts import Alerts, parse_hooks

    log: List[str] = []
    hooks, refused = parse_hooks(url)
    assert hooks and not refused, refused
    alerts = Alerts(hooks, log.append, timeout=timeout, tries=1)
    assert alerts.fire("test", "one", lambda: {"rule": "test", "summary": "a test"})
    assert alerts.drain(scaled(60)), "the post still going after %.0f s: %s" % (scaled(60), log)
    return alerts, log


def test_a_webhook_that_trickles_its_answer_is_cut_at_the_timeout() -> None:
    hook = _Hook("trickle")
    try:
        alerts, log = _post_one("http://127.0.0.1:%d/slow/%s" % (hook.port, SECRET), 2.0)
    finally:
        hook.close()
    assert [path for path, _ in hook.seen] == ["/slow/%s" % SECRET], hook.seen
    assert alerts.failed == 1 and alerts.sent == 0, log
    assert any("failed after 1 try" in line and "no whole answer within 2 s" in line for line in log), log
    assert not any(SECRET in line for line in log), log


def test_a_huge_answer_is_not_read_and_a_password_in_the_url_goes_as_basic_auth() -> None:
    hook = _Hook("huge")
    try:
        alerts, log = _post_one("http://al%%40ice:%s@127.0.0.1:%d/hook?token=%s" % (SECRET, hook.port, SECRET), 10.0)
    finally:
        hook.close()
    assert alerts.sent == 1 and alerts.failed == 0, log
    assert len(hook.seen) == 1, hook.seen
    path, authorization = hook.seen[0]
    assert path == "/hook?token=%s" % SECRET
    assert authorization and base64.b64decode(authorization.split()[1]).decode() == "al@ice:%s" % SECRET
    assert not any(SECRET in line for line in log), log


def test_a_webhook_that_redirects_is_not_followed() -> None:
    hook = _Hook("redirect")
    try:
        alerts, log = _post_one("http://user:%s@127.0.0.1:%d/hook" % (SECRET, hook.port), 5.0)
    finally:
        hook.close()
    assert [path for path, _ in hook.seen] == ["/hook"], hook.seen  # nothing asked of /elsewhere
    assert alerts.failed == 1 and any("HTTP 302" in line for line in log), log
    assert not any(SECRET in line for line in log), log
