"""One output convention for every command; time options that refuse what no clock holds; a command line
without a command; the words of grouped output across ranks (issue 17, items 17, 20, 23)."""

import glob
import json
import os
import re

import click
import pytest

from procs import REPO, run_cli, spawn
from terminal import Terminal

from probe.cli.app import COMMANDS
from probe.cli.group import cli
from probe.cli.render_cluster import RankStacks, render_grouped_backtrace
from probe.client.results import Frame

NO_OUTPUT_FORMAT = {"repl", "debug", "trace export", "mcp"}
"""Commands that print no result a script could read: an interactive console, instructions, a file, the MCP protocol."""


def _commands():
    ctx = click.Context(cli)
    for name in COMMANDS:
        command = cli.get_command(ctx, name)
        subcommands = getattr(command, "commands", None)
        if subcommands:
            for sub, subcommand in subcommands.items():
                yield "%s %s" % (name, sub), subcommand
        else:
            yield name, command


def _options(command):
    return {opt for param in command.params for opt in param.opts}


@pytest.fixture(scope="module")
def idle():
    proc = spawn("idle.py")
    yield proc
    proc.kill()


# -- item 17: --json and -F on every command that prints a result ----------------------------------------


def test_every_command_that_prints_a_result_takes_json_and_format():
    for name, command in _commands():
        if name in NO_OUTPUT_FORMAT:
            continue
        options = _options(command)
        assert {"--json", "-F", "--format"} <= options, "%s takes %s" % (name, sorted(options))
    eval_command = dict(_commands())["eval"]
    assert "-f" in _options(eval_command) and "--file" in _options(eval_command)  # eval -f FILE, as before


def test_the_spellings_agree_and_the_old_ones_still_work(idle, tmp_path):
    pid = str(idle.pid)
    sql = "SELECT 41 + 1 AS n"
    expected = [{"n": 42}]
    for spelling in (["--json"], ["-F", "json"], ["--format", "json"], ["-f", "json"], ["--format=json"]):
        result = run_cli(pid, "query", sql, *spelling)
        assert result.code == 0 and json.loads(result.out) == expected, (spelling, result.err)
    assert run_cli(pid, "query", sql, "-F", "csv").out == "n\n42\n"
    for command in (["backtrace"], ["health"], ["tables"], ["schema", "process.info"], ["eval", "1 + 1"]):
        short, long = run_cli(pid, *command, "--json"), run_cli(pid, *command, "-F", "json")
        assert short.code == long.code == 0, (command, short.err, long.err)
        json.loads(short.out.splitlines()[0])
        json.loads(long.out.splitlines()[0])
    assert json.loads(run_cli(pid, "eval", "-F", "json", "6 * 7").out)["value"] == "42"
    snippet = tmp_path / "snippet.py"
    snippet.write_text("print('from the file')\n")
    assert run_cli(pid, "eval", "-f", str(snippet)).out == "from the file\n"


def test_contradicting_formats_and_eval_f_json_are_refused_with_the_way_out(idle):
    pid = str(idle.pid)
    both = run_cli(pid, "query", "SELECT 1", "--json", "-F", "csv")
    assert both.code == 2 and "two output formats" in both.err, both.err
    wrong = run_cli(pid, "eval", "-f", "json")  # a file named json is not there: the user meant the output
    assert wrong.code == 2 and "Traceback" not in wrong.err, wrong.err
    assert "-f reads the snippet from a file" in wrong.err and "--json" in wrong.err, wrong.err


def test_the_readme_states_the_convention():
    pages = [os.path.join(REPO, "README.md")] + glob.glob(os.path.join(REPO, "docs", "*.md"))
    docs = {path: open(path, encoding="utf-8").read() for path in pages}
    assert "takes `--json`, short for `-F json`" in docs[os.path.join(REPO, "docs", "reference.md")]
    for path, text in docs.items():  # the examples use the one convention
        assert not re.search(r"probe \$PID query .* -f json", text), path


# -- item 23: numbers no clock holds; a target with no command; native frames in the schema ------------------


@pytest.mark.parametrize("args", [
    ["query", "--query-timeout", "1e309", "SELECT 1"],
    ["query", "--query-timeout", "nan", "SELECT 1"],
    ["--timeout", "inf", "backtrace"],
    ["--timeout", "1e300", "backtrace"],
    ["--wait", "1e309", "backtrace"],
    ["--deadline", "nan", "backtrace"],
    ["eval", "--eval-timeout", "1e309", "1"],
    ["eval", "--on", "main", "--start-within", "nan", "1"],
])
def test_a_time_no_clock_can_hold_is_a_usage_error_not_a_traceback(idle, args):
    result = run_cli(str(idle.pid), *args)
    assert result.code == 2, (result.code, result.err)
    assert "Traceback" not in result.err and "is not a number of seconds" in result.err, result.err


def test_a_target_without_a_command_lists_the_commands(idle):
    result = run_cli(str(idle.pid))
    assert result.code == 2
    assert "probe %d COMMAND" % idle.pid in result.err, result.err
    for name in ("backtrace", "query", "eval", "health", "trace"):
        assert re.search(r"^  %s +\S" % name, result.err, re.M), result.err


def test_the_schema_of_python_backtrace_names_native_frames(idle):
    spec = json.loads(run_cli(str(idle.pid), "schema", "python.backtrace", "--json").out)
    said = {c["name"]: c["description"] for c in spec["columns"]}["frame_type"]
    assert "'native'" in said and "--native" in said and "later" not in said, said


# -- item 20: the words of grouped output across ranks ---------------------------------------------------------


def test_a_group_read_from_outside_names_its_ranks():
    frames = [Frame(1, "MainThread", 10, True, 0, "wait", "t.py", 3)]
    ranks = [RankStacks(0, frames), RankStacks(1, frames, "read from outside"), RankStacks(2, frames)]
    lines = list(render_grouped_backtrace(ranks, 3))
    assert lines[1] == "  ranks 0-2 (3)  [stack of rank 1 read from outside]", lines
    one = list(render_grouped_backtrace([RankStacks(5, frames, "read from outside")], 1))
    assert one[0] == 'Thread "MainThread": 1 distinct stack across 1 of 1 rank', one
    assert one[1] == "  rank 5 (1)  [stack of rank 5 read from outside]", one


@pytest.fixture(scope="module")
def pair():
    procs = [spawn("idle.py"), spawn("idle.py")]
    yield procs
    for proc in procs:
        proc.kill()


def test_one_rank_is_called_a_rank(pair):
    first = str(pair[0].pid)
    result = run_cli("-t", first, "-t", "127.0.0.1:1", "--all-ranks", "--deadline", "5", "backtrace",
                     timeout=60)
    assert result.code == 7, result.err
    assert "probe: 1 of 2 ranks gave no result (rank 1):" in result.err, result.err


def test_the_repl_across_ranks_prints_no_empty_headings(pair, tmp_path):
    term = Terminal(["-t", str(pair[0].pid), "-t", str(pair[1].pid), "--all-ranks"], tmp_path)
    try:
        term.expect("probe repl: ranks 0-1 (2)")
        term.expect(">>> ")
        term.send("x = 1\r")
        assert "==" not in term.expect(">>> ")  # nothing printed anywhere: no heading either
        term.send("print(x)\r")
        assert "== ranks 0-1 ==" in term.expect(">>> ")
        term.send("import os\r")
        term.expect(">>> ")
        term.send("print('me') if os.getpid() == %d else None\r" % pair[0].pid)
        shown = term.expect(">>> ")
        assert "== rank 0 ==" in shown and "== rank 1: no output ==" in shown, shown
        term.send("\x04")
        term.wait_exit()
    finally:
        term.close()
    one = Terminal(["-t", str(pair[0].pid), "-t", str(pair[1].pid), "--ranks", "1"], tmp_path)
    try:
        assert "probe repl: rank 1, Python" in one.expect(">>> ")
        one.send("\x04")
        one.wait_exit()
    finally:
        one.close()


@pytest.fixture(scope="module")
def torch_pair():
    pytest.importorskip("torch")
    procs = [spawn("inject_torch.py"), spawn("inject_torch.py")]
    yield procs
    for proc in procs:
        proc.kill()


def test_trace_across_ranks_prints_what_the_ranks_share_once(torch_pair):
    args = ["-t", str(torch_pair[0].pid), "-t", str(torch_pair[1].pid), "--all-ranks", "trace"]
    for sub in ("start", "status", "stop"):
        result = run_cli(*args, sub)
        assert result.code == 0, result.err
        lines = result.out.splitlines()
        assert lines[0] == "ranks 0-1:" and lines.count("ranks 0-1:") == 1, result.out
        assert all(line.startswith("  ") for line in lines[1:]), result.out
    as_json = [json.loads(line) for line in run_cli(*args, "status", "--json").out.splitlines()]
    assert [a["rank"] for a in as_json] == [0, 1]
