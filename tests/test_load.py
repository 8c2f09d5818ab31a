"""Many clients at once against one real agent: every request that was sent gets an answer (200, or a
503 ``busy`` JSON error when the agent cannot take more), none is dropped, and the target's own work
(busy.py's counting loop) goes on meanwhile.
"""

import json
import socket
import threading
import time
from collections import Counter
from typing import Iterator, List, Optional, Tuple

import pytest
from procs import Proc, running, target_env

import probe
from probe import _paths
from probe.client import transport
from probe.errors import ProbeError

CLIENTS = 50
ROUNDS = 4  # each client: health, a query, a backtrace, ROUNDS times
QUERY = json.dumps({"sql": "SELECT 1 AS one"}).encode()


@pytest.fixture(scope="module", params=["unix", "tcp"])
def served(request) -> Iterator[Tuple[Proc, transport.Address, Optional[str]]]:
    """busy.py with an agent, and how to reach it: its unix socket, or TCP with the token."""
    if request.param == "unix":
        with running("busy.py") as proc:
            yield proc, transport.UnixAddress(_paths.socket_path(proc.pid)), None
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with running("busy.py", env=target_env(PROBE_LISTEN="127.0.0.1:%d" % port)) as proc:
        with open(_paths.token_path(proc.pid)) as handle:
            token = handle.read().strip()
        yield proc, transport.TcpAddress("127.0.0.1", port), token


def _counter(client: "probe.Client") -> int:
    result = client.eval("counter")
    assert result.ok, result.error
    return int(result.value or "0")


def _one(address: transport.Address, token: Optional[str], kind: str) -> str:
    """One real request; what came of it: "ok", "busy", or a description of the failure."""
    if kind == "health":
        response = transport.request(address, "GET", "/v1/health", None, None, timeout=30.0, token=token)
    elif kind == "query":
        response = transport.request(address, "POST", "/v1/query", QUERY, None, timeout=30.0, token=token)
    else:
        response = transport.request(address, "GET", "/v1/backtrace", None, None, timeout=30.0, token=token)
    if response.status == 200:
        answer = json.loads(response.body)
        if kind == "query":
            assert answer["rows"] == [[1]], answer
        elif kind == "backtrace":
            assert answer["threads"], answer
        return "ok"
    if response.status == 503 and json.loads(response.body)["error"]["code"] == "busy":
        return "busy"
    return "HTTP %d %r" % (response.status, response.body[:200])


def test_fifty_concurrent_clients_all_get_an_answer(served):
    busy, address, token = served
    client = probe.connect(str(busy.pid), timeout=20.0)
    client.query_rows("SELECT 1")  # DuckDB loaded once, before the clock starts
    outcomes: List[Tuple[str, str]] = []
    lock = threading.Lock()
    go = threading.Event()

    def work() -> None:
        go.wait(10.0)
        for _ in range(ROUNDS):
            for kind in ("health", "query", "backtrace"):
                try:
                    outcome = _one(address, token, kind)
                except ProbeError as exc:  # no answer at all: the finding this test guards against
                    outcome = "dropped: %s" % exc
                except Exception as exc:  # noqa: BLE001 - counted and reported, not raised in a thread
                    outcome = "failed: %s: %s" % (type(exc).__name__, exc)
                with lock:
                    outcomes.append((kind, outcome))

    before = _counter(client)
    started = time.monotonic()
    threads = [threading.Thread(target=work, name="load-%d" % i, daemon=True) for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    go.set()
    for thread in threads:
        thread.join(60.0)
    elapsed = time.monotonic() - started
    assert not any(t.is_alive() for t in threads), "a client thread never finished"
    after = _counter(client)

    tally = Counter(outcome for _, outcome in outcomes)
    assert len(outcomes) == CLIENTS * ROUNDS * 3
    failures = [o for o in outcomes if o[1] not in ("ok", "busy")]
    assert not failures, "%d of %d requests got no proper answer, e.g. %r; all: %r" % (
        len(failures), len(outcomes), failures[:3], dict(tally))
    assert tally["ok"] > 0
    print("%s: %d requests from %d clients in %.1f s: %r" % (address, len(outcomes), CLIENTS, elapsed, dict(tally)))
    assert busy.alive()
    assert after > before, "the target's loop stopped counting under load (%d -> %d)" % (before, after)
    assert client.query_rows("SELECT pid FROM process.info").rows == [[busy.pid]]
