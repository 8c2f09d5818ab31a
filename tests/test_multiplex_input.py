"""The one-thread fan-out to the node helpers (``probe.client.multiplex``, driven by
``via_helpers._gather_steps``) reads every byte from the network as hostile, as the blocking path does: a
listener that proves the token and then answers with no ``Content-Length``, an oversized header, an
oversized length, a body cut short, a body that trickles past the deadline, or nothing at all, fails that
exchange alone with words saying what was wrong, within its own deadline; a listener that cannot prove it
holds the token gets no request; a port with no listener is refused. Many exchanges at once each get their
own outcome, in order. The listeners are fakes over loopback (what they answer is the test)."""

import socket
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, List

import pytest

import hmac_auth
from procs import scaled
from probe.client import multiplex, proof, transport, via_helpers
from probe.errors import ConnectError, ConnectionRefused, Timeout, TooLarge

TOKEN = "multiplex-input-token"
BODY = b'{"op": "backtrace", "ranks": [0], "deadline": 1}'


class Listening:
    """A loopback listener serving each connection on a thread of its own (``_one``, given the connection and
    how many came before it and it); ``accepted``: connections taken."""

    def __init__(self, mode: str) -> None:
        self.mode, self.accepted, self.posts = mode, 0, 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.threads: List[threading.Thread] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            thread = threading.Thread(target=self._one, args=(conn, self.accepted), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _one(self, conn: socket.socket, nth: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        self.thread.join(5)
        for thread in self.threads:
            thread.join(5)


class Hostile(Listening):
    """A loopback listener that answers a hello for ``token`` and then the request as ``mode`` says;
    ``posts`` counts the requests other than hellos that reached it."""

    def __init__(self, mode: str, token: str = TOKEN) -> None:
        self.token = token
        super().__init__(mode)

    def _one(self, conn: socket.socket, nth: int) -> None:
        conn.settimeout(scaled(10))
        try:
            request = b""
            while b"\r\n\r\n" not in request and len(request) < 65536:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                request += chunk
            if hmac_auth.answer_hello(conn, request, self.token):
                return
            self.posts += 1
            self._answer(conn)
        except OSError:
            pass
        finally:
            conn.close()

    def _answer(self, conn: socket.socket) -> None:
        mode = self.mode
        if mode == "good":
            conn.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}')
        elif mode == "no_length":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{}")
        elif mode == "big_head":
            conn.sendall(b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * 100000)
        elif mode == "huge":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (transport.MAX_RESPONSE_BYTES + 1))
        elif mode == "cut":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10)
        elif mode == "trickle":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
            while not self.stop.is_set():
                conn.sendall(b"x")
                self.stop.wait(0.05)
        elif mode == "silent":
            self.stop.wait(scaled(10))
        elif mode == "not_http":
            conn.sendall(b"SSH-2.0-OpenSSH\r\n\r\n")


@contextmanager
def hostile(*modes: str, token: str = TOKEN) -> Iterator[List[Hostile]]:
    made = [Hostile(mode, token) for mode in modes]
    try:
        yield made
    finally:
        for one in made:
            one.close()


def _run(ports: List[int], timeout: float, deadline: float, token: str = TOKEN) -> List[Any]:
    def start(port: int) -> Any:
        return lambda: via_helpers._gather_steps(transport.TcpAddress("127.0.0.1", port), BODY, timeout, token)

    return multiplex.run([start(p) for p in ports], 8, deadline)


@pytest.mark.parametrize("mode, kind, said", [
    ("no_length", ConnectError, "without a valid Content-Length"),
    ("big_head", ConnectError, "oversized response header"),
    ("huge", TooLarge, "more than the"),
    ("cut", ConnectError, "closed the connection after 10 of the 1000 bytes"),
    ("trickle", Timeout, "did not arrive whole within"),
    ("silent", Timeout, "no answer from"),
    ("not_http", ConnectError, "does not speak HTTP"),
])
def test_a_hostile_answer_fails_its_exchange_with_what_was_wrong(mode: str, kind: type, said: str) -> None:
    with hostile(mode) as (one,):
        begun = time.monotonic()
        (outcome,) = _run([one.port], 1.5, scaled(20))
        took = time.monotonic() - begun
    assert isinstance(outcome.error, kind) and said in outcome.error.message, outcome
    assert "127.0.0.1:%d" % one.port in outcome.error.message, outcome.error.message
    assert one.posts == 1
    assert took < scaled(15), took  # within its own deadline, not the run's


def test_a_listener_that_cannot_prove_the_token_gets_no_request_and_a_closed_port_is_refused() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        free = closed.getsockname()[1]
    with hostile("good", token="another-jobs-token") as (other,):
        unproven, refused = _run([other.port, free], scaled(5), scaled(20))
    assert isinstance(unproven.error, proof.Unproven) and "could not prove" in unproven.error.message, unproven
    assert other.posts == 0  # nothing derived from the token went there
    assert isinstance(refused.error, ConnectionRefused), refused


def test_many_at_once_each_get_their_own_outcome_in_order_and_the_next_nonce_is_not_kept_unproven() -> None:
    modes = ["good", "cut", "good", "no_length", "silent", "good"] * 4
    with hostile(*modes) as listeners:
        outcomes = _run([h.port for h in listeners], 2.0, scaled(20))
        for listener, outcome in zip(listeners, outcomes):
            if listener.mode == "good":
                assert outcome.error is None and outcome.value.status == 200, outcome
                transport.release(outcome.value)
            else:
                assert outcome.error is not None and "127.0.0.1:%d" % listener.port in outcome.error.message, outcome
    # a fake's answer hands out no next nonce: the next gather to it begins with a hello again
    assert not any(proof._kept.get(proof._place(transport.TcpAddress("127.0.0.1", h.port), TOKEN.encode()))
                   for h in listeners)


def test_the_runs_deadline_names_those_unanswered_and_those_never_asked() -> None:
    with hostile("silent", "silent") as listeners:
        begun = time.monotonic()
        outcomes = multiplex.run([lambda p=h.port: via_helpers._gather_steps(transport.TcpAddress("127.0.0.1", p), BODY,
                                                                             scaled(10), TOKEN) for h in listeners],
                                 1, 0.5, slow_after=60.0)
        took = time.monotonic() - begun
    assert took < scaled(5), took
    assert "no answer within the deadline of 0.5 s" in outcomes[0].error.message, outcomes[0]
    assert "not asked" in outcomes[1].error.message, outcomes[1]


def test_host_names_are_looked_up_beside_the_fan_out_each_once_and_one_that_does_not_resolve_fails_alone(
        monkeypatch: Any) -> None:
    """A job's helpers are named by their hosts' names: the lookups run in threads of their own, several at
    once (one slow name does not hold up the others' answers), and a name that does not resolve fails its own
    exchange. (The lookup is slowed here to see them overlap; what it looks up is real.)"""
    from probe.client import resolver

    real = resolver._getaddrinfo
    lock = threading.Lock()
    now, most, where = [0], [0], set()

    def slow(host: str, port: int) -> Any:
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
            where.add(threading.current_thread().name)
        try:
            time.sleep(0.3)
            return real(host, port)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(resolver, "_getaddrinfo", slow)
    with hostile(*["good"] * 6) as listeners:
        def start(host: str, port: int) -> Any:
            return lambda: via_helpers._gather_steps(transport.TcpAddress(host, port), BODY, scaled(10), TOKEN)

        starts = [start("localhost", h.port) for h in listeners] + [start("no-such-host.invalid", listeners[0].port)]
        outcomes = multiplex.run(starts, 8, scaled(30))
    for outcome in outcomes[:-1]:
        assert outcome.error is None and outcome.value.status == 200, outcome
        transport.release(outcome.value)
    bad = outcomes[-1].error
    assert isinstance(bad, ConnectError) and "cannot connect to no-such-host.invalid:" in bad.message, outcomes[-1]
    assert most[0] >= 2, most  # looked up at once, not one after another
    assert where == {"probe-resolve"}, where  # never in the fan-out's own thread


class Keeping(Listening):
    """A loopback listener that says it keeps each connection (``keep-alive``) and then, as ``mode`` says:
    ``drop``: closes the first connection without answering its second request (a listener that let an
    idle kept connection go just as the client used it); ``extra``: sends a byte past its answer to the
    hello. ``accepted``: connections taken; ``posts``: requests other than hellos that reached it."""

    def _request(self, conn: socket.socket) -> bytes:
        request = b""
        while b"\r\n\r\n" not in request:
            chunk = conn.recv(65536)
            if not chunk:
                return b""
            request += chunk
        head, _, body = request.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += conn.recv(65536)
        return head

    def _one(self, conn: socket.socket, nth: int) -> None:
        conn.settimeout(scaled(10))
        try:
            while not self.stop.is_set():
                head = self._request(conn)
                if not head:
                    return
                if head.startswith(b"GET /v1/hello "):
                    cn = next(line.split(b":")[1].strip().decode() for line in head.split(b"\r\n")
                              if line.lower().startswith(b"x-probe-nonce"))
                    body = hmac_auth.hello_body(cn, TOKEN, conn.getsockname())
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: keep-alive\r\n\r\n" % len(body)
                                 + body + (b"x" if self.mode == "extra" else b""))
                    continue
                self.posts += 1
                if self.mode == "drop" and nth == 1:
                    return  # closed below, the request unanswered
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\n{}")
        except OSError:
            pass
        finally:
            conn.close()


@pytest.mark.parametrize("mode, accepted, posts", [("drop", 2, 2), ("extra", 2, 1)])
def test_a_kept_connection_closed_unanswered_is_asked_afresh_and_one_with_bytes_past_its_answer_is_not_reused(
        mode: str, accepted: int, posts: int) -> None:
    """``drop``: the request sent on the hello's kept connection gets nothing back (the listener closed it):
    it is sent once more on a fresh connection, and answered. ``extra``: a byte came past the hello's answer:
    the gather goes on a fresh connection, never on one whose next bytes are not its answer's."""
    listener = Keeping(mode)
    try:
        (outcome,) = _run([listener.port], scaled(5), scaled(20))
    finally:
        listener.close()
    assert outcome.error is None and outcome.value.status == 200, outcome
    transport.release(outcome.value)
    assert (listener.accepted, listener.posts) == (accepted, posts)
