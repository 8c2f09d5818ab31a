"""python.locals read from outside (issue 32, item 19): where the agent cannot answer (a C call keeps the
GIL, the process is stopped, no agent at all), the locals still come, read by py-spy from the process's
memory: names, and the simple values (numbers, strings, None, bools, short containers, class names),
each row marked ``source = 'outside'``, secret-looking names and passwords masked as a record's locals are.
"""

import json
import os
import signal
import time

import pytest

from probe.reader.locals_source import describe, rows_of
from probe.tables.redact import MASK
from procs import run_cli, scaled

pytest.importorskip("pystack", reason="reading from outside needs py-spy and pystack (probe's dependencies on Linux)")

QUERY = "SELECT func, name, type, value, source FROM python.locals WHERE thread_name = 'MainThread'"
EXPECTED = {  # the locals of prepare() in tests/targets/gil_locals.py: (type, value)
    "step": ("int", "1234"), "lr": ("float", "0.003"), "name": ("str", "'resnet-50'"),
    "nothing": ("NoneType", "None"), "done": ("bool", "False"), "ready": ("bool", "True"),
    "sizes": ("list", "[1, 2, 3]"), "shape": ("tuple", "(8, 16)"), "config": ("dict", "{'epochs': 3, 'warmup': 0}"),
    "api_key": ("str", MASK), "db_url": ("str", "'postgres://trainer:%s@db.example.com/runs'" % MASK),
}


def _locals(pid: int) -> "tuple[dict, str]":
    result = run_cli(str(pid), "query", QUERY, "-f", "json", timeout=scaled(60))
    assert result.code == 0, result.err
    rows = json.loads(result.out)
    assert rows and {r["source"] for r in rows} == {"outside"}, rows
    return {(r["func"], r["name"]): (r["type"], r["value"]) for r in rows}, result.err


def _check(found: dict) -> None:
    for name, expected in EXPECTED.items():
        assert found[("prepare", name)] == expected, (name, found.get(("prepare", name)))
    kind, value = found[("prepare", "batch")]
    assert kind == "Batch" and value.startswith("<Batch at 0x"), (kind, value)  # an object: its class's name
    assert found[("hold", "count")] == ("int", "10000000000000") and found[("hold", "label")] == ("str", "'resnet-50'")
    assert not any("sk-live" in (v or "") or "hunter2" in (v or "") for _, v in found.values())


def test_locals_of_a_process_whose_agent_cannot_answer_are_read_from_outside(target_factory):
    proc = target_factory("gil_locals.py")  # with an agent, which the C call keeps from running
    found, err = _locals(proc.pid)
    _check(found)
    assert "holds the GIL" in err and "outside" in err, err  # the note says why, and where the rows come from


def test_locals_of_a_process_without_an_agent_and_of_a_stopped_one(target_factory):
    proc = target_factory("gil_locals.py", probe=False)
    found, err = _locals(proc.pid)
    _check(found)
    assert "no agent" in err, err
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        found, _ = _locals(proc.pid)
        _check(found)
        assert open("/proc/%d/stat" % proc.pid).read().rsplit(")", 1)[1].split()[0] == "T"  # left stopped
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    other = run_cli(str(proc.pid), "query", "SELECT count(*) FROM python.threads", timeout=scaled(60))
    assert other.code != 0 and "python.backtrace and python.locals are read from outside" in other.err, other.err


@pytest.mark.parametrize("text, expected", [
    ("42", ("int", "42")), ("-5", ("int", "-5")), ("2.5", ("float", "2.5")), ("NaN", ("float", "nan")),
    ('"a\\"b"', ("str", "'a\"b'")), ("None", ("NoneType", "None")), ("True", ("bool", "True")),
    ("[1, 2, 3]", ("list", "[1, 2, 3]")), ("[0, 1, 2, ...]", ("list", "[0, 1, 2, ...]")),  # cut by py-spy
    ("(1)", ("tuple", "(1)")),  # py-spy's text of (1,): the type is taken from the brackets, not the parse
    ('{"a": 1}', ("dict", "{'a': 1}")), ("<Batch at 0x7f00>", ("Batch", "<Batch at 0x7f00>")),
    ("<set at 0x1>", ("set", "<set at 0x1>")), ("?", (None, None)), (None, (None, None)),
    ("[" * 5000, ("list", "[" * 197 + "...")),  # hostile: bounded, never parsed
])
def test_values_as_py_spy_formats_them(text, expected):
    assert describe(text) == expected


def test_a_hostile_answer_is_bounded_and_skipped_where_malformed():
    frames = [{"name": "f", "filename": "x.py", "line": 1, "module": None,
               "locals": [{"name": "token", "repr": '"abc"'}, {"name": 3, "repr": "1"}, "junk",
                          {"name": "ok", "repr": "1"}]},
              {"name": "native", "filename": "libc.so", "module": "libc.so", "line": 0}]
    threads = [{"thread_id": 7, "thread_name": "MainThread", "os_thread_id": 100, "frames": frames},
               {"thread_id": 8, "thread_name": "probe-accept", "os_thread_id": 101, "frames": frames},
               "junk", {"frames": "not a list"}]
    rows = rows_of(threads, 100)
    assert [(r[0], r[2], r[3], r[7], r[8], r[9], r[10]) for r in rows] == [
        (7, True, 0, "token", "str", MASK, "outside"), (7, True, 0, "ok", "int", "1", "outside")]
    many = [{"thread_id": 1, "frames": [{"name": "f", "filename": "x", "line": 1,
                                         "locals": [{"name": "v%d" % i, "repr": "1"} for i in range(2000)]}] * 300}]
    started = time.monotonic()
    assert len(rows_of(many, 1)) == 50_000 and time.monotonic() - started < scaled(10)


def test_locals_read_by_pystack_where_py_spy_is_missing_and_from_a_core_file(target_factory, tmp_path):
    import shutil
    import subprocess

    from probe.reader import locals_source

    proc = target_factory("gil_locals.py", probe=False)
    rows = locals_source._by_pystack(proc.pid, None, None)  # what read_locals does without py-spy
    _check({(r[4], r[7]): (r[8], r[9]) for r in rows if r[1] == "MainThread"})
    assert {r[10] for r in rows} == {"outside"}
    if shutil.which("gcore") is None:
        pytest.skip("gcore comes with gdb (apt-get install gdb)")
    prefix = str(tmp_path / "core")
    done = subprocess.run(["gcore", "-o", prefix, str(proc.pid)], capture_output=True, text=True, timeout=scaled(120))
    core = "%s.%d" % (prefix, proc.pid)
    assert done.returncode == 0 and os.path.exists(core), done.stderr[-2000:]
    proc.kill()
    result = run_cli("core:" + core, "query", QUERY, "-f", "json", timeout=scaled(60))
    assert result.code == 0, result.err
    rows = json.loads(result.out)
    assert {r["source"] for r in rows} == {"outside"}
    _check({(r["func"], r["name"]): (r["type"], r["value"]) for r in rows})
