"""Across ranks through the node helpers (``--via helpers``, ``POST /v1/gather``): a real torchrun job on
CPU whose rank 1 holds its GIL in a C call; the grouped answers equal the direct path's, the blocked rank
is read from outside by its node helper, a killed rank is named with how it died, and a malformed gather
is refused with a clear 400 while the helper keeps serving."""

import json
import os
import signal
import socket
import time

import pytest

from probe import _paths
from probe.client import transport
import hmac_auth
from procs import run_cli, scaled
from test_cluster import _until, needs_torchrun, torchrun_job

pytestmark = needs_torchrun


@pytest.fixture(scope="module")
def job():
    """4 ranks of tests/targets/rank_states.py; rank 1 holds its GIL; torchrun looks at its ranks once a
    minute, so a rank killed by a test stays dead (unreaped) for the rest of the module."""
    with torchrun_job("rank_states.py", 4, extra=("--monitor-interval=60",), GIL_RANK="1") as (port, pids):
        master = "127.0.0.1:%d" % port
        _until(lambda: run_cli(master, "ranks", "-f", "json").code == 0, scaled(20), "the ranks listed")
        yield port, pids


def _token(port: int) -> str:
    with open(_paths.job_token_path(port)) as handle:
        return handle.read().strip()


def _gather(port: int, body: bytes, token: str = "") -> transport.HttpResponse:
    return transport.request(transport.TcpAddress("127.0.0.1", port - 1), "POST", "/v1/gather", body,
                             None, scaled(20), token=token or _token(port))


def test_a_malformed_gather_gets_a_clear_400_and_the_helper_keeps_serving(job):
    port, pids = job
    for body, said in ((b"[1, 2]", "JSON object"), (b'{"op": "eval"}', "op must be"),
                       (b'{"op": "backtrace", "deadline": -1}', "deadline must be seconds"),
                       (b'{"op": "backtrace", "ranks": "0-3"}', "ranks must be a list"),
                       (b'{"op": "query"}', "needs sql"), (b'{"op": "backtrace", "max_in_flight": 10000}',
                                                          "max_in_flight must be an integer"),
                       (b'{"op": "evidence", "prefetch": "yes"}', "prefetch must be true or false"),
                       (b'{"op": "evidence", "known": ["ABCDEF0123456789"]}', "known must be a list"),
                       (json.dumps({"op": "evidence", "known": ["0" * 16] * 257}).encode(), "known must be a list")):
        answer = _gather(port, body)
        assert answer.status == 400, (body, answer.status, bytes(answer.body))
        error = json.loads(bytes(answer.body))["error"]
        assert error["code"] == "bad_request" and said in error["message"], (body, error)
    wrong = hmac_auth.authorization(port - 1, "not-the-token", "POST", "/v1/gather", b'{"op": "backtrace"}')
    refused = transport.request(transport.TcpAddress("127.0.0.1", port - 1), "POST", "/v1/gather", b'{"op": "backtrace"}',
                                {"Authorization": wrong}, scaled(20))
    assert refused.status == 401
    # still serving: a good gather answers, grouped
    answer = _gather(port, json.dumps({"op": "backtrace", "ranks": [0, 2], "deadline": 5}).encode())
    assert answer.status == 200, bytes(answer.body)
    raw = json.loads(bytes(answer.body))
    assert sorted(raw["ranks"]) == [0, 2] and raw["failed"] == []
    main = raw["threads"]["MainThread"]
    assert len(main) == 1 and main[0][1] == [0, 2]  # one stack, both ranks
    assert "wait_for_work" in [func for func, _file, _line in json.loads(main[0][0])]


def test_an_evidence_gather_names_the_stacks_the_client_holds_by_their_digests(job):
    """The stacks a request names as held come back as ``#DIGEST``; the others in full; and the client reads
    both (probe.diagnose.gathered)."""
    from types import SimpleNamespace

    from probe.diagnose import gather, gathered

    port, pids = job
    body = {"op": "evidence", "ranks": [0, 2], "deadline": 10}
    first = _gather(port, json.dumps(body).encode())
    assert first.status == 200, bytes(first.body)
    texts = json.loads(bytes(first.body))["evidence"]["stacks"]
    assert texts and not any(t.startswith("#") for t in texts)
    held = gathered.digest(texts[0])
    again = _gather(port, json.dumps(dict(body, known=[held, "0" * 16])).encode())
    assert again.status == 200, bytes(again.body)
    raw = json.loads(bytes(again.body))["evidence"]
    assert "#" + held in raw["stacks"] and not any(t.startswith("#") and t != "#" + held for t in raw["stacks"])
    asked = {r: SimpleNamespace(rank=r, host="127.0.0.1") for r in (0, 2)}
    known: dict = {}
    gathered.decode(json.loads(bytes(first.body))["evidence"], asked, known, 100.0, gather)
    evs = gathered.decode(raw, asked, known, 100.0, gather)
    assert sorted(ev.rank for ev in evs) == [0, 2] and all(ev.stacks().get("MainThread") for ev in evs)
    with pytest.raises(gathered.Bad, match="digest this client does not hold"):
        gathered.decode(raw, asked, {}, 100.0, gather)


def test_through_the_helpers_the_grouped_backtrace_equals_the_direct_one_and_a_gil_holder_is_read_from_outside(job):
    port, pids = job
    master = "127.0.0.1:%d" % port
    direct = run_cli(master, "--via", "direct", "--all-ranks", "backtrace")
    helped = run_cli(master, "--via", "helpers", "--all-ranks", "backtrace")
    assert direct.code == 0 and helped.code == 0, (direct.err, helped.err)
    assert helped.out == direct.out
    assert "ranks 0,2-3 (3)" in helped.out and "rank 1 (1)  [stack of rank 1 read from outside]" in helped.out
    assert "> hold_the_gil" in helped.out
    assert "rank 1 (127.0.0.1:%d)" % (port + 1) in helped.err  # where its stacks came from

    # the helper itself read rank 1 from outside (the client asked no rank)
    raw = json.loads(bytes(_gather(port, b'{"op": "backtrace", "deadline": 5}').body))
    assert [rank for rank, _note in raw["outside"]] == [1]
    funcs = {tuple(ranks): [func for func, _file, _line in json.loads(stack)]
             for stack, ranks in raw["threads"]["MainThread"]}
    assert sorted(funcs) == [(0, 2, 3), (1,)], funcs
    assert "wait_for_work" in funcs[(0, 2, 3)] and funcs[(1,)][0] == "hold_the_gil", funcs

    sql = "SELECT func FROM python.backtrace WHERE depth = 0 AND thread_name = 'MainThread'"
    merge = "SELECT func, list(rank ORDER BY rank) AS ranks FROM result GROUP BY ALL ORDER BY func"
    rows = {via: run_cli(master, "--via", via, "--all-ranks", "query", sql, "--merge", merge, "-f", "json")
            for via in ("direct", "helpers")}
    assert rows["helpers"].code == 0, rows["helpers"].err
    assert json.loads(rows["helpers"].out) == json.loads(rows["direct"].out)
    got = {r["func"]: r["ranks"] for r in json.loads(rows["helpers"].out)}
    assert got.pop("hold_the_gil") == [1] and list(got.values()) == [[0, 2, 3]], got
    plain = {via: run_cli(master, "--via", via, "--all-ranks", "query", "SELECT pid FROM process.info", "-f", "json")
             for via in ("direct", "helpers")}
    assert plain["helpers"].code == plain["direct"].code == 7, plain["helpers"].err  # process.info needs rank 1's agent
    assert json.loads(plain["helpers"].out) == json.loads(plain["direct"].out)
    assert [r["pid"] for r in json.loads(plain["helpers"].out)] == [pids[0], pids[2], pids[3]]
    assert "process.info needs the agent" in plain["helpers"].err


def test_through_the_helpers_diagnose_gives_the_direct_verdict_and_rank_1_is_read_on_its_node(job):
    """diagnose's evidence gathered by the node helpers (one request a node a look, ``op: evidence``):
    the same verdict as asked rank by rank; rank 1, whose GIL is held, read from outside by its helper."""
    port, pids = job
    master = "127.0.0.1:%d" % port
    got = {via: run_cli(master, "--via", via, "diagnose", "--json", timeout=scaled(60))
           for via in ("direct", "helpers")}
    reports = {}
    for via, result in got.items():
        assert result.code == 11, (via, result.code, result.out[-2000:], result.err[-2000:])  # stuck: rank 1 cannot run
        reports[via] = json.loads(result.out)
    direct, helped = reports["direct"], reports["helpers"]
    assert helped["status"] == direct["status"] == "stuck"
    assert [(v["kind"], v["culprits"]) for v in helped["verdicts"]] == \
        [(v["kind"], v["culprits"]) for v in direct["verdicts"]], (helped["verdicts"], direct["verdicts"])
    assert helped["verdicts"][0]["culprits"] == [1] and "hold_the_gil" in json.dumps(helped["verdicts"][0])

    # the helper's own answer: each rank's evidence, rank 1's stacks read from outside on its node
    answer = _gather(port, json.dumps({"op": "evidence", "deadline": 10, "since_s": 0}).encode())
    assert answer.status == 200, bytes(answer.body)[:500]
    raw = json.loads(bytes(answer.body))
    ranks = {item["rank"]: item for item in raw["evidence"]["ranks"]}
    assert sorted(ranks) == [0, 1, 2, 3] and raw["failed"] == []
    assert ranks[1]["state"] == "gil_held" and ranks[0].get("state", "answering") == "answering"
    stacks = [json.loads(text) for text in raw["evidence"]["stacks"]]
    main_of = {r: next(stacks[t[4]] for t in item["frames"] if t[3]) for r, item in ranks.items()}
    assert main_of[1][0][1] == "hold_the_gil", main_of[1][:2]
    assert any(f[1] == "wait_for_work" for f in main_of[0])
    assert len({t[4] for r in (0, 2, 3) for t in ranks[r]["frames"] if t[3]}) == 1  # one main stack for the three


def test_through_the_helpers_a_killed_rank_is_named_and_the_answer_is_partial(job):
    port, pids = job
    master = "127.0.0.1:%d" % port
    os.kill(pids[3], signal.SIGKILL)
    _until(lambda: json.loads(run_cli(master, "ranks", "-f", "json").out)[3]["state"] == "dead", scaled(10),
           "rank 3 shown dead")
    helped = run_cli(master, "--via", "helpers", "--all-ranks", "backtrace")
    assert helped.code == 7, (helped.code, helped.out, helped.err)  # a partial answer
    assert "ranks 0,2 (2)" in helped.out and "rank 1 (1)  [stack of rank 1 read from outside]" in helped.out
    err = helped.err.replace(socket.gethostname(), "vm")
    assert "1 of 4 ranks gave no result (rank 3)" in err and "rank 3 (vm)" in err
    assert "killed by signal 9" in err
    direct = run_cli(master, "--via", "direct", "--all-ranks", "backtrace")
    assert direct.code == 7 and direct.out == helped.out

    rows = run_cli(master, "--via", "helpers", "--all-ranks", "query", "SELECT pid FROM process.info", "-f", "json")
    assert rows.code == 7, rows.err
    assert [r["pid"] for r in json.loads(rows.out)] == [pids[0], pids[2]]  # rank 1's agent cannot run SQL on it
    assert "rank 3" in rows.err and "killed by signal 9" in rows.err


def test_a_gathers_answer_hands_out_the_next_nonce_single_use_and_a_refused_one_is_retried_with_a_hello(job):
    """The next gather to a helper needs no hello (the answer's ``X-Probe-Next-Nonce``: a server nonce and
    the helper's proof for our own fresh client nonce); a nonce is taken back once, and a kept one the
    helper refuses is retried with a hello; a malformed ask gets no next nonce and the answer stands; a
    next nonce whose proof does not match the token, or that is oversized, is not kept."""
    from probe.client import proof, via_helpers

    port, _pids = job
    address, token = transport.TcpAddress("127.0.0.1", port - 1), _token(port)
    body = json.dumps({"op": "backtrace", "ranks": [0, 2], "deadline": 5}).encode()
    place = proof._place(address, token.encode())
    proof._kept.pop(place, None)
    first = via_helpers._ask_gather(address, body, scaled(20), token)
    assert first.status == 200 and not proof.reused()  # a hello first
    kept = proof._kept.get(place)
    assert kept is not None, first.headers
    second = via_helpers._ask_gather(address, body, scaled(20), token)
    assert second.status == 200 and proof.reused()  # no hello: the kept nonce
    assert proof._kept.get(place) not in (None, kept)  # and the next one kept

    # single-use: the same nonce again is refused by the helper, and the gather is asked again with a hello
    used = proof._kept.get(place)
    again = via_helpers._ask_gather(address, body, scaled(20), token)
    assert again.status == 200 and proof.reused()
    proof._kept[place] = used
    refused_then_retried = via_helpers._ask_gather(address, body, scaled(20), token)
    assert refused_then_retried.status == 200 and not proof.reused()  # its retry went with a hello

    # the same through the one-thread fan-out (probe.client.multiplex): a hello, then the kept nonce (a new one
    # kept), and a used one the helper refuses retried with a hello
    from probe.client import multiplex

    def steps():
        return via_helpers._gather_steps(address, body, scaled(20), token)

    proof._kept.pop(place, None)
    (first_one,) = multiplex.run([steps], 1, scaled(20))
    assert first_one.error is None and first_one.value.status == 200, first_one
    kept = proof._kept.get(place)
    assert kept is not None
    (second_one,) = multiplex.run([steps], 1, scaled(20))
    assert second_one.error is None and second_one.value.status == 200, second_one
    assert proof._kept.get(place) not in (None, kept)
    proof._kept[place] = kept  # used already: refused by the helper, the gather asked again with a hello
    (retried,) = multiplex.run([steps], 1, scaled(20))
    assert retried.error is None and retried.value.status == 200, retried
    assert proof._kept.get(place) not in (None, kept)

    # a malformed client nonce: the gather is answered, with no next nonce
    auth = hmac_auth.authorization(port - 1, token, "POST", "/v1/gather", body)
    odd = transport.request(address, "POST", "/v1/gather", body, {"Authorization": auth, proof.NEXT_HEADER: "zz" * 40},
                            scaled(20))
    assert odd.status == 200 and proof.NEXT_HEADER.lower() not in odd.headers

    # what the client keeps: only a proof for our token and our nonce, of a bounded size
    asked = proof.ask_next()
    auth = hmac_auth.authorization(port - 1, token, "POST", "/v1/gather", body)
    answer = transport.request(address, "POST", "/v1/gather", body, dict(asked, Authorization=auth), scaled(20))
    assert answer.status == 200 and proof.NEXT_HEADER.lower() in answer.headers
    proof._kept.pop(place, None)
    proof.keep_next(address, "not-the-token", asked, answer)
    proof.keep_next(address, token, proof.ask_next(), answer)  # a nonce we did not send
    bloated = transport.HttpResponse(200, {proof.NEXT_HEADER.lower(): " " * 5000 + answer.headers[
        proof.NEXT_HEADER.lower()]}, b"")
    proof.keep_next(address, token, asked, bloated)
    assert place not in proof._kept
    proof.keep_next(address, token, asked, answer)
    assert place in proof._kept


def _hello_bytes(connection: str, nonce: str = "ab" * 16) -> bytes:
    return ("GET /v1/hello HTTP/1.1\r\nHost: x\r\nX-Probe-Nonce: %s\r\nConnection: %s\r\nContent-Length: 0\r\n\r\n"
            % (nonce, connection)).encode()


def _answer_on(sock: socket.socket) -> tuple:
    """(status, headers) of one whole answer read from ``sock`` (its body by its Content-Length)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, "the connection closed without an answer (%r)" % buf[:200]
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "the answer was cut short"
        body += chunk
    assert len(body) == int(headers["content-length"]), "bytes past the answer"
    return int(lines[0].split(" ")[1]), headers


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


def test_a_helper_keeps_a_connection_only_where_asked_and_never_an_agent(job):
    """A node helper keeps a plain connection for the next request where the request asks
    (``Connection: keep-alive``): the next request on it is answered as on a fresh one; one that asks for
    close, or that sent more than one request at once, is answered and closed; a kept connection left
    idle is closed after the listener's wait; a rank's agent keeps none."""
    from probe.agent.listener import KEEP_IDLE_S

    port, _pids = job
    with socket.create_connection(("127.0.0.1", port - 1), timeout=scaled(20)) as sock:
        for _ in range(3):  # asked for, and kept: three answers on one connection
            sock.sendall(_hello_bytes("keep-alive"))
            status, headers = _answer_on(sock)
            assert status == 200 and headers["connection"] == "keep-alive", headers
        # each request on a kept connection is authorized on its own: a gather without a proof is refused
        body = json.dumps({"op": "backtrace", "ranks": [0], "deadline": 5}).encode()
        sock.sendall(b"POST /v1/gather HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\nContent-Length: %d\r\n\r\n"
                     % len(body) + body)
        status, headers = _answer_on(sock)
        assert status == 401, (status, headers)
        sock.sendall(_hello_bytes("close"))
        status, headers = _answer_on(sock)
        assert status == 200 and headers["connection"] == "close", headers
        assert _closed_within(sock, scaled(5))

    with socket.create_connection(("127.0.0.1", port - 1), timeout=scaled(20)) as sock:
        sock.sendall(_hello_bytes("keep-alive") * 2)  # the second before the first's answer: not kept
        status, headers = _answer_on(sock)
        assert status == 200 and headers["connection"] == "close", headers
        assert _closed_within(sock, scaled(5))

    with socket.create_connection(("127.0.0.1", port - 1), timeout=scaled(20)) as sock:
        sock.sendall(_hello_bytes("keep-alive"))
        assert _answer_on(sock)[1]["connection"] == "keep-alive"
        begun = time.monotonic()
        assert _closed_within(sock, KEEP_IDLE_S + scaled(10))  # idle: the helper lets it go
        assert time.monotonic() - begun >= KEEP_IDLE_S - 0.5

    ranks = json.loads(run_cli("127.0.0.1:%d" % port, "ranks", "-f", "json").out)
    agent_port = int(next(r for r in ranks if r["rank"] == 0)["port"])
    with socket.create_connection(("127.0.0.1", agent_port), timeout=scaled(20)) as sock:
        sock.sendall(_hello_bytes("keep-alive"))
        status, headers = _answer_on(sock)
        assert status == 200 and headers["connection"] == "close", headers
        assert _closed_within(sock, scaled(5))


def test_idle_kept_connections_do_not_lock_out_a_new_client(job):
    """Every connection slot of the helper held by kept, idle connections: a new client's request is still
    answered (an idle kept connection gives its slot up, as one that sends nothing does), not 503."""
    from probe.agent.listener import MAX_CONNECTIONS

    port, _pids = job
    held = []
    try:
        for _ in range(MAX_CONNECTIONS):
            sock = socket.create_connection(("127.0.0.1", port - 1), timeout=scaled(20))
            held.append(sock)
            sock.sendall(_hello_bytes("keep-alive"))
            assert _answer_on(sock)[1]["connection"] == "keep-alive"
        with socket.create_connection(("127.0.0.1", port - 1), timeout=scaled(20)) as late:
            late.sendall(_hello_bytes("close"))
            status, headers = _answer_on(late)
        assert status == 200, headers
    finally:
        for sock in held:
            sock.close()


def test_a_look_through_the_helpers_goes_on_the_connection_of_the_look_before(job):
    """The one-thread fan-out asks a kept connection: a gather goes on its hello's connection, and the next
    gather to the same helper (a diagnosis's next look) on that same connection again."""
    from probe.client import multiplex, proof, via_helpers

    port, _pids = job
    address, token = transport.TcpAddress("127.0.0.1", port - 1), _token(port)
    body = json.dumps({"op": "backtrace", "ranks": [0, 2], "deadline": 5}).encode()
    proof._kept.pop(proof._place(address, token.encode()), None)
    multiplex.close_kept()  # nothing kept from the tests before

    def steps():
        return via_helpers._gather_steps(address, body, scaled(20), token)

    (first,) = multiplex.run([steps], 1, scaled(20))
    assert first.error is None and first.value.status == 200, first
    assert first.value.headers.get("connection") == "keep-alive"
    (kept,) = [sock for sock, _ in multiplex._kept.values() if sock.getpeername()[1] == port - 1]
    local = kept.getsockname()
    (second,) = multiplex.run([steps], 1, scaled(20))
    assert second.error is None and second.value.status == 200, second
    (again,) = [sock for sock, _ in multiplex._kept.values() if sock.getpeername()[1] == port - 1]
    assert again is kept and again.getsockname() == local  # the same connection, asked twice
