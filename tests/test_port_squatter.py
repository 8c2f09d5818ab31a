"""Another user takes the job's port first: the agent moves and says whose the port is where the user
looks, and no client sends the squatter the token or anything it could use (probe.agent.handshake).

The squatter is a real process of user nobody (uid 65534) listening on the port and recording every byte
it receives; it either answers like an agent would (with proofs it cannot make) or relays each connection
to the real agent, where it has moved."""

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Dict, Iterator, List

import pytest
from procs import TARGETS, Proc, run_cli, scaled, target_env
from test_cluster import _free_ports
from test_node_helper import _alive, _helper_pid, _until

import probe
from probe.errors import Unauthorized

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to start a squatter as another user")


class Squatter:
    """A forked child of uid nobody on 127.0.0.1:``port``; ``received()`` is every byte it was sent."""

    def __init__(self, port: int, mode: str) -> None:
        self.port = port
        self._bytes = bytearray()
        ready_r, ready_w = os.pipe()
        self._relay_r, self._relay_w = os.pipe()
        record_r, record_w = os.pipe()
        json.dumps({})  # modules used after the drop are imported now: nobody may not read root's files
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - the child
            try:
                os.close(ready_r), os.close(record_r), os.close(self._relay_w)
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                _squat(port, mode, ready_w, self._relay_r, record_w)
            finally:
                os._exit(0)
        os.close(ready_w), os.close(record_w), os.close(self._relay_r)
        readable, _, _ = select.select([ready_r], [], [], scaled(10))
        started = bool(readable) and os.read(ready_r, 1) == b"R"
        os.close(ready_r)
        if not started:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            raise AssertionError("the squatter did not start listening on %d" % port)
        self._reader = threading.Thread(target=self._record, args=(record_r,), daemon=True)
        self._reader.start()

    def relay_to(self, port: int) -> None:
        os.write(self._relay_w, b"%d\n" % port)

    def _record(self, fd: int) -> None:
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            self._bytes += chunk
        os.close(fd)

    def received(self) -> bytes:
        return bytes(self._bytes)

    def stop(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(self.pid, 0)
        os.close(self._relay_w)
        self._reader.join(scaled(10))


def _squat(port: int, mode: str, ready: int, relay_fd: int, record: int) -> None:  # pragma: no cover - the child
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(16)
    os.write(ready, b"R")
    target = int(os.read(relay_fd, 16).split(b"\n")[0]) if mode != "pretends" else 0
    while True:
        conn, _ = server.accept()
        conn.settimeout(10)
        try:
            if mode == "relays":
                _relay(conn, target, record)
            else:
                _pretend(conn, port, record, target if mode == "replays" else 0)
        except OSError:
            pass
        finally:
            conn.close()


def _pretend(conn: socket.socket, port: int, record: int, agent: int) -> None:  # pragma: no cover - the child
    """Answer every request as an agent's hello would look: with proofs made without the token, or (given the
    ``agent``'s port) with a genuine hello answer the agent gave the squatter for a nonce of its own."""
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = conn.recv(65536)
        if not chunk:
            break
        got += chunk
        os.write(record, chunk)
    body = json.dumps({"nonce": os.urandom(16).hex(), "address": "127.0.0.1:%d" % port, "scheme": "Probe-HMAC",
                       "proofs": {"eval": os.urandom(32).hex(), "read": os.urandom(32).hex()}}).encode()
    if agent:
        with socket.create_connection(("127.0.0.1", agent), timeout=10) as upstream:
            upstream.sendall(b"GET /v1/hello HTTP/1.1\r\nHost: x\r\nX-Probe-Nonce: %s\r\nContent-Length: 0\r\n\r\n"
                             % os.urandom(16).hex().encode())
            answer = b""
            while True:
                chunk = upstream.recv(65536)
                if not chunk:
                    break
                answer += chunk
        body = answer.partition(b"\r\n\r\n")[2]
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                 % len(body) + body)


def _relay(conn: socket.socket, target: int, record: int) -> None:  # pragma: no cover - the child
    """Pass the connection through to the real agent both ways, recording what the client sends."""
    with socket.create_connection(("127.0.0.1", target), timeout=10) as upstream:
        ends = {conn: upstream, upstream: conn}
        while ends:
            readable, _, _ = select.select(list(ends), [], [], 10)
            if not readable:
                return
            for sock in readable:
                chunk = sock.recv(65536)
                if not chunk:
                    return
                if sock is conn:
                    os.write(record, chunk)
                ends[sock].sendall(chunk)


@contextmanager
def _job_behind_squatters(tmp_path, mode: str, helper_port_too: bool = True) -> Iterator[Dict[str, object]]:
    """One rank of a job (PROBE_PORT, as srun starts one) whose port (and its node helper's) another user
    took first; yields the port, the token file, the runtime directory, the rank and the squatters."""
    runtime = str(tmp_path / "run")
    os.mkdir(runtime, 0o700)
    token_file = str(tmp_path / "job.token")
    port = _free_ports(1)
    squatters: List[Squatter] = []
    popen = None
    try:
        squatters.append(Squatter(port, mode))  # one at a time: each is stopped below, whatever fails next
        if helper_port_too:
            squatters.append(Squatter(port - 1, "pretends"))
        env = target_env(PROBE_PORT="127.0.0.1:%d" % port, PROBE_RUNTIME_DIR=runtime, PROBE_HELPER_LINGER_S="2",
                         PROBE_TOKEN_FILE=token_file, SLURM_NTASKS="1", SLURM_NODEID="0", SLURM_PROCID="0",
                         SLURM_LOCALID="0")
        popen = subprocess.Popen([sys.executable, os.path.join(TARGETS, "idle.py")], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, env=env)
        rank = Proc(popen, "idle.py rank 0")
        assert rank.read_line(60).startswith("READY")
        health = probe.connect("unix:%s/%d.sock" % (runtime, popen.pid)).health()  # on its unix socket: where it moved
        moved = int(str(health["tcp"]).rpartition(":")[2])
        assert moved != port
        squatters[0].relay_to(moved)
        with open(token_file) as handle:
            token = handle.read().strip()
        yield {"port": port, "token_file": token_file, "token": token, "runtime": runtime, "rank": rank,
               "health": health, "squatters": squatters,
               "env": target_env(probe=False, PROBE_RUNTIME_DIR=runtime)}
    finally:
        helper = _helper_pid(runtime, port)
        if popen is not None:
            Proc(popen, "rank").kill()
        if helper is not None:
            try:
                _until(lambda: not _alive(helper), 30, "the node helper to leave once its rank is gone")
            finally:
                if _alive(helper):
                    os.kill(helper, signal.SIGKILL)
        for squatter in squatters:
            squatter.stop()


def _nothing_usable(job: Dict[str, object]) -> None:
    """What the squatters received: hellos only (so they were reached), no token, no request MAC."""
    for squatter in job["squatters"]:  # type: ignore[attr-defined]
        # what the squatter was sent reaches this process through a pipe and a reader thread: wait for it
        deadline = time.monotonic() + scaled(10)
        while b"GET /v1/hello" not in squatter.received() and time.monotonic() < deadline:
            time.sleep(0.05)
        got = squatter.received()
        assert b"GET /v1/hello" in got, (squatter.port, got[:300])
        assert str(job["token"]).encode() not in got
        assert b"authorization" not in got.lower() and b"mac=" not in got, got[:600]
        assert set(line.split(b" ")[0] for line in got.split(b"\r\n") if b" HTTP/1.1" in line) == {b"GET"}


@pytest.mark.parametrize("mode", ["pretends", "replays", "relays"])
def test_a_squatter_on_the_jobs_ports_gets_no_token_and_the_client_refuses_in_words(tmp_path, mode):
    """The squatter answers with proofs it made up, replays a genuine answer the agent gave it, or relays."""
    with _job_behind_squatters(tmp_path, mode) as job:
        port, token_file = job["port"], str(job["token_file"])
        address = "127.0.0.1:%d" % port  # type: ignore[str-format]
        for command in (("health",), ("eval", "6 * 7"), ("query", "SELECT pid FROM process.info")):
            out = run_cli(address, "--token-file", token_file, *command, env=job["env"])  # type: ignore[arg-type]
            assert out.code == 4, (command, out)
            assert "the listener at %s could not prove it holds the job's token" % address in out.err, out.err
            assert ("relays" in out.err) == (mode == "relays"), out.err
            assert out.out == ""
        with pytest.raises(Unauthorized, match="could not prove it holds the job's token"):
            probe.connect(address, token_file=token_file).health()
        # The node helper's port (PROBE_PORT - 1) is taken too: `ranks` asks it, and is refused as well.
        ranks = run_cli(address, "--token-file", token_file, "ranks", env=job["env"])  # type: ignore[arg-type]
        assert ranks.code == 4 and "the listener at 127.0.0.1:%d could not prove" % (port - 1) in ranks.err, ranks  # type: ignore[operator]
        _nothing_usable(job)
        if mode == "relays":  # a forward the user set up on purpose: told so, the client takes the agent's proof for its address
            forwarded = run_cli(address, "--token-file", token_file, "eval", "6 * 7",
                                env=dict(job["env"], PROBE_FORWARDED="1"))  # type: ignore[arg-type]
            assert forwarded.code == 0 and forwarded.out.strip() == "42", forwarded
        # The agent itself, where it moved, proves it and answers (the job's token did not change).
        moved = str(job["health"]["tcp"])  # type: ignore[index]
        ok = run_cli(moved, "--token-file", token_file, "eval", "6 * 7", env=job["env"])  # type: ignore[arg-type]
        assert ok.code == 0 and ok.out.strip() == "42", ok


def test_whose_the_taken_port_is_said_by_list_health_and_ranks(tmp_path):
    with _job_behind_squatters(tmp_path, "pretends", helper_port_too=False) as job:
        port, pid = job["port"], job["rank"].popen.pid  # type: ignore[attr-defined]
        said = "port %d taken by uid %d" % (port, NOBODY)  # type: ignore[str-format]
        assert said in str(job["health"]["tcp_note"])  # type: ignore[index]
        health = run_cli(str(pid), "health", env=job["env"])  # type: ignore[arg-type]
        assert health.code == 0 and said in health.out, health
        listed = run_cli("list", "--agents-only", env=job["env"])  # type: ignore[arg-type]
        assert "process %d: %s" % (pid, said) in listed.out, listed
        records = json.loads(run_cli("list", "--agents-only", "--json", env=job["env"]).out)  # type: ignore[arg-type]
        assert said in [r for r in records if r["pid"] == pid][0]["tcp_note"]
        # Its node helper, on the port below (free here), names whose the port is in `ranks`.
        address, token_file = "127.0.0.1:%d" % port, str(job["token_file"])  # type: ignore[str-format]
        _until(lambda: run_cli(address, "--token-file", token_file, "ranks", env=job["env"]).code == 0,  # type: ignore[arg-type]
               30, "the rank listed by its node helper")
        ranks = run_cli(address, "--token-file", token_file, "ranks", env=job["env"])  # type: ignore[arg-type]
        assert "rank 0: %s; serving on %s instead" % (said, str(job["health"]["tcp"]).rpartition(":")[2]) in ranks.err, ranks  # type: ignore[index]
