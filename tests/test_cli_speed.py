"""The commands people run in loops import only what they need (issue 24): ``backtrace``, ``query``,
``health``, ``list`` and ``ranks`` run without click, DuckDB, pyarrow, the diagnosis or the injector, and
a command line read without click prints the same bytes, with the same exit code, as through click."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from procs import REPO, run_cli, scaled, spawn, target_env
from test_bench_results import docs_texts, report_module
from test_node_helper import ranks_of

from probe.cli.app import COMMANDS
from probe.cli.fast import FAST

ALWAYS_HEAVY = {"click", "duckdb", "pyarrow", "probe.cli.group", "probe.cli.options", "probe.diagnose", "probe.snapshot",
                "probe.engine", "probe.tables"}
"""Modules none of these commands needs: click (their command lines are read without it), the SQL engine and
Arrow (the agent runs the query), the diagnosis, snapshots."""
HEAVY = ALWAYS_HEAVY | {"dataclasses", "inspect", "secrets", "hashlib", "datetime", "probe.injector", "probe.agent",
                        "probe.reader", "probe.client.cluster"}
"""What a plain answer over the unix socket (backtrace, query, health) needs none of."""

_MODULES_AT_EXIT = """
import atexit, sys
OUT = sys.argv[1]
def write():
    with open(OUT, "w") as handle:
        handle.write("\\n".join(sorted(sys.modules)))
atexit.register(write)
sys.argv = ["probe"] + sys.argv[2:]
from probe.cli import main
main()
"""


@pytest.fixture(scope="module")
def idle():
    proc = spawn("idle.py")
    yield proc
    proc.kill()


def _modules(tmp_path, *args, env=None):
    """The modules loaded by the real command ``probe ARGS`` when it exits, and its result."""
    out = tmp_path / "modules.txt"
    done = subprocess.run([sys.executable, "-c", _MODULES_AT_EXIT, str(out), *args], capture_output=True, text=True,
                          timeout=60, env=env or target_env(probe=False), cwd=REPO)
    return set(out.read_text().split()), done


def _heavy(modules, heavy=HEAVY):
    return sorted(m for m in modules if any(m == h or m.startswith(h + ".") for h in heavy))


@pytest.mark.parametrize("args", [
    ["backtrace"], ["backtrace", "--json"], ["query", "SELECT func, file, lineno FROM python.backtrace LIMIT 5"],
    ["query", "SELECT 1 AS one", "-F", "csv"], ["health"], ["health", "--json"],
])
def test_a_command_run_in_loops_imports_only_what_it_needs(idle, tmp_path, args):
    for _ in range(3):  # an agent whose heartbeat is late (a loaded machine) is looked at from outside first
        modules, done = _modules(tmp_path, str(idle.pid), *args)
        assert done.returncode == 0, done.stderr
        assert done.stdout
        if not _heavy(modules):
            break
    assert _heavy(modules) == [], done.stdout[:200]


def test_list_and_ranks_import_no_click_either(tmp_path):
    """list reads /proc, crash records and the injector's scan; ranks asks the node helper: neither needs
    click, the SQL engine or the diagnosis."""
    modules, done = _modules(tmp_path, "list", "--agents-only")
    assert done.returncode == 0, done.stderr
    assert _heavy(modules, ALWAYS_HEAVY) == []
    # of the injector, its scan and its package records only: not gdb's driver (~18 ms of imports)
    assert _heavy(modules, {"probe.injector.inject", "probe.injector.gdb", "probe.injector.methods"}) == []
    with ranks_of(tmp_path, 1) as job:
        deadline = time.monotonic() + scaled(30)
        while True:  # the node helper is the rank's to start
            modules, done = _modules(tmp_path, "127.0.0.1:%d" % job["port"], "ranks", "--json", env=job["env"])
            if done.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert done.returncode == 0, done.stderr
        assert [r["rank"] for r in json.loads(done.stdout)] == [0]
        assert _heavy(modules, ALWAYS_HEAVY | {"probe.injector", "dataclasses"}) == []


def test_help_still_lists_every_command_with_its_summary(tmp_path):
    modules, done = _modules(tmp_path, "--help")
    assert done.returncode == 0
    assert "click" in modules  # help is click's
    listed = done.stdout.split("Commands:", 1)[1]
    assert re.findall(r"^  (\S+) +\S", listed, re.M) == list(COMMANDS)


@pytest.mark.parametrize("args", [
    ["backtrace"], ["backtrace", "--json"], ["backtrace", "-F", "json", "-F", "text"], ["backtrace", "--json", "-F", "text"],
    ["backtrace", "extra"], ["backtrace", "-F", "csv"], ["--timeout", "inf", "PID", "backtrace"],
    ["--timeout", "0", "PID", "backtrace"], ["-t", "PID", "-t", "PID", "health"], ["-t", "PID", "-t", "999999", "health"],
    ["health"], ["--token-file", "/", "PID", "health"],
    ["query", "SELECT 1 AS a, 'x' AS b"], ["query", "SELECT 1 AS a", "-f", "json"], ["query", "-x", "SELECT 1 AS a"],
    ["query", "SELECT 1 AS a", "--max-rows", "-1"], ["query", "SELECT 1 AS a", "--query-timeout", "nan"],
    ["query", "SELECT 1 AS a", "--max-rows", "1", "--query-timeout", "5", "--wide"],
    ["query", "SELECT 1 AS a", "--max-memory", "512MB"], ["query", "SELECT 1 AS a", "--max-memory", "lots"],
    ["query", "SELECT '\x1b[31mred\u202e' AS s"], ["query", "SELECT '\x1b[31mred' AS s", "--json"],
    ["query", "SELEC 1"], ["query"], ["query", "SELECT 1", "SELECT 2"],
    ["query", "SELECT 1", "-F", "json", "--json", "-f", "csv"],
    ["query", "SELECT 1 AS a", "--merge", "SELECT * FROM result"], ["query", "SELECT 1 AS a", "-o", "/nonexistent/a.csv"],
    ["query", "SELECT 1 AS a", "-o", "/"], ["query", "SELECT 1 AS a", "-o", "/nonexistent/a.csv", "-F", "json"],
    ["--via", "direct", "PID", "health"], ["--via", "sideways", "PID", "health"], ["--wait", "5", "PID", "backtrace"],
    ["999999", "backtrace"], ["999999", "query", "SELECT 1"], ["unix:/nonexistent", "health"], ["PID", "nosuch"],
])
def test_read_without_click_or_through_it_the_same_bytes(idle, args):
    args = [str(idle.pid) if a == "PID" else a for a in args]
    if str(idle.pid) not in args and not args[0].startswith(("999999", "unix:")) and "-t" not in args:
        args = [str(idle.pid)] + args
    env = target_env(probe=False, COLUMNS="100")
    fast = run_cli(*args, env=env)
    slow = run_cli(*args, env=dict(env, PROBE_CLI_FAST="0"))
    assert (fast.code, fast.out, fast.err) == (slow.code, slow.out, slow.err)


def test_the_fast_way_is_taken_only_where_it_reads_everything(idle, tmp_path):
    """A command line with what the fast way does not read goes to click: its help, an across-ranks
    option, an option written --opt=value."""
    for args in (["backtrace", "--help"], ["--max-in-flight", "4", str(idle.pid), "backtrace"],
                 [str(idle.pid), "query", "SELECT 1", "--format=json"]):
        modules, done = _modules(tmp_path, *args)
        assert "click" in modules, args


def test_the_fast_way_knows_every_global_option_of_the_click_group():
    """A global option of the group (probe/cli/group.py) is either read by probe.cli.fast, which then makes
    the CliContext the group makes, or left to click: a command line that gives it, or an environment that
    sets its variable, goes through click. Else the fast way would silently run without it. Both come from
    probe.cli.spec.GLOBAL_PARAMS; this holds the group to it."""
    from probe.cli import fast
    from probe.cli.spec import GLOBAL_PARAMS

    declared = {decl: p for p in GLOBAL_PARAMS for decl in p.decls}
    from probe.cli.group import cli

    for param in cli.params:
        for opt in param.opts + param.secondary_opts:
            if opt in ("--version", "-h", "--help"):
                continue  # click's own, which fast.parse leaves to it (no declaration has them)
            assert opt in declared, "declare %s in probe/cli/spec.py GLOBAL_PARAMS, not in group.py" % opt
            assert declared[opt].dest == param.name
            if declared[opt].fast:
                assert fast._GLOBAL[opt] is declared[opt]
        variables = [param.envvar] if isinstance(param.envvar, str) else param.envvar or []
        for variable in variables:
            assert param.name in {p.dest for p in GLOBAL_PARAMS if p.envvar == variable}, variable
    cacert = [p for p in GLOBAL_PARAMS if p.envvar and not p.fast][0]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(cacert.envvar, "/nonexistent.pem")  # a variable of an option left to click: click's
        assert fast.parse(["--target", "1", "health"]) is None
        patch.delenv(cacert.envvar)
        assert fast.parse(["--target", "1", "health"]) is not None


_QUICK_AT_EXIT = """
import atexit, sys
OUT = sys.argv[1]
calls = {"hand_over": 0, "start": 0, "taken": 0}
def write():
    with open(OUT, "w") as handle:
        handle.write("\\n".join(sorted(sys.modules) + ["%s=%d" % item for item in sorted(calls.items())]))
atexit.register(write)
sys.argv = ["probe"] + sys.argv[2:]
if "--spy" in sys.argv:  # counts hand-overs and reads ahead, each calling through to the real one
    sys.argv.remove("--spy")
    import probe.client.connection as connection, probe.reader.ahead as ahead
    def counted(name, real, count=lambda result: True):
        def call(*args):
            result = real(*args)
            calls[name] += bool(count(result))
            return result
        return call
    connection.hand_over = counted("hand_over", connection.hand_over)
    ahead.start = counted("start", ahead.start)
    ahead.take = counted("taken", ahead.take, lambda result: result is not None)
from probe.cli import main
main()
"""

QUICK_NEVER = ("typing", "threading", "socket", "subprocess", "probe.client", "probe.cli.fast", "probe.cli.app",
               "probe.cli.output", "click")
"""What ``probe PID backtrace`` answered by ``probe.cli.quick`` does without."""


def _quick_modules(tmp_path, *args, spy=False):
    """The modules of ``python -S`` (no site: this machine's .pth files import typing) running ``probe ARGS``;
    with ``spy``, how often it handed a request over, started a read ahead and took one; and its result."""
    out = tmp_path / "modules.txt"
    done = subprocess.run([sys.executable, "-S", "-c", _QUICK_AT_EXIT, str(out), *args, *(["--spy"] if spy else [])],
                          capture_output=True, text=True, timeout=60, env=target_env(probe=False), cwd=REPO)
    lines = out.read_text().split()
    calls = dict((k, int(v)) for k, _, v in (line.partition("=") for line in lines[-3:]))
    return set(lines[:-3]), calls, done


def test_a_plain_backtrace_is_answered_before_the_rest_of_the_client_is_imported(idle, tmp_path):
    """``probe PID backtrace`` is what people time against py-spy: answered by probe.cli.quick, with the
    standard library's C modules and three small modules of probe's, printing what the usual path prints."""
    usual = run_cli(str(idle.pid), "backtrace", env=target_env(probe=False, PROBE_CLI_FAST="0"))
    assert usual.code == 0 and "Thread" in usual.out, usual.err
    for _ in range(3):  # an agent whose heartbeat is late (a loaded machine) is left to the usual path
        modules, _, done = _quick_modules(tmp_path, str(idle.pid), "backtrace")
        assert (done.returncode, done.stdout, done.stderr) == (0, usual.out, usual.err)
        if "probe.client" not in modules:
            break
    assert "probe.cli.quick" in modules and "probe._paths" in modules
    assert sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in QUICK_NEVER)) == []


def test_the_quick_backtrace_leaves_every_other_command_line_to_the_usual_path(idle, tmp_path):
    """An option, another command, a variable the CLI reads, or PROBE_CLI_FAST=0: probe.cli.quick sends nothing."""
    from probe.cli import quick

    pid = str(idle.pid)
    for args in ([pid, "backtrace", "--json"], ["-t", pid, "backtrace"], [pid, "health"], ["backtrace", pid],
                 ["+%s" % pid, "backtrace"], ["\u0661", "backtrace"]):
        assert quick.run(args) is None, args
    for variable in quick.ENVIRONMENT + ("PROBE_CLI_FAST",):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(variable, "0")
            assert quick.run([pid, "health"]) is None
            assert quick.run([pid, "backtrace"]) is None, variable


def test_the_quick_backtrace_knows_every_variable_the_cli_reads():
    """With one of the group's variables set (a token, TLS, --via), the usual path reads the command line."""
    from probe.cli import quick
    from probe.cli.spec import GLOBAL_PARAMS

    assert set(quick.ENVIRONMENT) == {p.envvar for p in GLOBAL_PARAMS if p.envvar}


def test_a_request_the_agent_does_not_answer_at_once_is_handed_to_the_usual_watch(target_factory, tmp_path):
    """Where the agent cannot answer within the grace time (a C call keeps the GIL), the request
    probe.cli.quick sent goes on in the usual path: the process is watched, its stacks read from outside."""
    proc = target_factory("hung.py", "gil")
    deadline = time.monotonic() + scaled(10)
    while not _in_sleep(proc.pid):
        assert time.monotonic() < deadline, "the target never entered its sleep"
        time.sleep(0.01)
    modules, calls, done = _quick_modules(tmp_path, str(proc.pid), "backtrace", spy=True)
    assert done.returncode == 0, done.stderr
    assert "hold_gil" in done.stdout and "holds the GIL in hold_gil" in done.stderr, done.stderr
    assert "probe.client.outside" in modules
    # Handed over where its heartbeat was fresh at the quick look (within 0.45 s of the hold's start;
    # on a loaded machine it may not be: the usual path then decided before connecting at all).
    assert calls["hand_over"] in (0, 1) and calls["start"] == 0
    if calls["hand_over"]:
        again = run_cli(str(proc.pid), "backtrace")
        assert again.code == 0 and "hold_gil" in again.out, again.err


def test_a_process_without_agent_is_read_from_its_memory_before_the_rest_is_imported(target_factory, tmp_path):
    """No agent, the plain case (a process of ours that asks for none): probe.cli.quick reads its stacks from its
    memory (probe.reader.memory) and says why no agent answers in the client's words: the same bytes as the
    usual path, without the client, the injector, py-spy or typing."""
    proc = target_factory("idle.py", probe=False, wait_socket=False)
    for _ in range(10):  # a thread of the target may run through a read's every try: the usual path reads then
        modules, _, done = _quick_modules(tmp_path, str(proc.pid), "backtrace")
        if "probe.client" not in modules:
            break
    usual = run_cli(str(proc.pid), "backtrace", env=target_env(probe=False, PROBE_CLI_FAST="0"))
    assert (done.returncode, done.stdout, done.stderr) == (usual.code, usual.out, usual.err)
    assert done.returncode == 0 and "no agent in process %d" % proc.pid in done.stderr, done.stderr
    assert "by probe, none of its threads running during the read" in done.stderr, done.stderr
    assert "probe.reader.memory" in modules
    for _ in range(10):
        _, calls, done = _quick_modules(tmp_path, str(proc.pid), "backtrace", spy=True)
        if "by probe" in done.stderr:
            break
    assert (calls["start"], calls["hand_over"]) == (0, 0), done.stderr  # (--spy imports the client's connection)
    never = QUICK_NEVER + ("probe.injector", "probe.reader.live", "probe.reader.stacks", "re", "linecache", "collections")
    assert sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in never)) == []


def test_a_process_without_agent_is_read_by_the_py_spy_run_started_ahead(target_factory, tmp_path):
    """No agent, and a process its own reader cannot read (its threads run Python all the time): probe.cli.quick
    starts py-spy's read at once,
    says why no agent answers as the client does (probe.client.explain) and takes that read instead of
    starting another: the same words and stacks as the usual path, without the rest of the CLI and the client."""
    from probe.reader import pyspy_source

    if pyspy_source.binary() is None:
        pytest.skip("py-spy is not installed")
    proc = target_factory("mutual_recursion.py", probe=False, wait_socket=False)
    modules, calls, done = _quick_modules(tmp_path, str(proc.pid), "backtrace", spy=True)
    assert done.returncode == 0 and "no agent in process %d" % proc.pid in done.stderr, done.stderr
    assert "by py-spy, which stopped it for the read" in done.stderr, done.stderr
    assert (calls["start"], calls["taken"], calls["hand_over"]) == (1, 1, 0)
    left_out = ("subprocess", "probe.cli.fast", "probe.cli.output", "probe.client.client")  # (--spy imports connection)
    assert [m for m in left_out if m in modules] == []
    # a process its own reader reads, not the plain case (its own TMPDIR: the client looks for its agent there):
    # the usual path explains, and reads it from memory as well; no py-spy started ahead
    own = target_factory("idle.py", probe=False, wait_socket=False, env=target_env(probe=False, TMPDIR=str(tmp_path)))
    for _ in range(5):
        modules, calls, done = _quick_modules(tmp_path, str(own.pid), "backtrace", spy=True)
        if "by probe" in done.stderr:
            break
    usual = run_cli(str(own.pid), "backtrace", env=target_env(probe=False, PROBE_CLI_FAST="0"))
    assert (done.returncode, done.stdout, done.stderr) == (usual.code, usual.out, usual.err)
    assert "probe.client.explain" in modules and calls["start"] == 0, done.stderr
    stopped = target_factory("idle.py", probe=False, wait_socket=False)
    os.kill(stopped.pid, signal.SIGSTOP)  # read as it is, by a command of its own: none is started ahead
    try:
        _, calls, done = _quick_modules(tmp_path, str(stopped.pid), "backtrace", spy=True)
    finally:
        os.kill(stopped.pid, signal.SIGCONT)
    assert calls["start"] == 0 and done.returncode == 0, done.stderr


def _in_sleep(pid):
    try:
        with open("/proc/%d/task/%d/syscall" % (pid, pid)) as handle:
            return handle.read().split()[0] in ("35", "230")
    except (OSError, IndexError):
        return False


def _sample(command, param):
    """A value that click takes for ``param`` (tried in turn), as a command line's word."""
    import click

    for value in ("1", "512MB", "json", "table", "out.csv", "SELECT 1"):
        try:
            param.type_cast_value(click.Context(command), value)
            if param.callback is not None:
                param.callback(click.Context(command), param, value)
            return value
        except click.BadParameter:
            continue
    raise AssertionError("no sample value for %s" % param.opts)


@pytest.mark.parametrize("name", FAST)
def test_every_option_of_a_fast_command_is_read_the_same_without_click(name):
    """Each option and argument that click gives a command run in loops (backtrace, query, ...) is read by
    probe.cli.fast too, into the same keyword with the same value: its command line is not left to click
    for want of it, and where it is not given, both pass the same default."""
    from probe.cli import fast
    from probe.cli.group import cli

    command = cli.get_command(None, name)
    arguments = [_sample(command, p) for p in command.params if p.param_type_name == "argument"]

    def both(words):
        ctx = command.make_context(name, list(words) + arguments)
        parsed = fast.parse(["--target", "1", name] + list(words) + arguments)
        assert parsed is not None, "fast.parse left %s %s to click" % (name, words)
        return ctx.params, parsed[3]

    options = [p for p in command.params if p.param_type_name == "option"]
    assert options
    for param in options:
        for opt in param.opts + param.secondary_opts:
            words = [opt] if param.is_flag else [opt, _sample(command, param)]
            by_click, by_fast = both(words)
            assert by_fast == by_click, words
    by_click, by_fast = both([])
    assert by_fast == by_click


def test_text_shown_as_it_is_without_the_pattern_is_exactly_what_the_pattern_leaves():
    """render.visible returns printable text as it is, without the regular expression (11 of the 15 ms
    of rendering a 65-thread backtrace here): no printable character is one that the patterns escape."""
    from probe.cli import render

    for lines in (False, True):
        pattern = render._pattern(lines)
        assert not [hex(c) for c in range(0x110000) if chr(c).isprintable() and pattern.search(chr(c))]
    assert render.visible("a\tb\nc", lines=True) == "a\tb\nc"
    assert render.visible("a\u202eb\x1b[2J\tc\n", lines=True) == "a\\u202eb\\x1b[2J\tc\n"
    assert render.visible("a\tb") == "a\\tb"


def test_the_readme_quotes_the_figures_of_the_cli_bench():
    """The figures of the command's speed that README (or a page of the docs site) quotes are those of the newest
    bench/bench_cli_speed.py record in bench/results/."""
    report = report_module()
    found = report.newest(report.load(), "bench_cli_speed")
    assert found, "no record of bench/bench_cli_speed.py in bench/results/"
    name, record = found
    runs = [re.match(r"^SUMMARY: backtrace ([\d.]+)x py-spy at 65 threads; backtrace ([\d.]+)x py-spy at 257 "
                     r"threads; query ([\d.]+) ms \(main idle\)$", line) for line in record["summary"]]
    runs = [m for m in runs if m]
    assert runs, "no SUMMARY line in %s" % name
    at65, at257, query = runs[-1].groups()
    quoted = ("`probe PID backtrace` at %s× py-spy's time with 65 threads and %s× with 257 (a busy main thread), "
              "`probe PID query` on python.backtrace in %s ms" % (at65, at257, query))
    assert any(quoted in text for text in docs_texts()), quoted
