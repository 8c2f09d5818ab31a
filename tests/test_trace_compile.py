"""The torch trace on a torch.compile'd model (issue 19, item 5): Dynamo never traces probe's hooks.

Real CPU training processes (tests/targets/compiled_train.py, backend aot_eager), driven through the CLI.
Dynamo's own counters are read inside each target: with the trace on (from the first step, or started,
sampled, stopped and started again on the live job) it has the same graph breaks (none), the same graphs
and one compiled version of the model's forward, as the same job without the trace; the spans name the
module the user compiled.
"""

import json
import subprocess
import sys
from typing import Any, Dict, List

import pytest

from procs import REPO, run_cli, scaled, target_env

pytest.importorskip("torch", reason="the torch trace needs torch (CPU build, torch==2.13.0)")

FORWARD_MODULES = "SELECT DISTINCT module FROM python.torch_trace WHERE stage = 'forward' ORDER BY module"


def counts(pid: int) -> Dict[str, Any]:
    done = run_cli(str(pid), "eval", "import json, __main__; print(json.dumps(__main__.dynamo_counts()))")
    assert done.code == 0, done.err
    return json.loads(done.out)


def steps(pid: int) -> int:
    done = run_cli(str(pid), "eval", "__import__('__main__').STEPS[0]")
    assert done.code == 0, done.err
    return int(done.out)


def trace(pid: int, *args: str) -> Dict[str, Any]:
    done = run_cli(str(pid), "trace", *args, "--json")
    assert done.code == 0, done.err
    return json.loads(done.out)


def query(pid: int, sql: str) -> List[Dict[str, Any]]:
    done = run_cli(str(pid), "query", sql, "-f", "json")
    assert done.code == 0, done.err
    return json.loads(done.out)


def wait_steps(pid: int, more: int) -> None:
    """Until the target has trained ``more`` steps past now (bounded)."""
    import time

    target = steps(pid) + more
    deadline = time.monotonic() + scaled(30)
    while steps(pid) < target:
        assert time.monotonic() < deadline, "the target did not train %d more steps" % more
        time.sleep(0.1)


def start_compiled(target_factory, **env: str):
    return target_factory("compiled_train.py", env=target_env(**env), timeout=90)


def without_compile_time(found: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in found.items() if k != "compile_seconds"}


def test_trace_from_the_first_step_leaves_the_compiled_graphs_alone(target_factory):
    plain = start_compiled(target_factory)
    wait_steps(plain.pid, 5)
    expected = counts(plain.pid)
    plain.kill()
    assert expected["graph_breaks"] == 0 and expected["forward_versions"] == 1, expected

    traced = start_compiled(target_factory, PROBE_TORCH_TRACE="1", PROBE_TORCH_TRACE_ANOMALIES="1",
                            PROBE_TORCH_TRACE_BACKWARD="1")
    wait_steps(traced.pid, 5)
    assert without_compile_time(counts(traced.pid)) == without_compile_time(expected)
    status = trace(traced.pid, "status")
    assert status["state"] == "on" and status["failure"] is None and status["steps_seen"] >= 5, status
    names = [r["module"] for r in query(traced.pid, FORWARD_MODULES)]
    assert names == ["CrossEntropyLoss", "Net"], names  # the model by its own class: no wrapper, no graph
    backward = query(traced.pid, "SELECT count(*) AS n FROM python.torch_trace WHERE stage = 'backward' "
                                 "AND module = 'Net'")
    assert backward[0]["n"] >= 3


def test_live_start_sampling_stop_and_restart_recompile_nothing(target_factory):
    proc = start_compiled(target_factory)
    wait_steps(proc.pid, 3)
    before = counts(proc.pid)
    assert before["graph_breaks"] == 0 and before["forward_versions"] == 1, before

    trace(proc.pid, "start", "--every", "2", "--anomalies")
    wait_steps(proc.pid, 6)
    assert counts(proc.pid) == before
    trace(proc.pid, "stop")
    wait_steps(proc.pid, 3)
    trace(proc.pid, "start", "--backward")
    wait_steps(proc.pid, 4)
    trace(proc.pid, "start")  # replaces the running trace
    wait_steps(proc.pid, 4)
    assert counts(proc.pid) == before
    status = trace(proc.pid, "status")
    assert status["state"] == "on" and status["failure"] is None, status
    names = [r["module"] for r in query(proc.pid, FORWARD_MODULES)]
    assert names == ["CrossEntropyLoss", "Net"], names


_WRAPPER_WARNING = """
import sys, warnings
import torch
from probe.tables.torch import trace

warnings.simplefilter("default")  # as a job runs: each warning once where it is raised
model = torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), backend="aot_eager")
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

def step():
    loss = model(torch.zeros(2, 4)).sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

step()
filters = len(warnings.filters)
trace.start()
for _ in range(3):
    step()
trace.stop()
print("filters", filters, len(warnings.filters), "spans", trace.current().ring.written() > 0 or trace.columns()["step"] != [])
"""


def test_the_trace_sets_off_no_warning_from_a_compiled_module() -> None:
    """torch warns, at a compiled module's call, when global module hooks are in: the trace's would put
    that warning in the job's log (and its cost at every call). None while a trace runs; the filter that
    keeps it out leaves with the trace."""
    done = subprocess.run([sys.executable, "-c", _WRAPPER_WARNING], capture_output=True, text=True,
                          timeout=scaled(180), env=target_env(probe=False), cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "global hooks" not in done.stderr, done.stderr
    line = done.stdout.strip().splitlines()[-1].split()
    assert line[0] == "filters" and line[1] == line[2] and line[4] == "True", line
