"""The CLI as a daily tool (issue 9): every failure one line with a working hint, limits said honestly,
output that fits a terminal. Each test drives the real ``probe`` command against a real agent; where the
terminal matters it runs under a pseudo-terminal (Ctrl-C, width) or with ``COLUMNS``."""

import http.server
import json
import os
import re
import socket
import subprocess
import threading
import time
import unicodedata

import pytest

from procs import REPO, run_cli, spawn, target_env
from test_bench_results import docs_texts, report_module
from terminal import has_socket, run_in_pty

SECRETS = {"MY_API_KEY": "k-123", "DB_PASSWORD": "hunter2", "HF_TOKEN": "hf_abc", "AWS_SECRET_ACCESS_KEY": "s3cr3t"}
CERTS = {"SSL_CERT_FILE": "/etc/ssl/certs/ca.pem", "SSL_CERT_DIR": "/etc/ssl/certs", "PIP_CERT": "/etc/pip/ca.pem",
         "NODE_EXTRA_CA_CERTS": "/etc/ssl/extra.pem"}


@pytest.fixture(scope="module")
def target():
    """One idle target with small ceilings and eval output cap, so that limits are cheap to reach."""
    env = target_env(PROBE_EVAL_TIMEOUT_CEILING="40", PROBE_EVAL_OUTPUT="1000", **SECRETS, **CERTS)
    proc = spawn("idle.py", env=env)
    yield proc
    proc.kill()


def _one_line_error(result, code: int) -> str:
    assert result.code == code, (result.code, result.out, result.err)
    assert "Traceback" not in result.err and "Traceback" not in result.out, result.err
    lines = [line for line in result.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("probe: "), result.err
    return lines[0]


def _width(text: str) -> int:
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


# -- a pseudo-terminal ---------------------------------------------------------------------------


def test_ctrl_c_during_an_eval_interrupts_the_snippet_and_exits_130(target, tmp_path):
    started, stopped = tmp_path / "started", tmp_path / "stopped"
    code = ("import time\nopen(%r, 'w').close()\ntry:\n    while True: time.sleep(0.02)\n"
            "except BaseException:\n    open(%r, 'w').close()\n    raise" % (str(started), str(stopped)))
    status, out, _ = run_in_pty([str(target.pid), "eval", code], when=lambda _: started.exists())
    assert status == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    lines = [line for line in out.splitlines() if line.strip() and line.strip() != "^C"]
    assert lines == ["probe: interrupted (Ctrl-C); the snippet was interrupted in the target"], out
    deadline = time.monotonic() + 5
    while not stopped.exists():  # the agent stopped the snippet in the target
        assert time.monotonic() < deadline, "the snippet went on running after Ctrl-C"
        time.sleep(0.02)


def test_ctrl_c_during_a_query_stops_it_in_the_agent_and_exits_130_with_one_line(target):
    status, out, _ = run_in_pty([str(target.pid), "query", "SELECT sum(hash(i)) FROM range(10000000000) t(i)"],
                                when=has_socket)
    assert status == 130, out
    assert "Traceback" not in out, out
    assert [line for line in out.splitlines() if line.strip() and line.strip() != "^C"] == \
        ["probe: interrupted (Ctrl-C); the query was stopped in the target"], out
    busy = "SELECT count(*) AS n FROM python.threads WHERE thread_name = 'probe-request'"
    deadline = time.monotonic() + 5  # the agent's own limit is 10 s: only the interrupt ends it sooner
    while json.loads(run_cli(str(target.pid), "query", busy, "-f", "json").out)[0]["n"] > 1:  # this query's own
        assert time.monotonic() < deadline, "the query went on running in the agent after Ctrl-C"
        time.sleep(0.05)


# -- output that fits ----------------------------------------------------------------------------


def test_a_table_fits_the_terminal_and_x_shows_cells_whole(target):
    status, out, _ = run_in_pty([str(target.pid), "query", "SELECT * FROM process.info"], columns=80)
    assert status == 0, out
    lines = out.rstrip("\n").splitlines()
    assert all(_width(line) <= 80 for line in lines), [(len(x), x) for x in lines]
    assert lines[0].startswith("-[ RECORD 1 ]") and "too wide for the terminal" in lines[-1], out
    status, out, _ = run_in_pty([str(target.pid), "query", "SELECT pid, cmdline, cwd, executable FROM process.info"],
                                columns=60)
    lines = out.rstrip("\n").splitlines()
    assert all(_width(line) <= 60 for line in lines) and lines[0].split() == ["pid", "cmdline", "cwd", "executable"]
    assert "…" in out and "-x or --wide shows them whole" in lines[-1], out

    vertical = run_cli(str(target.pid), "query", "SELECT * FROM process.info", "-x")
    assert vertical.code == 0, vertical.err
    cmdline = next(line for line in vertical.out.splitlines() if line.startswith("cmdline "))
    assert cmdline.rstrip().endswith("tests/targets/idle.py") and "…" not in vertical.out
    assert vertical.out.splitlines()[0].startswith("-[ RECORD 1 ]")

    wide = run_cli(str(target.pid), "query", "SELECT * FROM process.info", "--wide", env=dict(target_env(probe=False),
                                                                                          COLUMNS="80"))
    assert max(len(line) for line in wide.out.splitlines()) > 80 and "…" not in wide.out


def test_probe_list_fits_the_terminal(target):
    result = run_cli("list", env=dict(target_env(probe=False), COLUMNS="80"))
    assert result.code == 0, result.err
    assert str(target.pid) in result.out
    assert all(_width(line) <= 80 for line in result.out.splitlines()), result.out


def test_wide_characters_keep_columns_aligned(target):
    result = run_cli(str(target.pid), "query", "SELECT '日本語' AS s, 'x' AS t")
    header, _, row = result.out.splitlines()[:3]
    assert _width(row[:row.index("x")]) == _width(header[:header.index("t")]), result.out


def test_json_is_valid_and_types_read_as_duckdb_writes_them(target):
    sql = "SELECT 'nan'::DOUBLE AS f, 'inf'::DOUBLE AS g, INTERVAL 1 HOUR AS i, 'a'::BLOB AS b"

    def refuse(name: str) -> None:
        raise AssertionError("invalid JSON constant %s" % name)

    result = run_cli(str(target.pid), "query", sql, "-f", "json")
    assert result.code == 0, result.err
    assert json.loads(result.out, parse_constant=refuse) == [{"f": None, "g": None, "i": "01:00:00", "b": "a"}]
    table = run_cli(str(target.pid), "query", sql)
    assert "01:00:00" in table.out and "b'a'" not in table.out


def test_files_written_say_rows_and_truncation(target, tmp_path):
    pytest.importorskip("pyarrow")
    one = run_cli(str(target.pid), "query", "SELECT 1 AS x", "-o", str(tmp_path / "one.csv"))
    assert one.code == 0 and "wrote 1 row to" in one.err, one.err
    cut = run_cli(str(target.pid), "query", "SELECT * FROM range(100)", "--max-rows", "5", "-o",
                  str(tmp_path / "cut.parquet"))
    assert cut.code == 0 and "wrote 5 rows" in cut.err and "truncated" in cut.err, cut.err


# -- one line that says what to do ---------------------------------------------------------------


def test_an_output_path_that_cannot_be_written_is_one_line(target):
    line = _one_line_error(run_cli(str(target.pid), "query", "SELECT 1", "-o", "/nonexistent/dir/x.csv"), 2)
    assert "/nonexistent/dir" in line


def test_conflicting_options_are_refused(target, tmp_path):
    snippet = tmp_path / "snip.py"
    snippet.write_text("print('from the file')\n")
    assert "both CODE and -f" in _one_line_error(run_cli(str(target.pid), "eval", "print(1)", "-f", str(snippet)), 2)
    assert "contradicts" in _one_line_error(run_cli(str(target.pid), "query", "SELECT 1", "-o", str(tmp_path / "o.csv"),
                                                    "-f", "json"), 2)
    assert not (tmp_path / "o.csv").exists()


def test_a_timed_out_eval_exits_5_keeps_its_output_and_says_how_far_to_go(target):
    result = run_cli(str(target.pid), "eval", "--eval-timeout", "0.5", "print('before', flush=True)\nwhile True: pass")
    assert result.code == 5, result.err
    assert result.out == "before\n"
    assert "raise it with --eval-timeout (this agent allows up to 40 s)" in result.err, result.err


def test_limits_above_the_ceiling_are_refused_with_the_ceiling(target):
    line = _one_line_error(run_cli(str(target.pid), "eval", "--eval-timeout", "45", "1"), 2)
    assert "ceiling of 40" in line and "PROBE_EVAL_TIMEOUT_CEILING" in line
    line = _one_line_error(run_cli(str(target.pid), "query", "--max-rows", "3000000", "SELECT 1"), 2)
    assert "ceiling of 1000000" in line
    raised = run_cli(str(target.pid), "query", "--max-rows", "120000", "-f", "csv", "SELECT * FROM range(150000)")
    assert raised.code == 0 and len(raised.out.splitlines()) == 120001, raised.err
    capped = run_cli(str(target.pid), "query", "SELECT * FROM range(100005)")
    assert capped.out.splitlines()[-1].startswith("(100000 rows) -- cut at 100000 rows, the agent's row cap; "
                                                  "ask for more with --max-rows")
    health = run_cli(str(target.pid), "health")
    assert "--eval-timeout up to 40s" in health.out and "--max-rows up to 1000000" in health.out, health.out


def test_global_timeout_bounds_an_eval_and_stops_it(target, tmp_path):
    from probe import _paths

    stopped = tmp_path / "stopped"
    code = "import time\ntry:\n    time.sleep(0.02)\n    while True: time.sleep(0.02)\nexcept BaseException:\n" \
           "    open(%r, 'w').close()\n    raise" % str(stopped)
    began = time.monotonic()
    result = run_cli("--timeout", "1", "unix:" + _paths.socket_path(target.pid), "eval", code)
    assert time.monotonic() - began < 8
    line = _one_line_error(result, 5)
    assert "within 1.0 s" in line and "the snippet was interrupted in the target" in line
    deadline = time.monotonic() + 5
    while not stopped.exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_eval_output_past_the_cap_is_said_on_stderr_not_in_stdout(target):
    result = run_cli(str(target.pid), "eval", "print('x' * 5000)")
    assert result.code == 0 and result.out == "x" * 1000, result.out[-80:]
    assert "4001 more characters" in result.err and "PROBE_EVAL_OUTPUT" in result.err


def test_eval_shows_no_write_count_and_no_parser_frames(target):
    written = run_cli(str(target.pid), "eval", "import sys; sys.stdout.write('x')")
    assert written.code == 0 and written.out == "x", written.out
    bad = run_cli(str(target.pid), "eval", "1 +")
    assert bad.code == 1 and "SyntaxError" in bad.err and "ast.py" not in bad.err and "probe/agent" not in bad.err


def test_a_http_server_that_is_no_agent(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        line = _one_line_error(run_cli("127.0.0.1:%d" % server.server_address[1], "health"), 3)
        assert "is not a probe agent" in line
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_a_pid_that_is_not_python_gets_no_inject_hint():
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        line = _one_line_error(run_cli(str(sleeper.pid), "eval", "1"), 3)
        assert "not a Python interpreter" in line and "inject" not in line
    finally:
        sleeper.kill()
        sleeper.wait(5)


def test_inject_needs_a_target_and_takes_probe_target(target):
    assert "no process given" in _one_line_error(run_cli("inject"), 2)
    env = dict(target_env(probe=False), PROBE_TARGET=str(target.pid))
    result = run_cli("inject", env=env)
    assert result.code == 0 and "an agent already runs there" in result.out, result.err


# -- the shape of the command --------------------------------------------------------------------


def test_a_target_after_the_command_is_understood(target):
    pid = str(target.pid)
    assert run_cli("health", pid).code == 0
    assert run_cli("backtrace", "-t", pid).code == 0
    result = run_cli("query", pid, "SELECT 41 + 1 AS n", "-f", "csv")
    assert result.code == 0 and result.out.splitlines() == ["n", "42"], result.err
    assert "probe TARGET query [OPTIONS] SQL" in run_cli("query", "--help").out
    assert "probe TARGET trace status" in run_cli("trace", "status", "--help").out


def test_top_level_help_keeps_whole_sentences():
    result = run_cli("--help", env=dict(target_env(probe=False), COLUMNS="80"))
    commands = result.out.split("Commands:", 1)[1]
    assert "..." not in commands, commands
    assert "those that could be attached" in " ".join(commands.split())


# -- files, addresses, secrets -------------------------------------------------------------------


def test_certificate_paths_are_shown_and_secrets_hidden(target):
    result = run_cli(str(target.pid), "query", "SELECT name, value, masked FROM process.env", "-f", "json")
    env = {r["name"]: r for r in json.loads(result.out)}
    for name, value in CERTS.items():
        assert env[name]["value"] == value and not env[name]["masked"], env[name]
    for name in SECRETS:
        assert env[name]["value"] == "********" and env[name]["masked"], env[name]


def test_tcp_agent_shows_the_address_to_use_and_its_token_file(target_factory):
    with socket.socket() as probe_port:
        probe_port.bind(("127.0.0.1", 0))
        port = probe_port.getsockname()[1]
    proc = target_factory("idle.py", env=target_env(PROBE_LISTEN="0.0.0.0:%d" % port))
    health = run_cli(str(proc.pid), "health")
    assert health.code == 0, health.err
    reach = "%s:%d" % (socket.gethostname(), port)
    assert "tcp: %s (bound to 0.0.0.0:%d); token in /" % (reach, port) in health.out, health.out
    listing = run_cli("list", "--wide")
    row = next(line for line in listing.out.splitlines() if line.startswith(str(proc.pid) + " "))
    assert "probe %s --token-file /" % reach in row and "0.0.0.0" not in row, row


def test_list_shows_an_agent_that_cannot_answer(target_factory):
    proc = target_factory("gil_sum.py")
    deadline = time.monotonic() + 10
    while True:
        rows = json.loads(run_cli("list", "--json").out)
        mine = [r for r in rows if r["pid"] == proc.pid]
        if mine and mine[0]["agent"] == "blocked":
            break
        assert time.monotonic() < deadline, mine
    assert "backtrace" in mine[0]["reach"]


def test_the_docs_list_the_threads_columns_and_the_limits_the_code_has(target):
    """docs/tables.md has python.threads' columns, and docs/agent.md the ceilings' variables and defaults."""
    with open(os.path.join(REPO, "docs", "tables.md"), encoding="utf-8") as handle:
        tables = handle.read()
    with open(os.path.join(REPO, "docs", "agent.md"), encoding="utf-8") as handle:
        agent = handle.read()
    row = next(line for line in tables.splitlines() if line.startswith("| `python.threads` |"))
    schema = json.loads(run_cli(str(target.pid), "schema", "python.threads", "--json").out)
    assert [c["name"] for c in schema["columns"]] == [w.strip("`,") for w in row.split(": ", 1)[1].rstrip(" |").split()]
    from probe.agent.limits import Ceilings

    for variable in ("PROBE_QUERY_TIMEOUT_CEILING", "PROBE_EVAL_TIMEOUT_CEILING", "PROBE_MAX_ROWS_CEILING",
                     "PROBE_EVAL_OUTPUT"):
        assert "`%s`" % variable in agent
    ceilings = Ceilings()
    assert "(%d s, %d s, %d)" % (ceilings.query_timeout, ceilings.eval_timeout, ceilings.max_rows) in agent


def test_the_readme_quotes_the_inject_figures_of_the_bench_file():
    """The inject figures README (or a page of the docs site) quotes are those of the newest bench_inject.py record
    in bench/results/ that measured the peers too (its last block of the torch target's wall times with them, as
    bench_inject.py prints them)."""
    lines = [line for _, record in report_module().load() if record["bench"] == "bench_inject"
             for line in record["output"]]
    blocks, wall = [], True
    for start, line in enumerate(lines):
        if line.startswith(("injection time", "CPU time")):  # the wall times, or the CPU times, of the ways
            wall = line.startswith("injection time")
        if line.strip() != "torch:" or not wall:
            continue
        block = []
        for line in lines[start + 1:]:
            if not line.startswith("  "):
                break
            block.append(line.strip())
        blocks.append(block)
    wanted = ("probe PID inject (CLI)", "baseline CLI", "debugpy run_python_code", "plain gdb, all symbols")
    block = [b for b in blocks if all(any(row.startswith(m + " ") for row in b) for m in wanted)][-1]

    def median(method: str) -> float:
        row = next(line for line in block if line.startswith(method + " "))
        return float(re.findall(r"(\d+\.\d+) s\b", row)[0])

    cli, before = median("probe PID inject (CLI)"), median("baseline CLI")
    peers = sorted(median(m) for m in ("debugpy run_python_code", "plain gdb, all symbols"))
    for quoted in ("`probe PID inject` in %.2f s on a process that imported torch" % cli,
                   "(%.2f s before gdb stopped reading debug information, same rounds; debugpy or plain gdb: "
                   "%.1f-%.1f s)" % (before, peers[0], peers[-1])):
        assert any(quoted in text for text in docs_texts()), quoted
