"""The client against a host helper that is older, buggy or hostile: whatever ``GET /v1/ranks`` answers,
``probe HOST:PORT ranks`` and ``--all-ranks`` never end in a traceback. A member with a field that is not
what a helper sends is left out and named on stderr with the helper's address; an answer that cannot be
used at all is refused with an error naming the helper. The helper is a fake over loopback; the rank that
answers is a real agent listening on TCP."""

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Iterator, List, Tuple

import pytest

import hmac_auth
from procs import run_cli, scaled, target_env

TOKEN = "cluster-helper-answer-token"


class FakeHelper:
    """A loopback server that answers every request with ``status`` and ``body`` (bytes, or JSON of it)."""

    def __init__(self, status: int, body: Any) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode("utf-8")

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                if self.path == "/v1/hello":  # it holds the job's token: what it answers next is the test
                    hello = hmac_auth.hello_body(self.headers.get("X-Probe-Nonce", ""), TOKEN,
                                                 self.connection.getsockname())
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(hello)))
                    self.end_headers()
                    self.wfile.write(hello)
                    return
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_POST = do_GET  # noqa: N815

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.1,), daemon=True)
        self.thread.start()

    @property
    def target(self) -> str:
        """The job's address as a user types it: the helper listens one port below."""
        return "127.0.0.1:%d" % (self.port + 1)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@contextmanager
def fake_helper(status: int, body: Any) -> Iterator[FakeHelper]:
    helper = FakeHelper(status, body)
    try:
        yield helper
    finally:
        helper.close()


def _member(number: int, at: int, **changes: Any) -> Dict[str, Any]:
    """Rank ``number`` on port ``at``, as a helper lists a rank of another node (its host is not the
    helper's own, so its own ``helper`` field is used); ``changes`` replace fields."""
    member = {"rank": number, "local_rank": number, "world_size": 8, "node": 1, "host": "127.0.0.1", "port": at,
              "pid": 1000 + number, "state": "running", "restarts": 0, "heartbeat_age": 0.1,
              "helper": "127.0.0.1:%d" % (at - 1)}
    member.update(changes)
    return member


def _answer(members: Any, **changes: Any) -> Dict[str, Any]:
    answer = {"helper": True, "host": "node0", "token_file": None, "members": members}
    answer.update(changes)
    return answer


def _cli(*args: str, timeout: float = 60.0):
    return run_cli(*args, env=target_env(probe=False, PROBE_TOKEN=TOKEN), timeout=scaled(timeout))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# What an older or hostile helper may put in one member; each such member is left out, and says why.
BAD_FIELDS: List[Tuple[str, Any, str]] = [
    ("helper", "nonsense", "helper"),  # the case of issue 17, item 10: int('nonsense') in the client
    ("helper", "127.0.0.1:99999", "helper"),
    ("helper", "127.0.0.1:", "helper"),
    ("helper", 9699, "helper"),
    ("helper", "\x1b]52;c;aGk=\x07:9699", "helper"),
    ("port", "9700", "port"),
    ("port", 0, "port"),
    ("port", 1 << 70, "port"),
    ("port", True, "port"),
    ("rank", -1, "rank"),
    ("rank", 9.5, "rank"),
    ("rank", None, "rank"),
    ("host", "", "host"),
    ("host", "a" * 300, "host"),
    ("host", "evil\x1b[2Jhost", "host"),
    ("host", ["127.0.0.1"], "host"),
    ("pid", "1234", "pid"),
    ("pid", -5, "pid"),
    ("state", "r\x1b[31m", "state"),
    ("state", {"a": 1}, "state"),
    ("local_rank", -1, "local_rank"),
    ("node", "1", "node"),
    ("world_size", 0, "world_size"),
    ("restarts", 1.5, "restarts"),
    ("heartbeat_age", "soon", "heartbeat_age"),
    ("heartbeat_age", -1.0, "heartbeat_age"),
]


@pytest.fixture(scope="module")
def bad_field_runs(request) -> Dict[int, Tuple[int, Any]]:
    """``probe HOST:PORT ranks -f json`` against a fake helper of its own for each case of BAD_FIELDS that this
    session runs: case index -> (the helper's port, the CLI's result). Run several at a time: each CLI spends
    most of its 1.5 s asking its helper again for the ranks the bad member leaves missing (the client's
    WHOLE_LIST_S), sleeping, not computing. Every case is a process and a helper of its own, as alone."""
    wanted = sorted({item.callspec.params["case"] for item in request.session.items if item.module is request.module
                     and "case" in getattr(getattr(item, "callspec", None), "params", {})})
    helpers: Dict[int, FakeHelper] = {}
    try:
        for case in wanted:
            field, value, _ = BAD_FIELDS[case]
            members = [_member(0, 9700), _member(1, 9701, **{field: value}), _member(2, 9702)]
            helpers[case] = FakeHelper(200, _answer(members))
        with ThreadPoolExecutor(6) as pool:
            results = dict(zip(wanted, pool.map(lambda c: _cli(helpers[c].target, "ranks", "-f", "json"), wanted)))
    finally:
        for helper in helpers.values():
            helper.close()
    return {case: (helpers[case].port, results[case]) for case in wanted}


@pytest.mark.parametrize("case", range(len(BAD_FIELDS)), ids=[("%s=%r" % (f, v))[:40] for f, v, _ in BAD_FIELDS])
def test_ranks_leaves_out_a_member_it_cannot_use_and_says_why(case: int, bad_field_runs) -> None:
    named = BAD_FIELDS[case][2]
    port, result = bad_field_runs[case]
    assert "Traceback" not in result.err, result.err
    assert result.code == 7, (result.code, result.err)  # a partial list: not the whole job
    assert [row["rank"] for row in json.loads(result.out)] == [0, 2]
    assert "127.0.0.1:%d" % port in result.err, result.err  # the helper is named
    assert named in result.err and "left out" in result.err, result.err
    assert "\x1b" not in result.err, result.err


def test_nan_and_infinite_ages_and_a_rank_named_twice_are_left_out() -> None:
    body = (b'{"host": "node0", "members": [%s, %s, %s, %s]}' % (
        json.dumps(_member(0, 9700)).encode(), json.dumps(_member(1, 9701)).replace("0.1", "NaN").encode(),
        json.dumps(_member(2, 9702)).replace("0.1", "Infinity").encode(), json.dumps(_member(0, 9703)).encode()))
    with fake_helper(200, body) as helper:
        result = _cli(helper.target, "ranks", "-f", "json")
    assert "Traceback" not in result.err, result.err
    assert result.code == 7, (result.code, result.err)  # a partial list
    rows = json.loads(result.out)
    assert [(row["rank"], row["port"]) for row in rows] == [(0, 9700)]
    assert "heartbeat_age" in result.err and "rank 0 again" in result.err, result.err


# Answers that cannot be used at all: an error naming the helper, never a traceback.
BAD_ANSWERS: List[Tuple[str, int, Any]] = [
    ("a list", 200, [1, 2, 3]),
    ("members not a list", 200, _answer({"0": "x"})),
    ("no member usable", 200, _answer([_member(0, 9700, helper="nonsense"), {"rank": "x"}, "member"])),
    ("its host not a host", 200, _answer([_member(0, 9700)], host="\x1b]0;pwned\x07")),
    ("too many members", 200, b'{"host": "node0", "members": [' + b",".join([b"{}"] * 300000) + b"]}"),
    ("nested deeply", 200, b"[" * 200000 + b"]" * 200000),
    ("an error that is a string", 500, {"error": "boom"}),
    ("an error with odd fields", 403, {"error": {"code": ["forbidden"], "message": 7, "hint": {"a": 1}}}),
    ("a number too long", 200, b'{"members": [], "node": 1' + b"0" * 5000 + b"}"),
]


@pytest.mark.parametrize("what,status,body", BAD_ANSWERS, ids=[w for w, _, _ in BAD_ANSWERS])
def test_an_answer_that_cannot_be_used_is_refused_with_the_helper_named(what: str, status: int, body: Any) -> None:
    with fake_helper(status, body) as helper:
        result = _cli(helper.target, "ranks", timeout=120)
    assert "Traceback" not in result.err, result.err
    assert result.code not in (0, 1), (result.code, result.err)  # 1: an internal error
    assert "127.0.0.1:%d" % helper.port in result.err, result.err
    assert "\x1b" not in result.err, result.err


def test_a_bad_token_file_is_not_shown() -> None:
    bad = "/tmp/x\x1b]52;c;aGk=\x07" + "y" * 5000
    with fake_helper(200, _answer([_member(0, 9700, world_size=1)], token_file=bad)) as helper:
        result = _cli(helper.target, "ranks")
    assert "Traceback" not in result.err, result.err
    assert result.code == 0, (result.code, result.err)
    assert "\x1b" not in result.err and "yyyy" not in result.err, result.err


def test_all_ranks_backtrace_reads_the_good_ranks_and_names_the_members_left_out(target_factory) -> None:
    """One real rank (an agent on TCP) among members a hostile helper made up: the backtrace of the real
    one, the others named as left out, no traceback (before, int('nonsense') ended it in one)."""
    port = _free_port()
    proc = target_factory("idle.py", env=target_env(PROBE_LISTEN="127.0.0.1:%d" % port, PROBE_TOKEN=TOKEN))
    deadline = time.monotonic() + scaled(30)
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "the agent does not listen on %d" % port
            time.sleep(0.05)
    members = [_member(0, port, pid=proc.pid), _member(1, 9701, helper="nonsense"),
               _member(2, 9702, helper="127.0.0.1:x"), _member(3, 9703, port="9703")]
    with fake_helper(200, _answer(members)) as helper:
        result = _cli(helper.target, "--all-ranks", "backtrace")
        shown = _cli(helper.target, "ranks")
    assert "Traceback" not in result.err and "Traceback" not in shown.err, result.err + shown.err
    assert result.code == 7, (result.code, result.err)  # three members left out: a partial answer
    assert "data_loader_wait" in result.out, result.out
    assert result.err.count("left out") >= 1 and "127.0.0.1:%d" % helper.port in result.err, result.err
    for rank in (1, 2, 3):
        assert "member %d" % rank in result.err, result.err
    assert shown.code == 7 and str(port) in shown.out and "(1 row)" in shown.out, shown
