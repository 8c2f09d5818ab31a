"""The CLI end to end against real target processes: every command of the core as a user runs it."""

import json
import os
import time

import pytest

from procs import TARGETS, run_cli, target_env

IDLE = os.path.join(TARGETS, "idle.py")


def _line_of(path: str, needle: str) -> int:
    with open(path) as handle:
        for number, line in enumerate(handle, 1):
            if needle in line:
                return number
    raise AssertionError("%r not in %s" % (needle, path))


def test_backtrace_shows_every_thread_innermost_first(idle_target):
    result = run_cli(str(idle_target.pid), "backtrace")
    assert result.code == 0, result.err
    out = result.out
    assert 'Thread' in out and '"MainThread"' in out and '"loader-0"' in out and '"heartbeat"' in out
    wait_line = _line_of(IDLE, "stop.wait()")
    assert "data_loader_wait (%s:%d)" % (IDLE, wait_line) in out
    block = out.split('"loader-0"', 1)[1].split("\nThread ", 1)[0]
    # innermost first: Event.wait is printed above the function that called it
    assert block.index("Event.wait") < block.index("data_loader_wait") < block.index("Thread.run")
    assert "stop.wait()" in block  # the source line is shown
    assert "probe-" not in out  # the agent's own threads are left out


def test_backtrace_json_gives_the_rows_of_python_backtrace(idle_target):
    result = run_cli(str(idle_target.pid), "backtrace", "--json")
    assert result.code == 0, result.err
    rows = json.loads(result.out)
    loader = sorted((r for r in rows if r["thread_name"] == "loader-0"), key=lambda r: r["depth"])
    assert loader[0]["depth"] == 0 and loader[0]["func"] == "Condition.wait"
    assert any(r["func"] == "data_loader_wait" and r["lineno"] == _line_of(IDLE, "stop.wait()") for r in loader)
    assert {"thread_id", "thread_name", "native_id", "depth", "func", "file", "lineno", "frame_type", "code"} <= set(rows[0])


def test_query_as_table_json_and_csv(idle_target):
    sql = "SELECT func, file, lineno, depth FROM python.backtrace ORDER BY depth LIMIT 10"
    table = run_cli(str(idle_target.pid), "query", sql)
    assert table.code == 0, table.err
    assert table.out.splitlines()[0].split() == ["func", "file", "lineno", "depth"]
    assert "(10 rows)" in table.out

    as_json = run_cli(str(idle_target.pid), "query", "SELECT thread_name, count(*) AS n FROM python.backtrace GROUP BY 1",
                      "-f", "json")
    assert as_json.code == 0, as_json.err
    counts = {r["thread_name"]: r["n"] for r in json.loads(as_json.out)}
    assert counts["MainThread"] >= 2 and counts["loader-0"] >= 3

    as_csv = run_cli(str(idle_target.pid), "query", "SELECT pid, python_version FROM process.info", "-f", "csv")
    assert as_csv.code == 0, as_csv.err
    assert as_csv.out.splitlines() == ["pid,python_version", "%d,%s" % (idle_target.pid, as_csv.out.split(",")[-1].strip())]


def test_join_across_tables(idle_target):
    sql = ("SELECT t.thread_name, t.daemon, count(*) AS frames FROM python.backtrace b "
           "JOIN python.threads t USING (thread_id) GROUP BY ALL ORDER BY t.thread_name")
    result = run_cli(str(idle_target.pid), "query", sql, "-f", "json")
    assert result.code == 0, result.err
    rows = {r["thread_name"]: r for r in json.loads(result.out)}
    assert rows["loader-0"]["daemon"] is True and rows["MainThread"]["daemon"] is False


@pytest.mark.parametrize("ext", ["csv", "json", "parquet", "arrow"])
def test_query_output_files(idle_target, tmp_path, ext):
    pa = pytest.importorskip("pyarrow")
    path = tmp_path / ("out." + ext)
    result = run_cli(str(idle_target.pid), "query", "SELECT name, version FROM python.modules WHERE name = 'os' "
                     "OR name = 'threading' ORDER BY name", "-o", str(path))
    assert result.code == 0, result.err
    assert "wrote 2 rows" in result.err
    if ext == "csv":
        assert path.read_text().splitlines()[0] == "name,version"
    elif ext == "json":
        assert [r["name"] for r in json.loads(path.read_text())] == ["os", "threading"]
    elif ext == "parquet":
        import pyarrow.parquet as pq

        assert pq.read_table(path).column("name").to_pylist() == ["os", "threading"]
    else:
        with pa.memory_map(str(path)) as source:
            assert pa.ipc.open_file(source).read_all().column("name").to_pylist() == ["os", "threading"]


def test_several_targets_add_a_target_column(target_factory):
    first, second = target_factory("idle.py"), target_factory("idle.py")
    result = run_cli("-t", str(first.pid), "-t", str(second.pid), "query", "SELECT pid FROM process.info", "-f", "json")
    assert result.code == 0, result.err
    rows = json.loads(result.out)
    assert rows == [{"target": str(first.pid), "pid": first.pid}, {"target": str(second.pid), "pid": second.pid}]


def test_eval_prints_output_and_value(idle_target, tmp_path):
    result = run_cli(str(idle_target.pid), "eval", "import threading; print(sorted(t.name for t in threading.enumerate()"
                     " if not t.name.startswith('probe-')))")
    assert result.code == 0, result.err
    assert result.out.strip() == str(sorted(["MainThread", "heartbeat", "loader-0"]))

    value = run_cli(str(idle_target.pid), "eval", "counter['n'] > 0")  # the target's own __main__ namespace
    assert (value.code, value.out.strip()) == (0, "True")

    stdin = run_cli(str(idle_target.pid), "eval", "-", input="x = 6\nx * 7\n")
    assert (stdin.code, stdin.out.strip()) == (0, "42")

    snippet = tmp_path / "snippet.py"
    snippet.write_text("import os\nprint('pid', os.getpid())\n")
    from_file = run_cli(str(idle_target.pid), "eval", "-f", str(snippet))
    assert (from_file.code, from_file.out.strip()) == (0, "pid %d" % idle_target.pid)


def test_eval_exception_is_a_traceback_and_a_failure(idle_target):
    result = run_cli(str(idle_target.pid), "eval", "def f():\n    raise KeyError('missing')\nf()")
    assert result.code != 0
    assert "KeyError: 'missing'" in result.err and 'line 2, in f' in result.err
    assert "evaluator.py" not in result.err  # the agent's own frames are not shown


def test_tables_and_schema(idle_target):
    tables = run_cli(str(idle_target.pid), "tables")
    assert tables.code == 0, tables.err
    for name in ("python.backtrace", "python.threads", "python.modules", "process.info", "process.env"):
        assert name in tables.out
    schema = run_cli(str(idle_target.pid), "schema", "python.backtrace")
    assert schema.code == 0, schema.err
    for column in ("thread_id", "thread_name", "native_id", "depth", "func", "file", "lineno", "frame_type", "code"):
        assert "\n  %s " % column in schema.out
    missing = run_cli(str(idle_target.pid), "schema", "python.nothing")
    assert missing.code != 0 and "no table named 'python.nothing'" in missing.err and "tables" in missing.err


def test_health_and_list(idle_target):
    health = run_cli(str(idle_target.pid), "health", "--json")
    assert health.code == 0, health.err
    info = json.loads(health.out)
    assert info["pid"] == idle_target.pid and info["capabilities"]["eval"] is True
    listing = run_cli("list", "--json", "--agents-only")
    assert listing.code == 0, listing.err
    assert any(r["pid"] == idle_target.pid and r["agent"] == "yes" for r in json.loads(listing.out))


def test_probe_target_environment_variable(idle_target):
    env = target_env(probe=False, PROBE_TARGET=str(idle_target.pid))
    result = run_cli("query", "SELECT pid FROM process.info", "-f", "csv", env=env)
    assert result.code == 0, result.err
    assert result.out.split() == ["pid", str(idle_target.pid)]


def test_errors_say_what_to_do(target_factory):
    plain = target_factory("idle.py", probe=False)
    no_agent = run_cli(str(plain.pid), "eval", "1")  # (backtrace reads such a process from outside)
    assert no_agent.code == 3
    assert "no agent in process %d" % plain.pid in no_agent.err and "PROBE=1" in no_agent.err
    assert "inject" in no_agent.err

    gone = run_cli("4194303", "backtrace")
    assert gone.code == 3 and "no process with pid 4194303" in gone.err

    bad = run_cli("not-a-target", "backtrace")
    assert bad.code == 2 and "cannot understand target" in bad.err

    none = run_cli("backtrace")
    assert none.code == 2 and "no target given" in none.err

    refused = run_cli("--timeout", "2", "127.0.0.1:1", "health")
    assert refused.code == 3 and "127.0.0.1:1" in refused.err


def test_backtrace_json_equals_the_table_rows(idle_target):
    pid = str(idle_target.pid)
    from_backtrace = [r for r in json.loads(run_cli(pid, "backtrace", "--json").out) if r["thread_name"] == "loader-0"]
    from_sql = json.loads(run_cli(pid, "query", "SELECT * FROM python.backtrace WHERE thread_name = 'loader-0' "
                                  "ORDER BY depth", "-f", "json").out)
    assert from_backtrace == from_sql and len(from_sql) >= 4


def test_eval_leaves_the_targets_streams_as_they_were(idle_target, tmp_path):
    pid = str(idle_target.pid)
    during = run_cli(pid, "eval", "import sys; print(type(sys.stdout).__name__, type(sys.stderr).__name__)")
    assert (during.code, during.out.strip()) == (0, "_ThreadRouter _ThreadRouter")  # captured while it runs
    report = tmp_path / "after.txt"
    snippet = ("import sys, threading\n"
               "def look():\n"
               "    with open(%r, 'w') as f: f.write(str(sys.stdout is sys.__stdout__ and sys.stderr is sys.__stderr__))\n"
               "threading.Timer(0.3, look).start()" % str(report))
    assert run_cli(pid, "eval", snippet).code == 0
    deadline = time.monotonic() + 10
    while not report.exists() or not report.read_text():
        assert time.monotonic() < deadline, "the target never reported its streams"
        time.sleep(0.02)
    assert report.read_text() == "True"  # between snippets the target's own streams are back
