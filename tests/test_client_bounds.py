"""The client against a server that is no honest agent: it drips its answer a byte at a time, or sends
far more than any agent would. ``--timeout`` (``timeout=``) bounds the whole answer, and the client's
memory stays bounded per target and across targets; both the CLI and the API, over loopback only."""

import json
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator, List

import pytest

import probe
from probe.client import transport
from probe.errors import Timeout, TooLarge

import hmac_auth
from procs import REPO, run_cli, scaled, target_env

MiB = 1 << 20
SMALL = json.dumps({"columns": [{"name": "x", "type": "INTEGER"}], "rows": [[1]], "truncated": False}).encode()


class Hostile:
    """A loopback HTTP server that answers each request as ``mode`` says:

    ``small``: a tiny valid query answer; ``drip_head``: its head a byte every 0.5 s; ``drip_body``: a
    whole head, then its body a byte every 0.5 s; ``big``: ``Content-Length: size`` and as many 0xff bytes
    as fast as the client takes them (held back before the last byte until ``hold`` answers are that far,
    or 1.5 s pass). Every connection ends when the client leaves or after 60 s."""

    def __init__(self, mode: str, size: int = 0, hold: int = 0) -> None:
        self.mode, self.size = mode, size
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.closed = threading.Event()
        self.barrier = threading.Barrier(hold) if hold else None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def target(self) -> str:
        return "127.0.0.1:%d" % self.port

    def close(self) -> None:
        self.closed.set()
        self.thread.join(5)
        self.listener.close()

    def _serve(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        end = time.monotonic() + 60.0
        conn.settimeout(10.0)
        try:
            request = b""
            while b"\r\n\r\n" not in request:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                request += chunk
            if hmac_auth.answer_hello(conn, request, "x"):  # it holds the token the tests give ("x")
                return
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            if self.mode == "small":
                conn.sendall(head + b"Content-Length: %d\r\n\r\n" % len(SMALL) + SMALL)
            elif self.mode == "drip_head":
                conn.sendall(b"HTTP/1.1 200 OK\r\n")
                self._drip(conn, b"X-Slow: " + b"a" * 10000, end)
            elif self.mode == "drip_body":
                conn.sendall(head + b"Content-Length: 100000\r\n\r\n")
                self._drip(conn, b"{" + b" " * 99999, end)
            elif self.mode == "big":
                conn.settimeout(60.0)  # a client may wait for room to read this (an agent waits 10 s)
                conn.sendall(head + b"Content-Length: %d\r\n\r\n" % self.size)
                block, sent = b"\xff" * MiB, 0
                while sent < self.size - 1 and time.monotonic() < end and not self.closed.is_set():
                    n = min(len(block), self.size - 1 - sent)
                    conn.sendall(block[:n])
                    sent += n
                if self.barrier is not None:
                    try:
                        self.barrier.wait(scaled(1.5))
                    except threading.BrokenBarrierError:
                        pass
                conn.sendall(b"\xff")
                conn.settimeout(scaled(20.0))
                conn.recv(1)  # until the client has read it all and leaves
        except OSError:
            pass
        finally:
            conn.close()

    def _drip(self, conn: socket.socket, data: bytes, end: float) -> None:
        for i in range(len(data)):
            if time.monotonic() > end or self.closed.is_set():
                return
            conn.sendall(data[i:i + 1])
            time.sleep(0.5)


@contextmanager
def hostile(mode: str, count: int = 1, size: int = 0, hold: int = 0) -> Iterator[List[Hostile]]:
    servers = [Hostile(mode, size, hold) for _ in range(count)]
    try:
        yield servers
    finally:
        for server in servers:
            server.close()


def _probe_peak_rss(*args: str, timeout: float = 120.0) -> "tuple[int, str, int]":
    """Run the real CLI as the only child of a small wrapper: (exit code, stderr, peak RSS in bytes)."""
    wrapper = ("import resource, subprocess, sys\n"
               "done = subprocess.run([sys.executable, '-m', 'probe', *sys.argv[1:]], capture_output=True, text=True)\n"
               "sys.stderr.write(done.stderr)\n"
               "print(done.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)\n")
    done = subprocess.run([sys.executable, "-c", wrapper, *args], capture_output=True, text=True,
                          timeout=scaled(timeout), env=target_env(probe=False), cwd=REPO)
    code, peak = done.stdout.split()
    return int(code), done.stderr, int(peak)


# -- item 8: --timeout bounds the whole answer ----------------------------------------------------


@pytest.mark.parametrize("mode", ["drip_head", "drip_body"])
def test_timeout_bounds_an_answer_that_drips(mode: str) -> None:
    with hostile(mode) as (server,):
        start = time.monotonic()
        result = run_cli("-t", server.target, "--token", "x", "--timeout", "2", "query", "SELECT 1",
                         timeout=scaled(30))
        took = time.monotonic() - start
    assert result.code == 5, result
    assert "within 2.0 s" in result.err and "--timeout" in result.err, result.err
    assert took < 2.0 + scaled(4.0), took


def test_timeout_bounds_each_of_several_targets_that_drip() -> None:
    with hostile("drip_body", count=2) as servers:
        start = time.monotonic()
        result = run_cli("-t", servers[0].target, "-t", servers[1].target, "--token", "x", "--timeout", "2",
                         "query", "SELECT 1", timeout=scaled(30))
        took = time.monotonic() - start
    assert result.code == 5, result
    assert result.err.count("within 2.0 s") == 2, result.err
    assert took < 2.0 + scaled(4.0), took


def test_api_timeout_bounds_the_whole_answer() -> None:
    with hostile("drip_body") as (server,):
        client = probe.connect(server.target, token="x", timeout=1.5)
        start = time.monotonic()
        with pytest.raises(Timeout) as caught:
            client.query_rows("SELECT 1")
        took = time.monotonic() - start
    assert took < 1.5 + scaled(2.0), took
    assert "timeout=" in str(caught.value) and "--timeout" not in str(caught.value), caught.value


# -- item 9: memory against a server that sends too much ----------------------------------------


def test_an_answer_past_the_bound_is_refused_unread() -> None:
    with hostile("small") as (server,):
        code, _, base = _probe_peak_rss("-t", server.target, "--token", "x", "query", "SELECT 1")
    assert code == 0
    size = 300 * MiB
    with hostile("big", size=size) as (server,):
        code, err, peak = _probe_peak_rss("-t", server.target, "--token", "x", "query", "SELECT 1")
    assert peak - base < 32 * MiB, (base, peak)
    assert size > transport.MAX_RESPONSE_BYTES
    assert code == TooLarge.exit_code, err
    assert "%d MB" % (transport.MAX_RESPONSE_BYTES // 10**6) in err and "LIMIT" in err, err


def test_an_answer_within_the_bound_costs_at_most_twice_its_size() -> None:
    """Read into one growing buffer, no copy; its text while it is decoded is the only other copy."""
    size = 200 * MiB
    with hostile("small") as (server,):
        _, _, base = _probe_peak_rss("-t", server.target, "--token", "x", "query", "SELECT 1")
    with hostile("big", size=size) as (server,):
        code, err, peak = _probe_peak_rss("-t", server.target, "--token", "x", "query", "SELECT 1")
    assert code == 3 and "not a probe agent" in err, err  # 0xff is no JSON
    assert peak - base < 2.2 * size, (base, peak)


def test_answers_in_flight_across_targets_are_bounded_together() -> None:
    """Four targets each send 200 MiB and hold back their last byte until all four are that far: read
    all at once, that is 800 MiB; the client takes no more than its bound across targets at a time."""
    size = 200 * MiB
    with hostile("small") as (server,):
        _, _, base = _probe_peak_rss("-t", server.target, "--token", "x", "query", "SELECT 1")
    with hostile("big", count=4, size=size, hold=4) as servers:
        args = [a for s in servers for a in ("-t", s.target)]
        code, err, peak = _probe_peak_rss(*args, "--token", "x", "--max-in-flight", "32", "query", "SELECT 1")
    assert code == 3 and err.count("not a probe agent") == 4, err
    # The bodies in the room, and one text being decoded (decoding holds the GIL); all four: 1 GiB.
    assert peak - base < 512 * MiB + size + 64 * MiB, (base, peak)
    assert 2 * size <= transport.MAX_IN_FLIGHT_BYTES <= 512 * MiB


def test_api_refuses_an_answer_past_the_bound() -> None:
    with hostile("big", size=300 * MiB) as (server,):
        client = probe.connect(server.target, token="x", timeout=10)
        with pytest.raises(TooLarge) as caught:
            client.query_rows("SELECT 1")
    assert "max_rows=" in str(caught.value) and "--max-rows" not in str(caught.value), caught.value
