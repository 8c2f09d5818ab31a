"""The client library, as a script or notebook uses it."""

import os

import pytest

import probe
from procs import REPO, target_env


def test_connect_query_eval_backtrace_tables(idle_target):
    pa = pytest.importorskip("pyarrow")
    client = probe.connect(str(idle_target.pid))
    table = client.query("SELECT thread_name, depth, func FROM python.backtrace ORDER BY thread_name, depth")
    assert isinstance(table, pa.Table) and table.num_rows > 0
    assert "loader-0" in table.column("thread_name").to_pylist()

    result = client.eval("print('hi'); counter['n'] >= 0")
    assert (result.stdout, result.value, result.error, result.ok) == ("hi\n", "True", None, True)
    failed = client.eval("raise RuntimeError('boom')")
    assert not failed.ok and "RuntimeError: boom" in (failed.error or "")

    frames = client.backtrace()
    assert any(f.thread_name == "loader-0" and f.func == "data_loader_wait" for f in frames)
    assert {t.name for t in client.tables()} >= {"python.backtrace", "process.info"}
    assert client.health()["pid"] == idle_target.pid


def test_truncated_result_is_flagged(idle_target):
    client = probe.connect(str(idle_target.pid))
    rows = client.query_rows("SELECT * FROM range(1000)", max_rows=10)
    assert len(rows.rows) == 10 and rows.truncated
    table = client.query("SELECT * FROM range(1000)", max_rows=10)
    assert table.num_rows == 10 and table.schema.metadata[b"probe.truncated"] == b"true"
    whole = client.query_rows("SELECT * FROM range(5)")
    assert len(whole.rows) == 5 and not whole.truncated


def _other_python() -> str:
    """A CPython 3.9+ that is not this one and has no DuckDB or pyarrow: a 'different environment'."""
    for version in ("3.12.1", "3.10.13", "3.13.0", "3.9.18"):
        path = "/root/.pyenv/versions/%s/bin/python" % version
        if os.path.exists(path):
            return path
    return ""


def test_sql_runs_in_the_client_when_the_target_cannot(target_factory):
    python = _other_python()
    if not python:
        pytest.skip("no second CPython 3.9+ under /root/.pyenv/versions to act as a different environment")
    import subprocess

    check = subprocess.run([python, "-c", "import duckdb"], capture_output=True)
    if check.returncode == 0:
        pytest.skip("%s can import duckdb; it is no different environment" % python)
    proc = target_factory("explicit_start.py", python=python, env=target_env(probe=False, PYTHONPATH=REPO))
    client = probe.connect(str(proc.pid))
    assert client.health()["capabilities"]["sql"] is False
    rows = client.query_rows("SELECT thread_name, func FROM python.backtrace WHERE thread_name = 'worker-1' "
                             "AND func LIKE '%waiting_worker' ")
    assert rows.rows == [["worker-1", "waiting_worker"]]
    info = client.query("SELECT pid, start_time FROM process.info")
    assert info.column("pid").to_pylist() == [proc.pid]


SLOW_QUERY = "SELECT sum(hash(i)) FROM range(10000000000) t(i)"  # minutes of work; the agent's limit is 10 s


@pytest.mark.parametrize("order", ["interrupt-first", "query-first"])
def test_an_interrupt_stops_its_query_whether_it_comes_before_or_during_it(idle_target, order):
    """A Ctrl-C can overtake its query on the way to the agent; either way the query ends at once."""
    import threading
    import time

    client = probe.connect(str(idle_target.pid))
    query_id = "stop-%s-%d" % (order, time.monotonic_ns())
    states = []
    if order == "interrupt-first":
        states.append(client.interrupt_query(query_id))
    outcome = {}

    def run():
        started = time.monotonic()
        try:
            client.query(SLOW_QUERY, query_id=query_id)
        except probe.ProbeError as exc:
            outcome["error"] = exc.message
        outcome["took"] = time.monotonic() - started

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    if order == "query-first":
        busy = "SELECT count(*) AS n FROM python.threads WHERE thread_name = 'probe-request'"
        deadline = time.monotonic() + 5
        while client.query_rows(busy).rows[0][0] < 2:  # the slow query's request thread, and this one's
            assert time.monotonic() < deadline, "the slow query never reached the agent"
            time.sleep(0.02)
        states.append(client.interrupt_query(query_id))
    worker.join(15)
    assert not worker.is_alive()
    # During: the request's thread is there before DuckDB has the query (the thread count is answered in
    # Python now, quickly), so an interrupt then is "cancelled": it stops the query as it starts.
    assert states == ["cancelled"] if order == "interrupt-first" else states[0] in ("interrupted", "cancelled")
    assert "interrupted" in outcome.get("error", ""), outcome
    assert outcome["took"] < 5, outcome  # the agent's own limit (10 s) did not end it
