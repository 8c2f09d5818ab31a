"""The agent answers whatever the target's main thread is doing, survives fork, starts once, stays
light (no DuckDB or pyarrow before the first query, never torch), and serves users' own tables."""

import json
import os
import subprocess
import sys
import time
from typing import Iterator, List

import pytest
from procs import TARGETS, Proc, run_cli, running, target_env, wait_for_socket

import probe
from probe.errors import TorchNotLoaded
from probe import _paths

STATES = os.path.join(TARGETS, "states.py")
BOUND_S = 10.0  # a whole CLI command, start-up included, on a slow and noisy machine


def _marker_line(path: str, marker: str) -> int:
    with open(path) as handle:
        for number, line in enumerate(handle, 1):
            if line.rstrip().endswith(marker):
                return number
    raise AssertionError("no line ending in %r in %s" % (marker, path))


def _timed_cli(*args: str):
    started = time.monotonic()
    result = run_cli(*args, timeout=30)
    elapsed = time.monotonic() - started
    assert result.code == 0, "probe %s failed: %s" % (" ".join(args), result.err)
    assert elapsed < BOUND_S, "probe %s took %.1f s" % (" ".join(args), elapsed)
    return result


def _main_thread_block(backtrace_text: str) -> List[str]:
    """The frame lines of the main thread in ``probe PID backtrace`` output, innermost first."""
    blocks = backtrace_text.split("\n\n")
    main = [b for b in blocks if b.splitlines()[0].endswith("main)")]
    assert len(main) == 1, backtrace_text
    frame_lines = [line for line in main[0].splitlines()[1:] if not line.startswith("        ")]  # not source
    return [line.strip() for line in frame_lines if line.startswith("    ")]


# -- the main thread in every state --------------------------------------------------------------------

@pytest.mark.parametrize("mode, innermost", [
    ("sleep", "main_sleep"),
    ("busy", "main_busy"),
    ("lock", "main_lock"),
    ("event", "Condition.wait"),
    ("cwait", "main_cwait"),
])
def test_agent_answers_whatever_the_main_thread_does(target_factory, mode, innermost):
    proc = target_factory("states.py", mode)
    line = _marker_line(STATES, "# STATE:%s" % mode)
    client = probe.connect(str(proc.pid))
    first = int(client.eval("counter").value or "0")  # counts only in busy mode

    frames = _main_thread_block(_timed_cli(str(proc.pid), "backtrace").out)
    func = "main_%s" % mode
    where = [f for f in frames if f.startswith(func + " (")]
    assert len(where) == 1, frames
    lines = {line, line + 1} if mode == "busy" else {line}  # the loop is two lines
    assert where[0] in {"%s (%s:%d)" % (func, STATES, n) for n in lines}, where[0]
    assert frames[0].startswith(innermost + " ("), frames
    if mode == "event":
        assert frames[1].startswith("Event.wait (") and frames[2] == where[0]

    rows = json.loads(_timed_cli(str(proc.pid), "query",
                                 "SELECT func, lineno FROM python.backtrace WHERE is_main ORDER BY depth",
                                 "-f", "json").out)
    assert {"func": func, "lineno": min(lines)} in rows or {"func": func, "lineno": max(lines)} in rows
    assert rows[-1]["func"] == "<module>"

    assert _timed_cli(str(proc.pid), "eval", "6 * 7").out == "42\n"
    if mode == "busy":
        assert int(client.eval("counter").value or "0") > first  # it kept spinning while we asked


# -- fork ----------------------------------------------------------------------------------------------

def _socket_inodes(pid: int) -> set:
    out = set()
    fd_dir = "/proc/%d/fd" % pid
    for name in os.listdir(fd_dir):
        try:
            link = os.readlink(os.path.join(fd_dir, name))
        except OSError:
            continue
        if link.startswith("socket:"):
            out.add(link)
    return out


def _kill_child_of(parent: int, pid: int) -> None:
    """Kill ``pid`` if it is still ``parent``'s child (never a stranger that reused the pid)."""
    try:
        with open("/proc/%d/status" % pid) as handle:
            ppid = next(int(line.split()[1]) for line in handle if line.startswith("PPid:"))
        if ppid == parent:
            os.kill(pid, 9)
    except (OSError, StopIteration, ValueError):
        pass


def _eval_value(pid: int, code: str) -> str:
    result = probe.connect(str(pid)).eval(code)
    assert result.ok, result.error
    return result.value or ""


@pytest.mark.parametrize("child_agent", [False, True], ids=["child-without-agent", "child-with-own-agent"])
def test_a_forked_child_neither_serves_on_nor_removes_the_parents_socket(target_factory, tmp_path, child_agent):
    trigger = tmp_path / "child-exit"
    args = ["fork", str(trigger)] + (["agent"] if child_agent else [])
    proc = target_factory("states.py", *args)
    parent = proc.pid
    child = int(_eval_value(parent, "child_pid"))
    try:
        assert child > 0 and child != parent
        parent_socket = _paths.socket_path(parent)
        parent_inode = os.stat(parent_socket).st_ino
        if child_agent:
            wait_for_socket(child)
            assert probe.connect(str(child)).health()["pid"] == child
        else:
            assert not os.path.exists(_paths.socket_path(child))
            with pytest.raises(probe.ProbeError) as caught:
                probe.connect(str(child)).health()
            assert caught.value.code == "connect_error"
        # the child holds none of the parent's sockets, and every answer on the parent's comes from it
        assert not (_socket_inodes(parent) & _socket_inodes(child))
        for _ in range(5):
            assert probe.connect(str(parent)).health()["pid"] == parent

        trigger.write_text("")
        deadline = time.monotonic() + 10.0
        while _eval_value(parent, "child_exit") == "":  # None until the parent has reaped the child
            assert time.monotonic() < deadline, "the child did not exit after its trigger"
            time.sleep(0.05)
        assert _eval_value(parent, "child_exit") == "0"
        if child_agent:
            assert not os.path.exists(_paths.socket_path(child)), "the child's own socket outlived it"
        assert os.stat(parent_socket).st_ino == parent_inode, "the child's exit removed the parent's socket"
        assert probe.connect(str(parent)).health()["pid"] == parent
        backtrace = _timed_cli(str(parent), "backtrace").out
        assert "main_fork (%s:%d)" % (STATES, _marker_line(STATES, "# STATE:fork")) in backtrace
    finally:
        _kill_child_of(parent, child)  # the child also leaves by itself once its parent is gone


# -- starting, and staying light -----------------------------------------------------------------------

def test_starting_twice_returns_the_running_agent(idle_target):
    pid = str(idle_target.pid)
    same = run_cli(pid, "eval", "import probe; from probe.agent import current; "
                                "probe.start() is probe.start() is current()")
    assert same.code == 0, same.err
    assert same.out == "True\n"
    sql = "SELECT count(*) AS n FROM python.threads WHERE thread_name = 'probe-accept-unix'"
    threads = _timed_cli(pid, "query", sql, "-f", "json")
    assert json.loads(threads.out) == [{"n": 1}]


def test_duckdb_and_pyarrow_are_imported_only_by_the_first_query(idle_target):
    pid = str(idle_target.pid)
    loaded = "import sys; ('duckdb' in sys.modules, 'pyarrow' in sys.modules)"
    assert run_cli(pid, "eval", loaded).out == "(False, False)\n"
    _timed_cli(pid, "backtrace")
    _timed_cli(pid, "tables")
    _timed_cli(pid, "health")
    assert run_cli(pid, "eval", loaded).out == "(False, False)\n"
    _timed_cli(pid, "query", "SELECT 1")
    assert run_cli(pid, "eval", loaded).out == "(False, True)\n"  # DuckDB runs in the agent's worker process


def test_the_agent_never_imports_torch(idle_target):
    pid = str(idle_target.pid)
    client = probe.connect(pid)
    _timed_cli(pid, "backtrace")
    names = [t.name for t in client.tables()]
    assert "python.backtrace" in names and "torch.parameters" in names
    for name in names:  # every table, the torch ones included: those refuse, and import nothing
        try:
            client.query_rows("SELECT * FROM %s" % name)
            client.table_rows(name)
        except TorchNotLoaded:
            assert name.startswith("torch.") or name == "python.torch_trace", name
    assert run_cli(pid, "eval", "import sys; 'torch' in sys.modules").out == "False\n"


def test_the_agents_threads_are_daemon_threads(target_factory):
    proc = target_factory("idle.py", env=target_env(PROBE_LISTEN="127.0.0.1:0"))
    client = probe.connect(str(proc.pid))
    rows = client.query_rows("SELECT thread_name, daemon FROM python.threads WHERE is_agent").as_dicts()
    names = {r["thread_name"] for r in rows}
    assert {"probe-accept-unix", "probe-accept-tcp", "probe-request"} <= names
    assert all(r["daemon"] for r in rows), rows
    seen = client.eval("import threading; sorted({(t.name, t.daemon) for t in threading.enumerate() "
                       "if t.name.startswith('probe-')})")
    assert "('probe-eval', True)" in (seen.value or "") and "False" not in (seen.value or ""), seen


@pytest.mark.parametrize("value", [None, "0", ""])
def test_the_startup_hook_costs_nothing_when_probe_is_unset(value):
    env = target_env(probe=False) if value is None else target_env(probe=False, PROBE=value)
    code = "import sys; print('probe' in sys.modules, 'probe.agent' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code],
                          capture_output=True, text=True, env=env, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "False False\n"
    assert done.stderr == ""


# -- users' own tables ---------------------------------------------------------------------------------

def test_a_users_table_answers_sql_and_is_listed(target_factory):
    proc = target_factory("user_table.py")
    pid = str(proc.pid)
    rows = json.loads(_timed_cli(pid, "query", "SELECT step, loss FROM myapp.metrics ORDER BY step", "-f", "json").out)
    assert rows == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 1.25}, {"step": 3, "loss": 0.625}]

    listed = _timed_cli(pid, "tables").out
    assert any(line.split()[0] == "myapp.metrics" and "Loss per training step" in line for line in listed.splitlines())
    schema = _timed_cli(pid, "schema", "myapp.metrics").out
    assert "step" in schema and "BIGINT" in schema and "DOUBLE" in schema

    # live: the table's rows come from the target's state at query time
    assert run_cli(pid, "eval", "history.append((4, 0.3125))").code == 0
    latest = json.loads(_timed_cli(pid, "query", "SELECT max(step) AS s FROM myapp.metrics", "-f", "json").out)
    assert latest == [{"s": 4}]


def test_backtrace_joins_threads(idle_target):
    sql = ("SELECT threads.thread_name, daemon, func FROM python.backtrace JOIN python.threads USING (thread_id) "
           "WHERE depth = 0 ORDER BY 1")
    rows = json.loads(_timed_cli(str(idle_target.pid), "query", sql, "-f", "json").out)
    by_name = {r["thread_name"]: r for r in rows}
    assert by_name["MainThread"]["daemon"] is False and by_name["MainThread"]["func"] == "main_sleep"
    assert by_name["loader-0"]["daemon"] is True
    assert not any(name.startswith("probe-") for name in by_name)


def _example_params():
    from probe.tables import list_tables

    params = []
    for spec in list_tables():
        if not spec.example:
            continue
        params.append(pytest.param(spec.name, spec.example, id=spec.name))
    return params


@pytest.fixture(scope="module")
def shared_idle() -> Iterator[Proc]:
    with running("idle.py") as proc:
        yield proc


@pytest.fixture(scope="module")
def shared_training() -> Iterator[Proc]:
    """A CPU training job traced from its first step, with the anomaly check: for the torch tables."""
    env = target_env(PROBE_TORCH_TRACE="1", PROBE_TORCH_TRACE_ANOMALIES="1")
    with running("train_trace.py", "nan", "3", env=env) as proc:
        yield proc


def _needs_torch(name: str) -> bool:
    return name.startswith("torch.") or name == "python.torch_trace"


@pytest.mark.parametrize("name, example", _example_params())
def test_every_tables_example_query_runs(request, name, example):
    target = request.getfixturevalue("shared_training" if _needs_torch(name) else "shared_idle")
    result = run_cli(str(target.pid), "query", example, "-f", "json", timeout=30)
    assert result.code == 0, "the example of %s fails: %s" % (name, result.err)
    assert isinstance(json.loads(result.out), list)


def test_a_child_forked_after_a_query_exits_cleanly_and_leaves_the_parent_serving(target_factory, tmp_path):
    """DuckDB's teardown in a forked child crashes it (SIGSEGV): the agent must keep that from happening."""
    from probe import _paths

    go = tmp_path / "go"
    proc = target_factory("fork_later.py", str(go))
    client = probe.connect(str(proc.pid))
    assert client.query_rows("SELECT count(*) FROM python.threads").rows[0][0] >= 1  # DuckDB now loaded
    go.write_text("")
    deadline = time.monotonic() + 20
    while client.eval("child_exit is None").value == "True":
        assert time.monotonic() < deadline, "the parent never reaped its child"
        time.sleep(0.05)
    assert client.eval("child_exit").value == "0"
    assert os.path.exists(_paths.socket_path(proc.pid))
    assert client.query_rows("SELECT pid FROM process.info").rows == [[proc.pid]]
