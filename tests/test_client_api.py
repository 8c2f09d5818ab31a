"""The client library as a script uses it, and the token of an agent of ours reached at HOST:PORT on this
host: read from the file the agent names, only where that file is ours alone."""

import os
import socket
import time
from typing import Iterator, List

import pytest

import probe
from procs import Proc, run_cli, spawn, target_env


def _free_port_pair() -> int:
    """A port p such that p and p + 1 were free a moment ago."""
    for _ in range(100):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                with socket.socket() as second:
                    second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two free ports in a row")


@pytest.fixture(scope="module")
def job() -> Iterator["tuple[int, List[Proc]]"]:
    """Two ranks of one job on this host, as torchrun would start them: PROBE_PORT, LOCAL_RANK 0 and 1,
    one job token file between them."""
    port = _free_port_pair()
    ranks: List[Proc] = []
    try:
        for local_rank in (0, 1):
            ranks.append(spawn("idle.py", env=target_env(PROBE_PORT="127.0.0.1:%d" % port, LOCAL_RANK=str(local_rank))))
        _wait_listening(port, port + 1)
        yield port, ranks
    finally:
        for rank in ranks:
            rank.kill()


def _wait_listening(*ports: int) -> None:
    deadline = time.monotonic() + 30
    for port in ports:
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


# -- item 16: the job's token, for one rank's HOST:PORT and --hosts on this host -------------------


def test_one_ranks_host_port_reads_the_jobs_token_file(job) -> None:
    port, ranks = job
    result = run_cli("127.0.0.1:%d" % (port + 1), "query", "SELECT pid FROM process.info", "-f", "json")
    assert result.code == 0, result.err
    assert str(ranks[1].pid) in result.out


def test_hosts_on_this_host_read_the_jobs_token_file(job, tmp_path) -> None:
    port, ranks = job
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1:%d\nlocalhost:%d\n" % (port, port + 1))
    result = run_cli("--hosts", str(hosts), "query", "SELECT pid FROM process.info")
    assert result.code == 0, result.err
    assert str(ranks[0].pid) in result.out and str(ranks[1].pid) in result.out


def test_the_api_reads_the_token_of_an_agent_of_ours(job) -> None:
    port, ranks = job
    assert probe.connect("127.0.0.1:%d" % port).health()["pid"] == ranks[0].pid


def test_a_token_file_open_to_others_is_not_read(job) -> None:
    from probe import _paths

    port, _ = job
    path = _paths.job_token_path(port)
    os.chmod(path, 0o640)
    try:
        result = run_cli("127.0.0.1:%d" % port, "health")
    finally:
        os.chmod(path, 0o600)
    assert result.code == 4, result
    assert path in result.err  # the client names it: this host's agent told its owner, over the unix socket


def test_an_agent_with_a_tcp_listener_of_its_own_gives_its_token(target_factory) -> None:
    port = _free_port_pair()
    proc = target_factory("idle.py", env=target_env(PROBE_LISTEN="127.0.0.1:%d" % port))
    _wait_listening(port)
    result = run_cli("127.0.0.1:%d" % port, "eval", "import os; print(os.getpid())")
    assert result.code == 0, result.err
    assert result.out.strip() == str(proc.pid)


# -- item 18: the cluster API when no rank answers, and errors in the API's words -------------------


def _refusing_port() -> int:
    """A loopback port nobody listens on (a connection there is refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_cluster_call_that_no_rank_answered_raises() -> None:
    from probe.client.cluster import NoRankAnswered, connect_all

    targets = ["127.0.0.1:%d" % _refusing_port() for _ in range(2)]
    cluster = connect_all(targets, token="x", timeout=5)
    for call in (lambda: cluster.query("SELECT 1"), lambda: cluster.query_rows("SELECT 1"),
                 lambda: cluster.eval("1"), lambda: cluster.backtrace()):
        with pytest.raises(NoRankAnswered) as caught:
            call()
        assert "none of the 2 ranks answered" in caught.value.message
        assert targets[0] in caught.value.message and "connection refused" in caught.value.message
        assert [f.rank for f in caught.value.failures] == [0, 1] == [f.rank for f in cluster.failures]
        assert caught.value.exit_code == 3


def test_the_cli_still_names_each_rank_when_none_answered(tmp_path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1:%d\n127.0.0.1:%d\n" % (_refusing_port(), _refusing_port()))
    result = run_cli("--hosts", str(hosts), "--token", "x", "query", "SELECT 1")
    assert result.code == 3, result
    assert "2 of 2 ranks gave no result" in result.err and "rank 1 (" in result.err, result.err


def test_api_errors_name_parameters_not_flags() -> None:
    from probe.client.cluster import NoRankAnswered, connect_all
    from probe.errors import UsageError
    from test_client_bounds import hostile

    with pytest.raises(UsageError) as caught:
        connect_all("unix:/nowhere.sock")
    assert "connect_all([" in str(caught.value) and "--hosts" not in str(caught.value)
    with hostile("drip_body", count=2) as servers:
        cluster = connect_all([s.target for s in servers], token="x", deadline=1.0, max_in_flight=1)
        with pytest.raises(NoRankAnswered) as caught:
            cluster.query_rows("SELECT 1")
    said = str(caught.value)
    assert "raise deadline=" in said and "--deadline" not in said, said


def test_an_eval_value_is_the_repr_of_the_last_expression(idle_target) -> None:
    result = probe.connect(str(idle_target.pid)).eval("x = {'a': [1, 2]}\nx")
    assert result.value == "{'a': [1, 2]}" and isinstance(result.value, str)
    assert probe.connect(str(idle_target.pid)).eval("x = 1").value is None
