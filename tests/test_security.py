"""Who may talk to an agent: the owner on the unix socket, token holders on TCP; secrets stay masked;
nothing is left behind when the target exits."""

import json
import os
import socket
import stat
import tempfile
import time
from typing import Dict, Iterator, Optional, Tuple

import pytest
import hmac_auth
from other_user import run_as
from procs import Proc, run_cli, running, target_env

import probe
from probe import _paths


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _http(sock: socket.socket, method: str, path: str, headers: Optional[Dict[str, str]] = None,
          body: bytes = b"") -> Tuple[int, Dict[str, object]]:
    lines = ["%s %s HTTP/1.1" % (method, path), "Host: 127.0.0.1", "Content-Length: %d" % len(body)]
    lines.extend("%s: %s" % item for item in (headers or {}).items())
    try:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the agent answered before reading the request (a refused peer); read that answer
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:  # closed with our request unread: what was sent before still counts
            break
        if not chunk:
            break
        chunks.append(chunk)
    if not chunks:
        raise ConnectionResetError("the agent closed the connection without an answer")
    head, _, payload = b"".join(chunks).partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(payload.decode("utf-8"))


def _tcp_request(port: int, method: str, path: str, headers: Optional[Dict[str, str]] = None,
                 body: bytes = b"") -> Tuple[int, Dict[str, object]]:
    with socket.create_connection(("127.0.0.1", port), timeout=10.0) as sock:
        return _http(sock, method, path, headers, body)


class TcpTarget:
    def __init__(self, proc: Proc, port: int) -> None:
        self.proc = proc
        self.port = port
        self.address = "127.0.0.1:%d" % port
        self.token_file = _paths.token_path(proc.pid)

    def token(self) -> str:
        with open(self.token_file) as handle:
            return handle.read().strip()


@pytest.fixture(scope="module")
def tcp_target() -> Iterator[TcpTarget]:
    port = _free_port()
    with running("idle.py", env=target_env(PROBE_LISTEN="127.0.0.1:%d" % port)) as proc:
        yield TcpTarget(proc, port)


# -- the unix socket -----------------------------------------------------------------------------------

def test_socket_and_its_directory_are_owner_only(idle_target):
    path = _paths.socket_path(idle_target.pid)
    info = os.stat(path)
    assert stat.S_ISSOCK(info.st_mode)
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_uid == os.getuid()
    directory = os.stat(os.path.dirname(path))
    assert stat.S_ISDIR(directory.st_mode)
    assert stat.S_IMODE(directory.st_mode) == 0o700
    assert directory.st_uid == os.getuid()


def _connect_as(uid: int, path: str, timeout: float = 10.0) -> str:
    """As user ``uid``: what asking ``path`` for its health gives (one line)."""

    def ask() -> bytes:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5.0)
        try:
            sock.connect(path)
            status, body = _http(sock, "GET", "/v1/health")
            return ("answered %d %s" % (status, json.dumps(body))).encode("utf-8", "replace")[:4000]
        except OSError as exc:
            return ("refused %s" % type(exc).__name__).encode()
        finally:
            sock.close()

    return run_as(uid, ask, timeout).decode("utf-8", "replace")


NOBODY = 65534


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user (setuid)")
def test_another_user_cannot_reach_the_agent(target_factory, monkeypatch):
    # A runtime directory of its own, under a parent that others may traverse, so that this test can
    # open the agent's files to other users and still see the agent refuse them by peer credentials.
    parent = tempfile.mkdtemp(prefix="probe-sec-")
    try:
        os.chmod(parent, 0o711)
        runtime = os.path.join(parent, "rt")
        monkeypatch.setenv("PROBE_RUNTIME_DIR", runtime)
        proc = target_factory("idle.py", env=target_env(PROBE_RUNTIME_DIR=runtime))
        path = _paths.socket_path(proc.pid)
        assert path.startswith(runtime)

        # 1. as the agent made them: the directory (0700) keeps other users out
        outcome = _connect_as(NOBODY, path)
        assert outcome == "refused PermissionError", outcome

        # 2. with the files opened to everyone, the agent itself refuses by the peer's uid
        os.chmod(runtime, 0o711)
        os.chmod(path, 0o666)
        outcome = _connect_as(NOBODY, path)
        assert outcome.startswith("answered 403 "), outcome
        error = json.loads(outcome.split(" ", 2)[2])["error"]
        assert error["code"] == "forbidden" and "owner" in error["message"]

        # ...and still answers its owner
        assert probe.connect(str(proc.pid)).health()["pid"] == proc.pid
    finally:
        import shutil

        shutil.rmtree(parent, ignore_errors=True)


# -- TCP and its token ---------------------------------------------------------------------------------

def test_token_file_is_owner_only(tcp_target):
    info = os.stat(tcp_target.token_file)
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.getuid()
    assert len(tcp_target.token()) >= 32


@pytest.mark.parametrize("method, path", [("GET", "/v1/health"), ("GET", "/v1/tables"),
                                          ("POST", "/v1/query"), ("POST", "/v1/eval")])
def test_tcp_without_a_token_is_unauthorized(tcp_target, method, path):
    body = b'{"sql": "SELECT 1", "code": "1"}' if method == "POST" else b""
    status, answer = _tcp_request(tcp_target.port, method, path, body=body)
    assert status == 401
    assert answer["error"]["code"] == "unauthorized"
    assert "--token-file" in answer["error"]["hint"]


@pytest.mark.parametrize("authorization", ["Bearer wrong-token", "Bearer ", "Basic dXNlcjpwYXNz", "token",
                                           "Bearer {token}x", "Bearer {token_prefix}"])
def test_tcp_with_a_wrong_token_is_unauthorized(tcp_target, authorization):
    token = tcp_target.token()
    value = authorization.format(token=token, token_prefix=token[:-1])
    status, answer = _tcp_request(tcp_target.port, "GET", "/v1/health", {"Authorization": value})
    assert status == 401 and answer["error"]["code"] == "unauthorized"


def test_tcp_with_the_right_token_answers(tcp_target):
    value = hmac_auth.authorization(tcp_target.port, tcp_target.token(), "GET", "/v1/health")
    status, answer = _tcp_request(tcp_target.port, "GET", "/v1/health", {"Authorization": value})
    assert status == 200 and answer["pid"] == tcp_target.proc.pid
    assert answer["tcp"] == tcp_target.address
    again, refused = _tcp_request(tcp_target.port, "GET", "/v1/health", {"Authorization": value})
    assert again == 401 and "used already" in refused["error"]["message"], "a request's proof is good once"


def test_tcp_takes_no_bearer_token_even_the_right_one(tcp_target):
    """A client that sends its token sends it to whoever holds the port: the agent takes none that way."""
    status, answer = _tcp_request(tcp_target.port, "GET", "/v1/health",
                                  {"Authorization": "Bearer %s" % tcp_target.token()})
    assert status == 401 and "takes no bearer token" in answer["error"]["message"]
    assert "/v1/hello" in answer["error"]["hint"]


@pytest.mark.parametrize("change", ["method", "path", "body", "nonce", "scope", "token"])
def test_a_proof_made_for_another_request_or_token_is_refused(tcp_target, change):
    """The request's MAC binds its method, path and body, the hello's nonces, the scope and the token."""
    token = tcp_target.token()
    value = hmac_auth.authorization(tcp_target.port, "x" + token if change == "token" else token, "POST", "/v1/query",
                                    b'{"sql": "SELECT 1"}')
    if change == "nonce":
        value = value.replace("cn=", "cn=0").replace("cn=0" + value.split("cn=")[1][:32], "cn=0" + value.split("cn=")[1][:31])
    if change == "scope":
        value = value.replace("scope=eval", "scope=read")
    method, path, body = (("GET" if change == "method" else "POST"), ("/v1/eval" if change == "path" else "/v1/query"),
                          (b'{"sql": "SELECT 2"}' if change == "body" else b'{"sql": "SELECT 1"}'))
    status, answer = _tcp_request(tcp_target.port, method, path, {"Authorization": value}, body)
    assert status == 401 and answer["error"]["code"] == "unauthorized", answer


def _elsewhere(tmp_path) -> str:
    """A runtime directory of no agent: a client that uses it is as one on another host, which cannot read
    the agent's token file (on this host the client reads it: test_client_api)."""
    path = tmp_path / "elsewhere"
    path.mkdir(mode=0o700, exist_ok=True)
    return str(path)


def test_cli_over_tcp_needs_the_token_file(tcp_target, tmp_path):
    sql = "SELECT pid FROM process.info"
    elsewhere = target_env(probe=False, PROBE_RUNTIME_DIR=_elsewhere(tmp_path))
    missing = run_cli("-t", tcp_target.address, "query", sql, env=elsewhere)
    assert missing.code == 4
    assert "--token-file" in missing.err
    assert missing.out == ""

    health = run_cli("-t", tcp_target.address, "health", env=elsewhere)
    assert health.code == 4 and "--token-file" in health.err

    wrong = tmp_path / "wrong.token"
    wrong.write_text("not-the-token\n")
    refused = run_cli("-t", tcp_target.address, "--token-file", str(wrong), "query", sql)
    assert refused.code == 4 and "refused" in refused.err

    right = run_cli("-t", tcp_target.address, "--token-file", tcp_target.token_file, "query", sql, "-f", "json")
    assert right.code == 0, right.err
    assert json.loads(right.out) == [{"pid": tcp_target.proc.pid}]

    shorthand = run_cli(tcp_target.address, "--token-file", tcp_target.token_file, "eval", "6 * 7")
    assert shorthand.code == 0, shorthand.err
    assert shorthand.out.strip() == "42"


def test_client_over_tcp_with_the_token_file(tcp_target, tmp_path, monkeypatch):
    client = probe.connect(tcp_target.address, token_file=tcp_target.token_file)
    assert client.health()["pid"] == tcp_target.proc.pid
    assert client.query_rows("SELECT pid FROM process.info").rows == [[tcp_target.proc.pid]]
    assert client.eval("6 * 7").value == "42"
    assert any(f.func == "main_sleep" for f in client.backtrace())

    monkeypatch.setenv("PROBE_RUNTIME_DIR", _elsewhere(tmp_path))
    anonymous = probe.connect(tcp_target.address)
    with pytest.raises(probe.ProbeError) as caught:
        anonymous.health()
    assert caught.value.code == "unauthorized" and "--token-file" in (caught.value.hint or "")


def test_idle_connections_without_a_token_cannot_lock_out_a_token_holder(tcp_target):
    from probe.agent.listener import MAX_CONNECTIONS

    idle = []
    try:
        for _ in range(MAX_CONNECTIONS + 8):  # connect and never send a request
            idle.append(socket.create_connection(("127.0.0.1", tcp_target.port), timeout=5))
        client = probe.connect(tcp_target.address, token_file=tcp_target.token_file, timeout=5)
        started = time.monotonic()
        assert client.health()["pid"] == tcp_target.proc.pid
        assert time.monotonic() - started < 5
    finally:
        for sock in idle:
            sock.close()


def test_an_unreadable_token_file_is_a_usage_error(tcp_target, tmp_path):
    result = run_cli("-t", tcp_target.address, "--token-file", str(tmp_path / "missing"), "health")
    assert result.code != 0
    assert "missing" in result.err


# -- secrets in tables ---------------------------------------------------------------------------------

@pytest.mark.parametrize("show", [None, "1"])
def test_process_env_masks_secret_looking_values(target_factory, show):
    extra = {"MY_API_TOKEN": "s3cret-token-value", "DB_PASSWORD": "hunter2-pw", "PLAIN_SETTING": "visible-value"}
    if show is not None:
        extra["PROBE_SHOW_SECRETS"] = show
    proc = target_factory("idle.py", env=target_env(**extra))
    result = run_cli(str(proc.pid), "query", "SELECT name, value, masked FROM process.env ORDER BY name",
                     "-f", "json")
    assert result.code == 0, result.err
    rows = {r["name"]: r for r in json.loads(result.out)}
    assert rows["PLAIN_SETTING"] == {"name": "PLAIN_SETTING", "value": "visible-value", "masked": False}
    for name in ("MY_API_TOKEN", "DB_PASSWORD"):
        if show:
            assert rows[name]["value"] == extra[name] and rows[name]["masked"] is False
        else:
            assert rows[name]["value"] == "********" and rows[name]["masked"] is True
    if not show:
        assert "s3cret" not in result.out and "hunter2" not in result.out


# -- nothing left behind -------------------------------------------------------------------------------

def test_socket_and_token_files_are_removed_at_a_clean_exit(target_factory, tmp_path):
    trigger = tmp_path / "exit-now"
    proc = target_factory("states.py", "exit", str(trigger),
                          env=target_env(PROBE_LISTEN="127.0.0.1:%d" % _free_port()))
    sock, token = _paths.socket_path(proc.pid), _paths.token_path(proc.pid)
    assert os.path.exists(sock) and os.path.exists(token)
    assert probe.connect(str(proc.pid)).health()["pid"] == proc.pid
    trigger.write_text("")
    assert proc.popen.wait(10) == 0
    assert not os.path.exists(sock), "the socket file outlived its process"
    assert not os.path.exists(token), "the token file outlived its process"


def test_server_nonces_are_single_use_short_lived_and_bounded(monkeypatch):
    """What a listener keeps between a hello and its request: each nonce taken back once, by the client it
    was issued to, within its life; at most MAX_NONCES held however many hellos come."""
    from probe.agent import handshake

    nonces, mine, other = handshake.Nonces(), "a" * 32, "b" * 32
    sn = nonces.issue(mine)
    assert not nonces.take(sn, other) and not nonces.take(sn, mine), "another client's try uses it up"
    sn = nonces.issue(mine)
    assert nonces.take(sn, mine) and not nonces.take(sn, mine)
    first = nonces.issue(mine)
    for _ in range(handshake.MAX_NONCES):
        nonces.issue(mine)
    assert len(nonces) == handshake.MAX_NONCES and not nonces.take(first, mine)
    monkeypatch.setattr(handshake, "NONCE_LIFE_S", 0.0)
    stale = nonces.issue(mine)
    issued = time.monotonic()
    while time.monotonic() == issued:
        pass
    assert not nonces.take(stale, mine), "a nonce past its life was taken"
