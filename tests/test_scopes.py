"""Scopes (issue 22): a read token reads, a control token also controls, the full token also evaluates;
the unix socket's owner has every scope unless the target lowers it (PROBE_UNIX_SCOPE); the node helper
takes the same tokens with the same scopes. A read token reaches no code by any route: eval, the REPL,
completion, debug start, checkpoint's --model/--optimizer/--frame, the lr change, SQL."""

import json
import os
import socket
from typing import Dict, Iterator, Optional, Tuple

import pytest

import hmac_auth
from procs import Proc, run_cli, running, target_env
from test_node_helper import _until, ranks_of

READ_TOKEN, CONTROL_TOKEN, FULL_TOKEN = "read-3f9a1c", "control-77b2e0", "full-c0ffee11"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tokens(directory: str) -> Dict[str, str]:
    """Token files as a platform team would make them: the full one owner-only, the read one readable by
    all (it is handed out), the control one owner-only."""
    files = {}
    for name, token, mode in (("full", FULL_TOKEN, 0o600), ("read", READ_TOKEN, 0o644), ("control", CONTROL_TOKEN, 0o600)):
        path = os.path.join(directory, "%s.token" % name)
        with open(path, "w") as handle:
            handle.write(token + "\n")
        os.chmod(path, mode)
        files[name] = path
    return files


def _http(port: int, method: str, path: str, token: Optional[str], body: Optional[dict] = None) -> Tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else b""
    head = ["%s %s HTTP/1.1" % (method, path), "Host: x", "Content-Length: %d" % len(data)]
    if token:
        head.append("Authorization: %s" % hmac_auth.authorization(port, token, method, path, data))
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    head_bytes, _, payload = b"".join(chunks).partition(b"\r\n\r\n")
    return int(head_bytes.split(b" ")[1]), json.loads(payload or b"{}")


class Job:
    def __init__(self, proc: Proc, port: int, files: Dict[str, str]) -> None:
        self.proc, self.port, self.files = proc, port, files
        self.address = "127.0.0.1:%d" % port


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Iterator[Job]:
    files = _tokens(str(tmp_path_factory.mktemp("tokens")))
    port = _free_port()
    env = target_env(PROBE_LISTEN="127.0.0.1:%d" % port, PROBE_TOKEN_FILE=files["full"],
                     PROBE_READ_TOKEN_FILE=files["read"], PROBE_CONTROL_TOKEN_FILE=files["control"])
    with running("idle.py", env=env) as proc:
        yield Job(proc, port, files)


# Every route of the agent with a body that passes (or fails after) the scope check and runs nothing that
# lasts: (method, path, body, the scope it needs).
ROUTES = [
    ("GET", "/v1/health", None, "read"),
    ("GET", "/v1/tables", None, "read"),
    ("GET", "/v1/tables/process.info", None, "read"),
    ("POST", "/v1/rows", {"table": "process.info"}, "read"),
    ("GET", "/v1/backtrace", None, "read"),
    ("POST", "/v1/query", {"sql": "SELECT 1 AS x"}, "read"),
    ("POST", "/v1/query/interrupt", {"id": "none-1"}, "read"),
    ("POST", "/v1/torch/trace", {"action": "status"}, "read"),
    ("POST", "/v1/torch/trace", {"action": "start"}, "control"),
    ("POST", "/v1/torch/trace", {"action": "stop"}, "control"),
    ("POST", "/v1/torch/trace", {"action": "export"}, "control"),
    ("POST", "/v1/torch/profile", {"action": "status"}, "read"),
    ("POST", "/v1/torch/profile", {"action": "start", "steps": 1}, "control"),  # no torch in idle.py: refused after
    ("POST", "/v1/torch/profile", {"action": "stop"}, "control"),
    ("POST", "/v1/torch/profile", {"action": "fetch"}, "control"),
    ("POST", "/v1/torch/profile", {"action": "nonsense"}, "control"),
    ("POST", "/v1/torch/checkpoint", {"path": "/nonexistent/dir/x.pt"}, "control"),
    ("POST", "/v1/torch/checkpoint", {"path": "/nonexistent/dir/x.pt", "models": ["__import__('os')"]}, "eval"),
    ("POST", "/v1/torch/checkpoint", {"path": "/nonexistent/dir/x.pt", "optimizers": ["opt"]}, "eval"),
    ("POST", "/v1/torch/checkpoint", {"path": "/nonexistent/dir/x.pt", "frame": "MainThread:0"}, "eval"),
    ("POST", "/v1/torch/lr", {"what": "nothing", "args": []}, "control"),
    ("POST", "/v1/debug/stop", {}, "control"),
    ("POST", "/v1/eval/interrupt", {"id": "none-2"}, "control"),
    ("POST", "/v1/eval", {"code": "6 * 7"}, "eval"),
    ("POST", "/v1/complete", {"text": "o"}, "eval"),
    ("POST", "/v1/debug/start", {"port": "not a port"}, "eval"),
]
RANK = {"read": 1, "control": 2, "eval": 3}


def test_every_route_of_the_agent_has_its_scope_in_the_one_table():
    from probe.agent import routes, scopes

    for method, path in routes._EXACT:
        assert (method, path) in scopes.AGENT_ROUTES, (method, path)
    assert scopes.needed(scopes.AGENT_ROUTES, "POST", "/v1/some/new/route", dict) == scopes.EVAL  # closed by default


@pytest.mark.parametrize("token_name", ["read", "control", "full"])
def test_each_token_reaches_its_scope_and_no_further_over_tcp(job, token_name):
    token = {"read": READ_TOKEN, "control": CONTROL_TOKEN, "full": FULL_TOKEN}[token_name]
    has = {"read": 1, "control": 2, "full": 3}[token_name]
    for method, path, body, need in ROUTES:
        status, answer = _http(job.port, method, path, token, body)
        if RANK[need] <= has:
            assert status != 403 or "scope" not in answer["error"]["message"], (token_name, path, body, answer)
            assert status != 401, (path, answer)
        else:
            assert status == 403, (token_name, path, body, status, answer)
            error = answer["error"]
            assert error["code"] == "forbidden"
            assert "needs the %s scope" % need in error["message"], error
            assert "the %s token gives %s only" % (token_name, {1: "read", 2: "control"}[has]) in error["message"]
            assert "--token-file" in error["hint"] and "full token" in error["hint"], error
            if need == "control":
                assert "control token" in error["hint"], error
    status, answer = _http(job.port, "POST", "/v1/eval", token, {"code": "6 * 7"})
    assert (status == 200 and answer["value"] == "42") == (token_name == "full")


def test_no_refusal_and_no_health_over_tcp_says_where_a_token_file_is(job):
    """Issue 33 item 10: whoever asks (no token, a wrong one, the read or the control token) is told how
    to get a token in general words, never a token file's path (the read and control files may be
    readable by others: their path would hand the token out); only the owner, on the unix socket, sees it."""
    for token in (None, "not-a-token-of-the-job", READ_TOKEN, CONTROL_TOKEN):
        for method, path, body, _need in ROUTES + [("POST", "/v1/eval", {"code": "1"}, "eval")]:
            status, answer = _http(job.port, method, path, token, body)
            text = json.dumps(answer)
            assert not any(f in text or os.path.dirname(f) in text for f in job.files.values()), (token, path, text)
            if token is None:
                assert status == 401 and "--token-file" in answer["error"]["hint"], answer
                assert "owner" in answer["error"]["hint"], answer
    status, answer = _http(job.port, "GET", "/v1/health", FULL_TOKEN)
    assert status == 200 and answer.get("token_file") is None and job.files["full"] not in json.dumps(answer)
    done = run_cli(str(job.proc.pid), "health", "--json")
    assert done.code == 0 and json.loads(done.out)["token_file"] == job.files["full"], done.out


def test_the_read_token_reads_and_reaches_no_code_through_the_cli(job, tmp_path):
    marker = tmp_path / "ran"
    read = ["--token-file", job.files["read"]]
    ok = run_cli(job.address, *read, "backtrace")
    assert ok.code == 0 and "main_sleep" in ok.out, ok.err
    assert run_cli(job.address, *read, "query", "SELECT pid FROM process.info").code == 0
    assert run_cli(job.address, *read, "tables").code == 0 and run_cli(job.address, *read, "health").code == 0
    touch = "open(%r, 'w').close()" % str(marker)
    for args in (["eval", touch], ["checkpoint", str(tmp_path / "c.pt"), "--model", touch],
                 ["checkpoint", str(tmp_path / "c.pt")], ["trace", "start"], ["lr", "0.1"],
                 ["debug"]):
        result = run_cli(job.address, *read, *args, input=touch + "\n")
        assert result.code == 4, (args, result.code, result.out, result.err)
        assert "scope" in result.err and "--token-file" in result.err, (args, result.err)
        assert "Traceback" not in result.err, result.err
    repl = run_cli(job.address, *read, "repl", input=touch + "\n")  # the REPL says so and goes on
    assert "needs the eval scope" in repl.out, repl.out
    eval_refusal = run_cli(job.address, *read, "eval", touch)
    assert "needs the eval scope" in eval_refusal.err and "full token" in eval_refusal.err, eval_refusal.err
    assert not marker.exists()


def test_the_control_token_controls_but_runs_no_code(job, tmp_path):
    control = ["--token-file", job.files["control"]]
    marker = tmp_path / "ran"
    touch = "open(%r, 'w').close()" % str(marker)
    # A checkpoint of what probe finds passes the scope (and fails after it: this target has no torch).
    plain = run_cli(job.address, *control, "checkpoint", str(tmp_path / "c.pt"))
    assert plain.code != 4 and "torch" in plain.err, plain.err
    named = run_cli(job.address, *control, "checkpoint", str(tmp_path / "c.pt"), "--model", touch)
    assert named.code == 4 and "needs the eval scope" in named.err, named.err
    assert run_cli(job.address, *control, "eval", touch).code == 4
    assert not marker.exists()


def test_sql_reaches_no_code_nor_file_with_the_read_token(job, tmp_path):
    marker = str(tmp_path / "sql-ran")
    read = ["--token-file", job.files["read"]]
    for sql in ("COPY (SELECT 1) TO '%s'" % marker, "SELECT * FROM read_csv('/etc/passwd')",
                "SELECT * FROM read_text('/etc/hostname')", "INSTALL httpfs", "LOAD httpfs",
                "ATTACH '%s' AS x" % marker, "SELECT getenv('HOME')", "SET enable_external_access = true",
                "CREATE MACRO m() AS 1", "PRAGMA enable_profiling", "CALL duckdb_secrets()",
                "SELECT * FROM python.threads; COPY (SELECT 1) TO '%s'" % marker):
        result = run_cli(job.address, *read, "query", sql)
        assert result.code in (1, 2), (sql, result.code, result.out)
        assert result.code != 4, sql
    assert not os.path.exists(marker)


def test_unix_socket_owner_has_every_scope_unless_the_target_lowers_it(tmp_path):
    touch = "open(%r, 'w').close()" % str(tmp_path / "ran")
    with running("idle.py", env=target_env(PROBE_UNIX_SCOPE="read")) as proc:
        assert run_cli(str(proc.pid), "backtrace").code == 0
        refused = run_cli(str(proc.pid), "eval", touch)
        assert refused.code == 4 and "needs the eval scope" in refused.err, refused.err
        assert "PROBE_UNIX_SCOPE=read" in refused.err, refused.err
        assert run_cli(str(proc.pid), "trace", "stop").code == 4
    with running("idle.py", env=target_env(PROBE_UNIX_SCOPE="control")) as proc:
        assert run_cli(str(proc.pid), "trace", "stop").code != 4
        assert run_cli(str(proc.pid), "eval", touch).code == 4
    with running("idle.py") as proc:
        assert run_cli(str(proc.pid), "eval", "6 * 7").out.strip() == "42"
    assert not (tmp_path / "ran").exists()


def test_the_node_helper_takes_the_same_scopes(tmp_path):
    files = _tokens(str(tmp_path))
    with ranks_of(tmp_path, 2, GIL_RANK="none", PROBE_TOKEN_FILE=files["full"], PROBE_READ_TOKEN_FILE=files["read"],
                  PROBE_CONTROL_TOKEN_FILE=files["control"]) as job:
        master = "127.0.0.1:%d" % job["port"]

        def listed() -> bool:
            out = run_cli(master, "--token-file", files["read"], "ranks", "-f", "json", env=job["env"])
            return out.code == 0 and len(json.loads(out.out)) == 2

        _until(listed, 30, "2 ranks listed with the read token")
        helper_port = job["port"] - 1
        read = ["--token-file", files["read"]]
        stacks = run_cli(master, *read, "--all-ranks", "backtrace", env=job["env"])
        assert stacks.code == 0 and "ranks 0-1 (2)" in stacks.out, stacks.err
        rows = run_cli(master, *read, "--all-ranks", "query", "SELECT pid FROM process.info", "-f", "json",
                       env=job["env"])
        assert rows.code == 0 and len(json.loads(rows.out)) == 2, rows.err
        refused = run_cli(master, *read, "--all-ranks", "eval", "6 * 7", env=job["env"])
        assert refused.code == 4 and "needs the eval scope" in refused.err, (refused.code, refused.err)
        # The helper's own routes: reads with the read token; a node's report only with the full token.
        for method, path, body in (("GET", "/v1/health", None), ("GET", "/v1/ranks", None),
                                   ("POST", "/v1/gather", {"op": "backtrace", "deadline": 10})):
            status, answer = _http(helper_port, method, path, READ_TOKEN, body)
            assert status == 200, (path, answer)
            # issue 33 item 10: no TCP caller is told where a token's file is (the owner, on the unix socket, is)
            assert not any(f in json.dumps(answer) for f in files.values()), (path, answer)
        for token in (None, "wrong-token", READ_TOKEN):
            answer = _http(helper_port, "POST", "/v1/nodes", token, {"node": 1})[1]
            assert not any(f in json.dumps(answer) for f in files.values()), answer
        listed = run_cli(master, *read, "ranks", env=job["env"])
        assert listed.code == 0 and files["full"] not in listed.out + listed.err, listed
        status, answer = _http(helper_port, "POST", "/v1/nodes", READ_TOKEN, {"node": 1})
        assert status == 403 and "needs the eval scope" in answer["error"]["message"], answer
        status, answer = _http(helper_port, "POST", "/v1/nodes", CONTROL_TOKEN, {"node": 1})
        assert status == 403, answer
        status, answer = _http(helper_port, "GET", "/v1/ranks", "wrong-token")
        assert status == 401, answer
        status, answer = _http(helper_port, "POST", "/v1/nodes", FULL_TOKEN, {"node": 1})
        assert status == 400, answer  # past the scope: the report itself is checked
        full = run_cli(master, "--token-file", files["full"], "--all-ranks", "eval", "6 * 7", env=job["env"])
        assert full.code == 0 and "42" in full.out, full.err


def test_read_token_gathers_cannot_take_every_slot_of_a_node_helper(tmp_path):
    """Read-token holders may keep at most two gathers running on a node helper at once: a read token
    handed around cannot fill the helper's slots with long gathers and keep the owner from diagnosing."""
    import threading

    files = _tokens(str(tmp_path))
    with ranks_of(tmp_path, 2, GIL_RANK="none", PROBE_TOKEN_FILE=files["full"],
                  PROBE_READ_TOKEN_FILE=files["read"]) as job:
        master = "127.0.0.1:%d" % job["port"]
        _until(lambda: run_cli(master, "--token-file", files["read"], "ranks", "-f", "json", env=job["env"]).code == 0,
               30, "the ranks listed")
        helper_port = job["port"] - 1
        # rank 1 busy with a long query (its engine works one thread): each gather of it lasts until rank 1 ends
        slow = {"op": "query", "sql": "SELECT max(hash(range)) FROM range(100000000000)", "timeout": 55,
                "deadline": 58, "ranks": [1]}
        answers: list = []
        done = threading.Event()

        def slow_gather() -> None:  # in again while the other slow one (or the probe below) holds a slot
            while not done.is_set():
                try:
                    status, answer = _http(helper_port, "POST", "/v1/gather", READ_TOKEN, slow)
                except OSError as exc:  # rank 1 killed at the end, or the socket's own timeout
                    answers.append(exc)
                    return
                if status != 503:
                    answers.append((status, answer))
                    return

        threads = [threading.Thread(target=slow_gather, daemon=True) for _ in range(2)]
        try:
            for thread in threads:
                thread.start()
            quick = {"op": "backtrace", "deadline": 20, "ranks": [0]}

            def read_refused() -> bool:  # the handshake: both slow gathers hold the read token's slots
                status, answer = _http(helper_port, "POST", "/v1/gather", READ_TOKEN, quick)
                read_refused.answer = (status, answer)  # type: ignore[attr-defined]
                return status == 503

            _until(read_refused, 60, "a third read-token gather answered busy")
            status, answer = read_refused.answer  # type: ignore[attr-defined]
            assert answer["error"]["code"] == "busy" and "with the read token" in answer["error"]["message"], answer
            assert not answers, answers  # the two slow ones still run
            status, answer = _http(helper_port, "POST", "/v1/gather", FULL_TOKEN, quick)
            assert status == 200 and "MainThread" in json.dumps(answer), answer
            diagnosed = run_cli(master, "--token-file", files["full"], "--ranks", "0", "backtrace", env=job["env"])
            assert diagnosed.code == 0 and "rank 0" in diagnosed.out, (diagnosed.out, diagnosed.err)
        finally:
            done.set()
            job["ranks"][1].kill()  # the slow gathers end with it
            for thread in threads:
                thread.join(150)
