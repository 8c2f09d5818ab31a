"""python.locals against a real process: bounded reprs, deep stacks, a blocking __repr__, tensors by shape."""

import json
import time

import pytest

from procs import run_cli

import probe
import probe.client


def _main_locals(client: "probe.client.Client") -> dict:
    rows = client.query_rows("SELECT name, type, value FROM python.locals WHERE thread_name = 'MainThread' "
                             "AND func = 'main'").as_dicts()
    return {r["name"]: r for r in rows}


def test_locals_are_bounded_and_the_agent_stays_quick(target_factory):
    proc = target_factory("locals_zoo.py")
    client = probe.connect(str(proc.pid))
    started = time.monotonic()
    found = _main_locals(client)
    first = time.monotonic() - started
    assert first < 10
    assert found["losses"]["value"] == "[0.5, 0.25]" and found["losses"]["type"] == "list"
    assert found["big"]["value"].startswith("[0, 1, 2") and "(10000000 items)" in found["big"]["value"]
    assert found["huge"]["value"] == "<int of 16610 bits>"
    for name in ("big", "blob", "text", "table"):
        assert len(found[name]["value"]) <= 200, name
    assert found["slow"]["type"] == "__main__.Slow" and found["slow"]["value"] is None  # its repr blocks
    # While that __repr__ is still stuck, the next query answers at once, without values.
    started = time.monotonic()
    again = _main_locals(client)
    assert time.monotonic() - started < 5 and again["losses"]["value"] is None and again["losses"]["type"] == "list"
    assert client.eval("let_repr_go.set()").ok
    deadline = time.monotonic() + 10
    while _main_locals(client)["losses"]["value"] is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _main_locals(client)["slow"]["value"] == "Slow()"
    deep = client.query_rows("SELECT max(depth) AS d, count(*) AS n FROM python.locals "
                             "WHERE thread_name = 'deep'").as_dicts()[0]
    assert deep["d"] == 199  # the innermost 200 frames of 300
    assert client.eval("import sys; 'torch' in sys.modules").value == "False"


def test_issue_query_through_the_cli(target_factory):
    proc = target_factory("locals_zoo.py")
    result = run_cli(str(proc.pid), "query", "SELECT name, type, value FROM python.locals "
                     "WHERE thread_name = 'MainThread' AND func = 'main'", "-f", "json")
    assert result.code == 0, result.err
    assert "losses" in [r["name"] for r in json.loads(result.out)]


def test_tensors_show_shape_dtype_device(target_factory):
    pytest.importorskip("torch")
    proc = target_factory("grad_loop.py", timeout=60)
    client = probe.connect(str(proc.pid))
    found = _main_locals(client)
    assert found["x"]["value"] == "Tensor(shape=[256, 256], dtype=torch.float32, device=cpu)"
    assert found["x"]["type"] == "torch.Tensor"
    assert found["model"]["value"] == "Sequential()"  # the module's own line, not its whole tree
