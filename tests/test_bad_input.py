"""Bad input against a real agent: each is refused with an error that says why, and afterwards the
agent still answers and the target's own work (busy.py's counting loop) never stopped.

One busy target serves the whole module (starting one costs time); every test reads its loop counter
before the bad input and checks that it advanced afterwards, and that a normal query still answers.
"""

import json
import os
import shutil
import socket
import tempfile
import threading
import time
from contextlib import contextmanager
from typing import Dict, Iterator, List, Tuple

import pytest
from procs import Proc, run_cli, running, target_env

import probe
from probe import _paths
from probe.agent.http import MAX_BODY_BYTES, MAX_HEADER_BYTES, MAX_HEADERS


@pytest.fixture(scope="module")
def busy() -> Iterator[Proc]:
    with running("busy.py") as proc:
        yield proc


def _counter(client: "probe.Client") -> int:
    result = client.eval("counter")
    assert result.ok, result.error
    return int(result.value or "0")


@pytest.fixture
def unharmed(busy: Proc) -> Iterator["probe.Client"]:
    """A client of the busy target; after the test, a normal query answers and the loop went on counting."""
    client = probe.connect(str(busy.pid), timeout=20.0)
    before = _counter(client)
    yield client
    assert busy.alive(), "the target died"
    rows = client.query_rows("SELECT pid FROM process.info")
    assert rows.rows == [[busy.pid]]
    # The window can be a few ms, in which a loaded machine may not have run the main thread at all:
    # what matters is that it counts on, so give it a moment (bounded) rather than one look.
    deadline = time.monotonic() + 5.0
    after = _counter(client)
    while after <= before and time.monotonic() < deadline:
        time.sleep(0.02)
        after = _counter(client)
    assert after > before, "the target's loop stopped counting (%d -> %d)" % (before, after)


# -- raw HTTP, for what no well-behaved client would send ----------------------------------------------

def _connect_unix(pid: int, timeout: float = 10.0) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(_paths.socket_path(pid))
    return sock


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:  # the agent closed with our unread bytes still queued: EOF for us
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _raw(pid: int, data: bytes, timeout: float = 10.0) -> Tuple[int, Dict[str, str], bytes]:
    """Send ``data`` as is, read the answer to the end; (status, headers, body)."""
    with _connect_unix(pid, timeout) as sock:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the agent answered and closed before it read everything
        answer = _read_all(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, headers, body


def _error_of(body: bytes) -> Dict[str, str]:
    error = json.loads(body.decode("utf-8"))["error"]
    assert error["message"], "an error must say why"
    return error


def _post(path: str, body: bytes, extra: str = "") -> bytes:
    return (("POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n%s\r\n" % (path, len(body), extra))
            .encode("latin-1") + body)


# -- SQL -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sql, why", [
    ("SELEC 1", "syntax error"),
    ("SELECT * FROM nope.nothing", "nope.nothing"),
    ("SELECT * FROM nothing_here", "nothing_here"),
    ("SELECT 1; SELECT 2", "one statement per query"),
    ("SELECT * FROM read_csv('/etc/passwd')", "file system operations are disabled"),
    ("SELECT * FROM read_text('/etc/hostname')", "file system operations are disabled"),
    ("SELECT * FROM glob('/etc/*')", "file system operations are disabled"),
    ("ATTACH 'file.db'", "ATTACH is not allowed"),
    ("INSTALL httpfs", "extensions are disabled"),
    ("LOAD httpfs", "extensions are disabled"),
    ("SET threads=8", "configuration is locked"),
    ("PRAGMA version", "PRAGMA is not allowed"),
    ("CREATE TABLE t (x INTEGER)", "only SELECT"),
    ("", "SQL"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 40 else None)
def test_refused_sql_says_why(unharmed, sql, why):
    with pytest.raises(probe.ProbeError) as caught:
        unharmed.query_rows(sql)
    assert caught.value.code in ("sql_error", "bad_request")
    assert why in str(caught.value)


def test_copy_is_refused_and_writes_no_file(unharmed, tmp_path):
    target = tmp_path / "x.csv"
    with pytest.raises(probe.ProbeError) as caught:
        unharmed.query_rows("COPY (SELECT 1) TO '%s'" % target)
    assert caught.value.code == "sql_error" and "COPY is not allowed" in caught.value.message
    with pytest.raises(probe.ProbeError) as caught:
        unharmed.query_rows("EXPLAIN ANALYZE COPY (SELECT 1) TO '%s'" % target)
    assert caught.value.code == "sql_error"
    assert not target.exists()


def test_attach_creates_no_database_file(unharmed, tmp_path):
    target = tmp_path / "file.db"
    with pytest.raises(probe.ProbeError) as caught:
        unharmed.query_rows("ATTACH '%s' AS other" % target)
    assert caught.value.code == "sql_error" and "ATTACH" in caught.value.message
    assert not target.exists()


def test_refused_sql_through_the_cli_exits_non_zero(busy, unharmed, tmp_path):
    target = tmp_path / "x.csv"
    result = run_cli(str(busy.pid), "query", "COPY (SELECT 1) TO '%s'" % target)
    assert result.code == 1
    assert "probe: error: COPY is not allowed" in result.err
    assert not target.exists()
    result = run_cli(str(busy.pid), "query", "SELEC 1")
    assert result.code == 1 and "syntax error" in result.err


def test_explain_analyze_cannot_change_the_database(target_factory):
    proc = target_factory("idle.py")
    client = probe.connect(str(proc.pid))
    assert client.query_rows("SELECT count(*) FROM python.backtrace").rows[0][0] > 0
    refused = []
    for sql in ("EXPLAIN ANALYZE CREATE TABLE scratch AS SELECT 42 AS x",
                "EXPLAIN ANALYZE DROP VIEW python.backtrace"):
        try:
            client.query_rows(sql)
        except probe.ProbeError as exc:
            refused.append(exc.code)
    # whatever was answered, the agent's own tables must still work
    assert client.query_rows("SELECT count(*) FROM python.backtrace").rows[0][0] > 0
    assert refused == ["sql_error", "sql_error"]


# -- time and row limits -------------------------------------------------------------------------------

def test_query_past_its_time_limit_is_interrupted(unharmed):
    started = time.monotonic()
    with pytest.raises(probe.ProbeError) as caught:
        unharmed.query_rows("SELECT count(*) FROM range(10000000000)", timeout=0.5)
    elapsed = time.monotonic() - started
    assert caught.value.code == "timeout" and "interrupted" in caught.value.message
    assert elapsed < 5.0, "a 0.5 s limit took %.1f s to answer" % elapsed


def test_a_short_time_limit_holds_after_many_queries_with_longer_ones(unharmed):
    """The agent's watchdog keeps finished queries' deadlines until they come due, without waking for
    them: a later query with a sooner deadline must still wake it, and many earlier ones must not
    delay that (they are compacted away)."""
    for _ in range(150):  # each leaves a cancelled 8 s deadline behind
        unharmed.query_rows("SELECT 1", timeout=8)
    started = time.monotonic()
    with pytest.raises(probe.ProbeError) as caught:
        unharmed.query_rows("SELECT count(*) FROM range(10000000000)", timeout=0.5)
    elapsed = time.monotonic() - started
    assert caught.value.code == "timeout"
    assert elapsed < 4.0, "a 0.5 s limit behind 8 s ones took %.1f s" % elapsed
    assert unharmed.query_rows("SELECT 42").rows == [[42]]


def test_query_timeout_through_the_cli(busy, unharmed):
    started = time.monotonic()
    result = run_cli(str(busy.pid), "query", "--query-timeout", "0.5", "SELECT count(*) FROM range(10000000000)",
                     timeout=30)
    assert time.monotonic() - started < 10.0
    assert result.code == 5, result.err
    assert "interrupted after 0.5 s" in result.err


def test_result_past_the_row_cap_is_truncated_and_flagged(busy, unharmed):
    rows = unharmed.query_rows("SELECT * FROM range(1000)", max_rows=10)
    assert rows.rows == [[i] for i in range(10)] and rows.truncated
    exact = unharmed.query_rows("SELECT * FROM range(10)", max_rows=10)
    assert len(exact.rows) == 10 and not exact.truncated

    table = unharmed.query("SELECT * FROM range(1000)", max_rows=10)
    assert table.num_rows == 10 and table.schema.metadata[b"probe.truncated"] == b"true"
    whole = unharmed.query("SELECT * FROM range(10)", max_rows=10)
    assert whole.schema.metadata[b"probe.truncated"] == b"false"

    cli = run_cli(str(busy.pid), "query", "--max-rows", "5", "SELECT * FROM range(100)")
    assert cli.code == 0, cli.err
    assert cli.out.splitlines()[-1] == "(5 rows) -- cut at --max-rows 5; raise it, or narrow the query"
    as_json = run_cli(str(busy.pid), "query", "--max-rows", "5", "-f", "json", "SELECT * FROM range(100)")
    assert as_json.code == 0 and len(json.loads(as_json.out)) == 5
    assert "cut at --max-rows 5" in as_json.err


# -- malformed HTTP ------------------------------------------------------------------------------------

_MALFORMED = {
    "garbage bytes": (b"\x16\x03\x01\x02\x00\x01\xfc\x03\x03 garbage\r\n\r\n", 400, "bad_request", "request line"),
    "bad request line": (b"GET\r\n\r\n", 400, "bad_request", "request line"),
    "not HTTP/1": (b"GET /v1/health HTTP/2.0\r\n\r\n", 400, "bad_request", "request line"),
    "header without colon": (b"GET /v1/health HTTP/1.1\r\nHost localhost\r\n\r\n", 400, "bad_request",
                             "header line"),
    "oversized headers": (b"GET /v1/health HTTP/1.1\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 4096) + b"\r\n\r\n",
                          413, "too_large", "headers larger"),
    "too many headers": (b"GET /v1/health HTTP/1.1\r\n"
                         + b"".join(b"X-H%d: v\r\n" % i for i in range(MAX_HEADERS + 10)) + b"\r\n",
                         413, "too_large", "headers"),
    "body over the limit": (("POST /v1/query HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1))
                            .encode(), 413, "too_large", "larger than the limit"),
    "negative length": (b"POST /v1/query HTTP/1.1\r\nContent-Length: -5\r\n\r\n", 400, "bad_request",
                        "Content-Length"),
    "non-JSON body": (_post("/v1/query", b"SELECT 1"), 400, "bad_request", "not valid JSON"),
    "not UTF-8 body": (_post("/v1/query", b"\xff\xfe\x00"), 400, "bad_request", "not valid JSON"),
    "JSON array body": (_post("/v1/query", b'["SELECT 1"]'), 400, "bad_request", "JSON object"),
    "no sql": (_post("/v1/query", b'{"query": "SELECT 1"}'), 400, "bad_request", "sql"),
    "max_rows not a number": (_post("/v1/query", b'{"sql": "SELECT 1", "max_rows": "all"}'), 400, "bad_request",
                              "max_rows"),
    "no code": (_post("/v1/eval", b'{"snippet": "1"}'), 400, "bad_request", "code"),
    "no table": (_post("/v1/rows", b'{}'), 400, "bad_request", "table"),
    "chunked body": (b"POST /v1/query HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"11\r\n{\"sql\":\"SELECT 1\"}\r\n0\r\n\r\n", 400, "bad_request", "chunked"),
    "unknown path": (b"GET /v1/nothing HTTP/1.1\r\n\r\n", 404, "not_found", "/v1/nothing"),
    "unknown table": (b"GET /v1/tables/nope.nothing HTTP/1.1\r\n\r\n", 404, "not_found", "nope.nothing"),
    "wrong method": (b"GET /v1/query HTTP/1.1\r\n\r\n", 400, "bad_request", "not allowed"),
    # str.isdigit() is true for '\xb2' (superscript two), and int() refuses more than 4300 digits
    "superscript length": (b"POST /v1/query HTTP/1.1\r\nContent-Length: \xb2\r\n\r\n{}", 400, "bad_request",
                           "Content-Length"),
    "5000-digit length": (b"POST /v1/query HTTP/1.1\r\nContent-Length: " + b"1" * 5000 + b"\r\n\r\n", 400,
                          "bad_request", "Content-Length"),
    "two lengths": (b"POST /v1/query HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 20\r\n\r\n{}", 400,
                    "bad_request", "Content-Length"),
    "LF line ends": (b"GET /v1/health HTTP/1.1\nHost: localhost\n\n", 400, "bad_request", "bare LF"),
    "one bare LF": (b"GET /v1/health HTTP/1.1\r\nHost: localhost\n\r\n", 400, "bad_request", "bare LF"),
    "bare CR in a header": (b"GET /v1/health HTTP/1.1\r\nHost: local\rhost\r\n\r\n", 400, "bad_request",
                            "header line"),
    "max_rows Infinity": (_post("/v1/query", b'{"sql": "SELECT 1", "max_rows": Infinity}'), 400, "bad_request",
                          "Infinity"),
    "max_rows -Infinity": (_post("/v1/query", b'{"sql": "SELECT 1", "max_rows": -Infinity}'), 400, "bad_request",
                           "Infinity"),
    "timeout NaN": (_post("/v1/query", b'{"sql": "SELECT 1", "timeout": NaN}'), 400, "bad_request", "NaN"),
    "max_rows 1e400": (_post("/v1/query", b'{"sql": "SELECT 1", "max_rows": 1e400}'), 400, "bad_request",
                       "out of range"),
    "deeply nested JSON": (_post("/v1/query", b'{"sql": "SELECT 1", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}"),
                           400, "bad_request", "nested too deeply"),
}


@pytest.mark.parametrize("name", list(_MALFORMED))
def test_malformed_http_gets_a_json_error(busy, unharmed, name):
    data, status, code, why = _MALFORMED[name]
    started = time.monotonic()
    got_status, headers, body = _raw(busy.pid, data, timeout=5.0)
    assert time.monotonic() - started < 3.0, "the answer took %.1f s" % (time.monotonic() - started)
    assert got_status == status
    assert headers.get("content-type") == "application/json"
    error = _error_of(body)
    assert error["code"] == code and why in error["message"], error


def test_garbage_without_an_end_is_dropped_without_harm(busy, unharmed):
    with _connect_unix(busy.pid) as sock:
        sock.sendall(os.urandom(3000).replace(b"\n", b"x"))  # no line end at all (a bare LF is refused)
        sock.shutdown(socket.SHUT_WR)  # never completes a request
        assert _read_all(sock) == b""  # nothing to answer; the agent just closes


def test_a_client_that_disconnects_mid_response_does_no_harm(busy, unharmed):
    sql = "SELECT repeat('x', 1000) AS s FROM range(5000)"  # about 5 MB of JSON, far past the socket buffers
    body = json.dumps({"sql": sql}).encode()
    with _connect_unix(busy.pid) as sock:
        sock.sendall(_post("/v1/query", body))
        assert sock.recv(12).startswith(b"HTTP/1.1")
    # the agent notices, ends that request's thread, and serves on
    deadline = time.monotonic() + 15.0
    while True:
        serving = unharmed.query_rows("SELECT count(*) FROM python.threads WHERE thread_name = 'probe-request'")
        if serving.rows[0][0] == 1:  # only the thread that answers this very query
            break
        assert time.monotonic() < deadline, "the abandoned request's thread is still there"
        time.sleep(0.05)
    assert unharmed.health()["pid"] == busy.pid


def test_a_silent_client_does_not_block_the_others(busy, unharmed):
    silent = [_connect_unix(busy.pid) for _ in range(3)]
    try:
        silent[1].sendall(b"GET /v1/hea")  # half a request line, then nothing
        answers = []

        def ask() -> None:
            answers.append(probe.connect(str(busy.pid), timeout=5.0).health()["pid"])

        started = time.monotonic()
        worker = threading.Thread(target=ask)
        worker.start()
        worker.join(10.0)
        assert answers == [busy.pid], "no health answer while silent clients held connections"
        assert time.monotonic() - started < 5.0
        assert unharmed.query_rows("SELECT 1 AS one").rows == [[1]]
    finally:
        for sock in silent:
            sock.close()


@contextmanager
def _agent_setting(client: "probe.Client", module: str, **values: float) -> Iterator[None]:
    """Set module globals of the agent inside the target (through eval) for one test; restored after."""
    ref = "__import__(%r, fromlist=['_'])" % module
    saved = {}
    for name, value in values.items():
        saved[name] = client.eval("getattr(%s, %r, 'absent')" % (ref, name)).value
        assert client.eval("setattr(%s, %r, %r)" % (ref, name, value)).ok
    try:
        yield
    finally:
        for name, old in saved.items():
            code = ("delattr(%s, %r)" % (ref, name) if old == "'absent'" else "setattr(%s, %r, %s)" % (ref, name, old))
            assert client.eval(code).ok


@pytest.mark.parametrize("what", ["head", "body"])
def test_a_request_refused_while_still_being_sent_gets_its_answer(busy, unharmed, what):
    # The agent answers after reading 16 kB of a 1 MB head (or before reading a body over the limit).
    # Closing then would make the client's send fail with EPIPE before it could read the answer.
    if what == "head":
        data, status = b"GET /v1/health HTTP/1.1\r\nX-Big: " + b"a" * (1 << 20), 413
    else:
        data = (b"POST /v1/query HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (2 * MAX_BODY_BYTES)
                + b" " * (2 * MAX_BODY_BYTES))
        status = 413
    with _connect_unix(busy.pid) as sock:
        sock.sendall(data)  # no BrokenPipeError: the agent reads and discards the rest
        answer = _read_all(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), head[:100]
    assert _error_of(body)["code"] == "too_large"


def test_a_request_refused_early_through_the_client(busy, unharmed):
    sql = "SELECT '%s' AS s" % ("x" * (2 * MAX_BODY_BYTES))
    with pytest.raises(probe.ProbeError) as caught:
        unharmed.query_rows(sql)
    assert caught.value.code == "too_large" and "larger than the limit" in caught.value.message


_BIG_QUERY = json.dumps({"sql": "SELECT repeat('x', 1000) AS s FROM range(1000)"}).encode()  # ~1 MB of JSON


def _answer_head(sock: socket.socket) -> Tuple[int, bytes]:
    """Content-Length of the answer on ``sock``, and the body bytes read along with the head."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(4096)
        assert chunk, "no answer"
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), head[:100]
    lengths = [line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
    assert len(lengths) == 1, head
    return int(lengths[0].split(b":")[1]), rest


def test_a_slow_reader_that_keeps_reading_gets_the_whole_answer(busy, unharmed):
    # Limits lowered for the test: given up after 1 s without progress, or 1 s + 1 s per 100 kB in all.
    # WRITE_TIMEOUT_S is the one total deadline of before (the whole answer within it), lowered alike.
    with _agent_setting(unharmed, "probe.agent.http", SEND_STALL_S=1.0, SEND_BASE_S=1.0), \
            _agent_setting(unharmed, "probe.agent.listener", WRITE_TIMEOUT_S=1.0):
        with _connect_unix(busy.pid) as sock:
            sock.sendall(_post("/v1/query", _BIG_QUERY))
            length, got = _answer_head(sock)
            received = len(got)
            started = time.monotonic()
            while received < length:  # about 320 kB/s: the answer takes 3 s, never 1 s without a byte
                chunk = sock.recv(16384)
                if not chunk:
                    break
                received += len(chunk)
                time.sleep(0.05)
            took = time.monotonic() - started
        assert received == length, "got %d of %d bytes in %.1f s" % (received, length, took)
        assert took > 1.5, "the answer was read in %.1f s, too fast to test a slow reader" % took


def test_a_reader_that_stops_is_given_up_on_and_can_tell(busy, unharmed):
    with _agent_setting(unharmed, "probe.agent.http", SEND_STALL_S=1.0):
        with _connect_unix(busy.pid) as sock:
            sock.sendall(_post("/v1/query", _BIG_QUERY))
            length, got = _answer_head(sock)
            time.sleep(3.0)  # reads nothing for longer than the agent waits for progress
            rest = _read_all(sock)
        assert len(got) + len(rest) < length, "a stalled reader still got the whole answer"


@pytest.mark.parametrize("answer, why", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 10, "after 10 of the 100 bytes"),
    (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + b"x" * 10, "without a valid Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n" + b"x" * 10, "without a valid Content-Length"),
])
def test_the_client_tells_an_answer_cut_short(answer, why):
    from probe.client import transport

    directory = tempfile.mkdtemp(prefix="probe-short-")
    path = os.path.join(directory, "s.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    server.settimeout(10.0)

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with pytest.raises(probe.ProbeError) as caught:
            transport.request(transport.UnixAddress(path), "GET", "/v1/health", timeout=5.0)
        assert why in str(caught.value)
    finally:
        thread.join(10.0)
        server.close()
        shutil.rmtree(directory, ignore_errors=True)


def test_when_every_slot_is_taken_a_new_request_is_answered_busy(busy, unharmed, tmp_path):
    from probe.agent.listener import MAX_CONNECTIONS

    started = tmp_path / "started"
    snippet = "open(%r, 'a').write('x'); __import__('time').sleep(3)" % str(started)
    outcomes: List[str] = []

    def hold() -> None:
        result = probe.connect(str(busy.pid), timeout=20.0).eval(snippet, timeout=10.0)
        outcomes.append("ok" if result.ok else str(result.error))

    with _agent_setting(unharmed, "probe.agent.listener", BUSY_WAIT_S=1.0):
        holders = [threading.Thread(target=hold, daemon=True) for _ in range(MAX_CONNECTIONS)]
        for thread in holders:
            thread.start()
        deadline = time.monotonic() + 10.0
        while not started.exists() or len(started.read_text()) < MAX_CONNECTIONS:
            assert time.monotonic() < deadline, "the slot-holding snippets did not all start"
            time.sleep(0.01)
        asked = time.monotonic()
        status, headers, body = _raw(busy.pid, b"GET /v1/health HTTP/1.1\r\n\r\n", timeout=10.0)
        waited = time.monotonic() - asked
        for thread in holders:
            thread.join(20.0)
    assert status == 503 and _error_of(body)["code"] == "busy", (status, body)
    assert 0.8 < waited < 2.9, "answered busy after %.1f s (the wait is 1 s, and the slots free at 3 s)" % waited
    assert outcomes == ["ok"] * MAX_CONNECTIONS


# -- eval ----------------------------------------------------------------------------------------------

def test_eval_that_raises_exits_non_zero_with_the_traceback(busy, unharmed):
    code = "def explode():\n    raise ValueError('boom from the snippet')\nexplode()"
    result = run_cli(str(busy.pid), "eval", code)
    assert result.code != 0
    assert "Traceback" in result.err and "ValueError: boom from the snippet" in result.err
    assert "in explode" in result.err
    assert "probe/agent" not in result.err  # the agent's own frames are not shown


def test_eval_with_a_syntax_error_says_where(busy, unharmed):
    result = run_cli(str(busy.pid), "eval", "def (")
    assert result.code != 0 and "SyntaxError" in result.err


def test_eval_that_never_returns_is_interrupted(busy, unharmed):
    started = time.monotonic()
    result = unharmed.eval("while True: pass", timeout=0.5)
    assert time.monotonic() - started < 5.0
    assert result.timed_out and not result.ok
    assert "did not finish within 0.5 s" in (result.error or "")
    deadline = time.monotonic() + 10.0
    while unharmed.query_rows("SELECT count(*) FROM python.threads WHERE thread_name = 'probe-eval'").rows[0][0]:
        assert time.monotonic() < deadline, "the interrupted snippet's thread is still running"
        time.sleep(0.05)


def test_eval_timeout_through_the_cli(busy, unharmed):
    started = time.monotonic()
    result = run_cli(str(busy.pid), "eval", "--eval-timeout", "0.5", "while True: pass", timeout=30)
    assert time.monotonic() - started < 10.0
    assert result.code != 0
    assert "did not finish within 0.5 s" in result.err


def test_eval_switched_off_is_forbidden(target_factory):
    proc = target_factory("idle.py", env=target_env(PROBE_EVAL="0"))
    result = run_cli(str(proc.pid), "eval", "1 + 1")
    assert result.code == 4
    assert "eval is switched off" in result.err and "PROBE_EVAL=0" in result.err
    assert result.out == ""
    client = probe.connect(str(proc.pid))
    with pytest.raises(probe.ProbeError) as caught:
        client.eval("open('/tmp/should-not-exist', 'w')")
    assert caught.value.code == "forbidden"
    assert client.health()["capabilities"]["eval"] is False
    assert client.query_rows("SELECT pid FROM process.info").rows == [[proc.pid]]  # read-only, still serving
