"""Where SQL runs (issue 24): by default an agent answers in Python only the simplest queries and leaves the
rest to the client, which runs them in the same locked-down engine over the rows the agent sends, so that
DuckDB and pyarrow (some 100 MB) never load into the target; the agent runs them itself when
``PROBE_SQL_IN_AGENT=1`` or when its program imported both. Real targets, the public CLI and client."""

import json
import os
import shutil
import sys
import threading
import time

import pytest

import probe
from procs import REPO, run_cli, running, scaled, target_env

pytest.importorskip("duckdb")

DEFAULT = {"PROBE_SQL_IN_AGENT": ""}  # the suite's targets run SQL in the agent (tests/procs.py): not these
GROUPED = ("SELECT thread_name, count(*) AS n FROM python.threads WHERE NOT starts_with(thread_name, 'probe') "
           "GROUP BY thread_name ORDER BY thread_name")
JOINED = ("SELECT t.thread_name, b.func FROM python.threads t JOIN python.backtrace b USING (thread_id) "
          "WHERE b.depth = 0 AND t.thread_name IN ('heartbeat', 'loader-0') ORDER BY 1")
LOADED = "sorted(m for m in ('duckdb', 'pyarrow') if m in __import__('sys').modules)"
ENGINE = "__import__('probe.agent', fromlist=['current']).current()._engine is not None"
WORKER = "__import__('probe.agent', fromlist=['current']).current()._engine.worker_pid()"


def _maps_duckdb(pid: int, parent: int) -> bool:
    """Whether ``pid`` is a live child of ``parent`` with DuckDB's library mapped (the agent's SQL worker)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/%d/maps" % pid) as f:
            maps = f.read()
    except OSError:
        return False
    return fields[0] != "Z" and int(fields[1]) == parent and "duckdb" in maps


def _rss_mb(pid: int) -> float:
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise AssertionError("no VmRSS for %d" % pid)


def _query(pid: int, sql: str, *extra: str):
    out = run_cli(str(pid), "query", sql, "-f", "json", *extra)
    assert out.code == 0, out.err
    return json.loads(out.out), out.err


@pytest.fixture(scope="module")
def default_target():
    with running("idle.py", env=target_env(**DEFAULT)) as proc:
        yield proc


def test_a_query_duckdb_runs_is_answered_by_the_client_and_the_target_stays_small(default_target):
    pid = default_target.pid
    assert run_cli(str(pid), "health").code == 0  # the agent has started and answered once
    before = _rss_mb(pid)
    grouped, _ = _query(pid, GROUPED)
    assert {"thread_name": "heartbeat", "n": 1} in grouped and {"thread_name": "loader-0", "n": 1} in grouped
    joined, _ = _query(pid, JOINED)
    assert joined == [{"thread_name": "heartbeat", "func": "heartbeat"},
                      {"thread_name": "loader-0", "func": "Condition.wait"}]
    counted, _ = _query(pid, "SELECT count(*) AS n FROM range(7)")
    assert counted == [{"n": 7}]
    growth = _rss_mb(pid) - before
    assert growth <= 40, "the target grew %.1f MB over its queries (issue 24: at most 40)" % growth
    client = probe.connect(str(pid))
    assert client.eval(LOADED).value == "[]", "DuckDB or pyarrow loaded into the target"
    health = client.health()["capabilities"]
    assert health["sql"] is True and health["sql_in_agent"] is False


def test_the_client_asks_only_for_the_columns_its_query_names(default_target):
    client = probe.connect(str(default_target.pid))
    every = [name for name, _ in client.table_rows("python.threads").columns]
    named = client.table_rows("python.threads", columns=["thread_name", "no_such_column"])
    def own(rows):  # the program's threads: the agent's request threads come and go between two reads
        return sorted(r[0] for r in rows if not str(r[0]).startswith("probe-"))

    every_name = every.index("thread_name")
    assert [name for name, _ in named.columns] == ["thread_name"] and own(named.rows) == own(
        [[r[every_name]] for r in client.table_rows("python.threads").rows])
    assert [name for name, _ in client.table_rows("python.threads", columns=[]).columns] == every[:1]
    whole = client.query_rows("SELECT t FROM python.threads t WHERE t.thread_name = 'heartbeat'").rows
    assert len(whole) == 1 and sorted(whole[0][0]) == sorted(every)  # a whole row: every column came
    assert client.query_rows("SELECT count(*) FROM python.threads WHERE thread_name = 'loader-0'").rows == [[1]]


def test_the_client_keeps_the_engines_lock_down(default_target):
    pid = default_target.pid
    refused = {
        "SELECT * FROM read_csv('/etc/passwd')": "file system operations are disabled",
        "SELECT * FROM glob('/etc/*')": "file system operations are disabled",
        "COPY (SELECT 1) TO '/tmp/probe-placement.csv'": "COPY is not allowed",
        "INSTALL httpfs": "extensions are disabled",
        "ATTACH '/tmp/probe-placement.db'": "ATTACH is not allowed",
        "SET threads = 8": "configuration is locked",
        "SELECT range(100000000)": "one value may hold",
    }
    for sql, words in refused.items():
        out = run_cli(str(pid), "query", sql)
        assert out.code != 0 and words in out.err, (sql, out.err)
    assert not os.path.exists("/tmp/probe-placement.csv") and not os.path.exists("/tmp/probe-placement.db")
    assert probe.connect(str(pid)).eval(LOADED).value == "[]"


def test_a_query_run_by_the_client_is_stopped_by_its_interrupt(default_target):
    client = probe.connect(str(default_target.pid))
    outcome = {}

    def run():
        started = time.monotonic()
        try:
            client.query("SELECT sum(hash(i)) FROM range(10000000000) t(i)", query_id="placement-stop")
        except probe.ProbeError as exc:
            outcome["error"] = exc.message
        outcome["took"] = time.monotonic() - started

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    deadline = time.monotonic() + scaled(5)
    while "placement-stop" not in client._local_queries:
        assert time.monotonic() < deadline and worker.is_alive(), outcome
        time.sleep(0.01)
    assert client.interrupt_query("placement-stop") in ("interrupted", "cancelled")  # cancelled: not yet begun
    worker.join(scaled(10))
    assert not worker.is_alive()
    assert "interrupted" in outcome.get("error", "") and outcome["took"] < 5, outcome


def test_ctrl_c_stops_a_query_the_client_runs_and_exits_130(default_target):
    from terminal import run_in_pty

    loaded: list = []

    def running_duckdb(pid: int) -> bool:
        """The CLI has mapped DuckDB's library (the query is on its way to it), a moment ago."""
        try:
            with open("/proc/%d/maps" % pid) as maps:
                if "duckdb" in maps.read():
                    loaded.append(time.monotonic())
                else:
                    loaded.clear()  # what a fork inherited before its exec (this process may map DuckDB) is gone
        except OSError:
            return False
        return bool(loaded) and time.monotonic() - loaded[0] > 0.3

    started = time.monotonic()
    status, out, _ = run_in_pty([str(default_target.pid), "query", "SELECT sum(hash(i)) FROM range(10000000000) t(i)"],
                                when=running_duckdb)
    assert status == 130, out
    assert time.monotonic() - started < 8, "the query ran on to its 10 s limit"
    assert [line for line in out.splitlines() if line.strip() and line.strip() != "^C"] == \
        ["probe: interrupted (Ctrl-C); the query was stopped in the target"], out


def test_a_table_the_agent_cut_is_said_and_marks_the_result_truncated(target_factory):
    proc = target_factory("idle.py", env=target_env(PROBE_MAX_ROWS="2", PROBE_MAX_ROWS_CEILING="2", **DEFAULT))
    rows, err = _query(proc.pid, "SELECT count(thread_id) AS n FROM python.threads")
    assert rows == [{"n": 2}]
    assert "the first 100,000 rows of python.threads only" in err and "PROBE_SQL_IN_AGENT=1" in err, err
    result = probe.connect(str(proc.pid)).query_rows("SELECT count(thread_id) AS n FROM python.threads")
    assert result.truncated


def test_sql_runs_in_the_agent_when_asked_to_or_when_the_program_loaded_duckdb(target_factory):
    asked = target_factory("idle.py", env=target_env(PROBE_SQL_IN_AGENT="1"))
    assert _query(asked.pid, GROUPED)[0]
    client = probe.connect(str(asked.pid))
    # DuckDB runs in the agent's worker, a child of the target under a memory ceiling (issue 33): the target
    # itself holds pyarrow only.
    assert client.eval(ENGINE).value == "True" and client.eval(LOADED).value == "['pyarrow']"
    assert _maps_duckdb(int(client.eval(WORKER).value), parent=asked.pid)

    own = target_factory("idle.py", env=target_env(**DEFAULT))
    client = probe.connect(str(own.pid))
    first = client.query_rows(GROUPED).rows
    assert client.eval(ENGINE).value == "False"  # the client ran it
    client.eval("import duckdb, pyarrow")  # the program's own import: nothing more to load
    assert client.query_rows(GROUPED).rows == first  # the same client asks the agent again, which runs it
    assert client.eval(ENGINE).value == "True"


def test_after_the_quiet_period_the_agent_gives_back_duckdbs_pages_and_answers_again(target_factory):
    proc = target_factory("idle.py", env=target_env(PROBE_SQL_IN_AGENT="1", PROBE_SQL_QUIET="1"))
    client = probe.connect(str(proc.pid))
    first = client.query_rows(GROUPED).rows
    assert client.eval("__import__('probe.agent', fromlist=['current']).current()._loaded_libraries").value \
        == "('arrow',)"
    worker = int(client.eval(WORKER).value)
    assert _maps_duckdb(worker, parent=proc.pid)
    deadline = time.monotonic() + scaled(10)
    while client.eval(ENGINE).value == "True":
        assert time.monotonic() < deadline, "DuckDB's database was not closed after 1 s without a query"
        time.sleep(0.2)
    assert not _maps_duckdb(worker, parent=proc.pid), "the SQL worker outlived the engine"
    # What the agent did at the close, again: the libraries' read-only mappings advised (the kernel keeps
    # the pages other processes on this machine map too), and nothing of the process's own data touched.
    advised = client.eval("__import__('probe.engine.memory', fromlist=['x']).page_out_libraries(('arrow',))")
    assert int(advised.value) > 0, advised
    assert client.query_rows(GROUPED).rows == first


TORCHRUN = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")


@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun (torch) is not installed")
def test_all_ranks_merge_and_diagnose_with_sql_left_to_the_client():
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from test_cluster import torchrun_job

    with torchrun_job("rank.py", 2, **DEFAULT) as (port, pids):
        master = "127.0.0.1:%d" % port
        grouped = run_cli(master, "--all-ranks", "query", "SELECT thread_name, count(*) AS n FROM python.threads "
                          "WHERE thread_name = 'MainThread' GROUP BY ALL", "-f", "json")
        assert grouped.code == 0, grouped.err
        assert json.loads(grouped.out) == [{"rank": r, "host": json.loads(grouped.out)[r]["host"],
                                            "thread_name": "MainThread", "n": 1} for r in (0, 1)]
        merged = run_cli(master, "--all-ranks", "query", "SELECT func FROM python.backtrace WHERE depth = 0 AND "
                         "thread_name = 'MainThread'", "--merge", "SELECT func, list(rank ORDER BY rank) AS ranks "
                         "FROM result GROUP BY ALL", "-f", "json")
        assert merged.code == 0, merged.err
        assert json.loads(merged.out) == [{"func": "Condition.wait", "ranks": [0, 1]}]
        diagnosed = run_cli(master, "diagnose", timeout=scaled(60))
        assert diagnosed.code == 0 and "healthy" in diagnosed.out, diagnosed.out + diagnosed.err
        loaded = run_cli(master, "--all-ranks", "eval", LOADED)
        assert loaded.out.strip() == "ranks 0-1: []", loaded.out + loaded.err
