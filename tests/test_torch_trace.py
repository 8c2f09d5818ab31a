"""python.torch_trace, torch.anomalies and `probe T trace ...`, on real CPU training processes, through the CLI."""

import json
import os
import subprocess
import sys
import time
from typing import Any, Callable, Dict, Iterator, List

import pytest

from procs import REPO, TARGETS, Proc, run_cli, target_env

from probe.tables.torch.trace_events import limit_for

pytest.importorskip("torch", reason="the torch trace needs torch (CPU build, torch==2.13.0)")

SLOW_SQL = ("SELECT module, stage, COUNT(*) AS count, AVG(duration) AS avg_time, SUM(duration) AS total_time "
            "FROM python.torch_trace WHERE step > (SELECT MAX(step) - 5 FROM python.torch_trace) "
            "GROUP BY module, stage ORDER BY total_time DESC LIMIT 10")
MEMORY_SQL = ("SELECT step, MAX(allocated) AS peak_memory, MAX(allocated) - MIN(allocated) AS memory_range "
              "FROM python.torch_trace WHERE step > (SELECT MAX(step) - 20 FROM python.torch_trace) "
              "GROUP BY step ORDER BY step")


def query(pid: int, sql: str) -> List[Dict[str, Any]]:
    done = run_cli(str(pid), "query", sql, "-f", "json")
    assert done.code == 0, done.err
    return json.loads(done.out)


def trace(pid: int, *args: str) -> Dict[str, Any]:
    done = run_cli(str(pid), "trace", *args, "--json")
    assert done.code == 0, done.err
    return json.loads(done.out)


def wait_for(what: str, check: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Poll ``check`` until it returns something true; fail after ``timeout`` seconds, naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("waited %.0f s for %s" % (timeout, what))
        time.sleep(0.1)


def steps_seen(pid: int, at_least: int) -> Dict[str, Any]:
    return wait_for("%d traced steps" % at_least, lambda: (lambda s: s if s["steps_seen"] >= at_least else None)(
        trace(pid, "status")))


def traced(**extra: str) -> Dict[str, str]:
    return target_env(PROBE_TORCH_TRACE="1", **extra)


class _Run:
    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture(scope="module")
def torch_python(tmp_path_factory) -> Iterator[Callable[..., _Run]]:
    """``run(code, *argv)``: ``python -c code argv...`` in a child of its own, forked from one process of the
    module that imported torch once (tests/targets/torch_forker.py), not a fresh interpreter that imports it
    again for each script: each script still starts in a process of its own, with no agent (target_env's
    environment without PROBE, as before)."""
    popen = subprocess.Popen([sys.executable, os.path.join(TARGETS, "torch_forker.py")], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=target_env(probe=False), cwd=REPO)
    forker = Proc(popen, "torch_forker.py")
    folder = tmp_path_factory.mktemp("torch-scripts")
    runs = [0]

    def run(code: str, *argv: str) -> _Run:
        runs[0] += 1
        out, err = str(folder / ("%d.out" % runs[0])), str(folder / ("%d.err" % runs[0]))
        assert popen.stdin is not None
        popen.stdin.write((json.dumps({"code": code, "argv": list(argv), "out": out, "err": err}) + "\n").encode())
        popen.stdin.flush()
        line = forker.read_line(120)  # scaled as subprocess.run's timeout was
        assert line.startswith("DONE "), line
        with open(out, encoding="utf-8", errors="replace") as o, open(err, encoding="utf-8", errors="replace") as e:
            return _Run(int(line.split()[1]), o.read(), e.read())

    try:
        line = forker.read_line(60)
        assert line.startswith("READY"), line
        yield run
    finally:
        forker.kill()


def test_from_first_step_slow_module_ranked_first(target_factory):
    proc = target_factory("train_trace.py", "slow", env=traced())
    steps_seen(proc.pid, 14)
    rows = query(proc.pid, SLOW_SQL)
    assert rows[0]["module"] == "encoder.2" and rows[0]["stage"] == "forward", rows
    assert rows[0]["count"] in (4, 5)  # the newest step may be under way
    first = query(proc.pid, "SELECT MIN(step) AS s FROM python.torch_trace WHERE module = 'Net'")
    assert first == [{"s": 0}]  # the first step of the job is traced
    memory = query(proc.pid, MEMORY_SQL)
    assert len(memory) >= 10 and all(r["peak_memory"] > 10 for r in memory)  # RSS in MB
    assert [r["step"] for r in memory] == sorted(r["step"] for r in memory)


def test_a_leaking_job_shows_growth(target_factory):
    proc = target_factory("train_trace.py", "leak", env=traced())
    steps_seen(proc.pid, 22)
    memory = query(proc.pid, MEMORY_SQL)
    growth = memory[-1]["peak_memory"] - memory[0]["peak_memory"]
    # ~1-2 MB of kept activations a step; a reading of RSS serves a few steps, so the window's first and last
    # readings may lie fewer than 20 steps apart (17 MB was seen on a loaded box).
    assert growth > 8, memory


def test_a_leak_of_256_kb_a_step_shows_in_the_page_s_memory_query_over_10_ms_steps(target_factory):
    """Issue 32 item 10: the seed page's memory query (one row a step, its max(allocated)) on a CPU job of
    ~10 ms steps leaking 256 KB a step. A step mark's RSS reading serves for 1000 times its cost (0.1 %): here
    (30-60 us a reading at a step's end) one every ~3-6 steps, where 5000 times (the spans' rule, which the
    step marks followed before) kept one for 150-250 ms, 15-25 steps: one value for the whole window."""
    from probe.page.data import TRACE_SQL

    proc = target_factory("leaky_steps.py", env=traced())
    steps_seen(proc.pid, 60)
    # 20 steps x 256 KB = 5 MB; the old rule gave 3 readings over the 20 steps at most, this one 5-7 on a quiet
    # box; with the suite on both cores a reading costs more, so serves longer (3-4 seen): the best of three
    # windows, 20 steps apart, is taken
    best: list = []
    for attempt in range(3):
        if attempt:
            steps_seen(proc.pid, 60 + 25 * attempt)
        rows = query(proc.pid, TRACE_SQL.format(n=20))
        values = [r["memory_mb"] for r in rows]
        assert len(rows) >= 18 and values == sorted(values), rows  # the step's reading, never an older one
        assert values[-1] - values[0] >= 2.0, rows
        best = max(best, values, key=lambda v: len(set(v)))
        if len(set(best)) >= 4:
            break
    assert len(set(best)) >= 4, best


def test_live_start_every_modules_backward_stop_export(target_factory, tmp_path):
    proc = target_factory("train_trace.py", "normal")
    assert trace(proc.pid, "status")["state"] == "off"
    status = trace(proc.pid, "start", "--every", "3", "--modules", "encoder.*", "--backward")
    assert status["state"] == "on" and status["options"]["every"] == 3
    steps_seen(proc.pid, 10)
    rows = query(proc.pid, "SELECT DISTINCT step % 3 AS r FROM python.torch_trace")
    assert rows == [{"r": 0}]
    modules = {r["module"] for r in query(proc.pid, "SELECT DISTINCT module FROM python.torch_trace")}
    assert modules == {"encoder.0", "encoder.1", "encoder.2", "encoder.3", "encoder.4", "SGD"}  # not "encoder"
    backward = query(proc.pid, "SELECT module, COUNT(*) AS n FROM python.torch_trace WHERE stage = 'backward' "
                               "GROUP BY module ORDER BY module")
    assert {r["module"] for r in backward} >= {"encoder.0", "encoder.1", "encoder.3", "encoder.4"}  # ReLU(inplace)
    bad = query(proc.pid, "SELECT COUNT(*) AS n FROM python.torch_trace WHERE NOT (0 <= duration "
                          "AND duration <= total_duration AND total_duration > 0)")
    assert bad == [{"n": 0}]

    stopped = trace(proc.pid, "stop")
    assert stopped["state"] == "stopped"
    wait_for("the trace's hooks to leave", lambda: trace(proc.pid, "status")["hooks_left"] == 0)
    # No hook of the trace is left in torch's global hook dicts. (The agent's own optimizer post-step hook,
    # the step counter's, stays by design: it is no trace hook.)
    done = run_cli(str(proc.pid), "eval", "import sys; m = sys.modules; hooks = [*m['torch.nn.modules.module']."
                   "_global_forward_pre_hooks.values(), *m['torch.nn.modules.module']._global_forward_hooks.values(), "
                   "*m['torch.optim.optimizer']._global_optimizer_post_hooks.values()]; "
                   "print(sum(1 for h in hooks if getattr(h, '__module__', '').startswith('probe.tables.torch.trace')), "
                   "sum(1 for h in hooks if not getattr(h, '__module__', '').startswith('probe.')))")
    assert done.code == 0 and done.out.split() == ["0", "0"], done
    assert proc.alive()

    out = tmp_path / "trace.json"
    done = run_cli(str(proc.pid), "trace", "export", "-o", str(out))
    assert done.code == 0, done.err
    events = json.loads(out.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0}
    assert {e["cat"] for e in spans} == {"forward", "backward", "optimizer", "step"}
    assert all(e["dur"] > 0 and isinstance(e["ts"], float) for e in spans)
    assert any(e["ph"] == "M" and e["name"] == "process_name" for e in events)

    # A hook that raises switches the trace off, says why, and the training goes on.
    trace(proc.pid, "start")
    done = run_cli(str(proc.pid), "eval", "from probe.tables.torch import trace\n"
                   "def broken():\n    raise ZeroDivisionError('planted by the test')\n"
                   "trace.current().memory = broken")
    assert done.code == 0, done.err
    failed = wait_for("the trace to fail", lambda: (lambda s: s if s["state"] == "failed" else None)(
        trace(proc.pid, "status")))
    assert "ZeroDivisionError: planted by the test" in failed["failure"]
    text = run_cli(str(proc.pid), "trace", "status").out
    assert "switched off by an error in a hook: ZeroDivisionError" in text
    steps = lambda: int(run_cli(str(proc.pid), "eval", "import __main__; __main__.STEPS[0]").out.strip())  # noqa: E731
    before = steps()
    wait_for("training to go on", lambda: steps() > before + 3)


def test_anomalies_name_the_poisoned_module_and_step(target_factory):
    proc = target_factory("train_trace.py", "nan", "8", env=traced(PROBE_TORCH_TRACE_ANOMALIES="1", PROBE_EVAL="0"))
    steps_seen(proc.pid, 11)
    first = query(proc.pid, "SELECT * FROM torch.anomalies ORDER BY step LIMIT 1")
    assert first[0]["step"] == 8 and first[0]["module"] == "Net" and first[0]["stage"] == "input", first  # the batch
    assert first[0]["kind"] == "nan" and first[0]["nan_count"] > 0 and first[0]["first"] is True
    assert first[0]["loss"] != first[0]["loss"] or first[0]["loss"] is None  # NaN loss (NULL in JSON)
    refused = run_cli(str(proc.pid), "trace", "start")  # a read-only agent does not add hooks...
    assert refused.code == 4 and "read-only" in refused.err
    assert trace(proc.pid, "status")["state"] == "on"  # ...but says what runs


def test_a_target_without_torch_is_not_made_to_import_it(target_factory):
    proc = target_factory("idle.py", env=traced())
    done = run_cli(str(proc.pid), "trace", "status")
    assert done.code != 0 and "torch is not loaded" in done.err and len(done.err.strip().splitlines()) == 1
    done = run_cli(str(proc.pid), "query", "SELECT * FROM python.torch_trace")
    assert done.code != 0 and "torch is not loaded" in done.err
    assert query(proc.pid, "SELECT name FROM python.modules WHERE name = 'torch'") == []


_HUNG_STEP = """
import json, sys, threading
import torch
from probe.tables.torch import trace

release, stuck = threading.Event(), threading.Event()

class Gate(torch.nn.Module):
    armed = False
    def forward(self, x):
        if Gate.armed:
            stuck.set()
            release.wait(120)
        return x

model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), Gate(), torch.nn.Linear(4, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

def train():
    for n in range(4):
        Gate.armed = n == 3
        loss = model(torch.zeros(2, 4)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

trace.start()
trainer = threading.Thread(target=train, daemon=True)
trainer.start()
if not stuck.wait(120):
    sys.exit("the training never reached the gate")
columns = trace.columns()  # read while the step hangs in Gate
release.set()
trainer.join(120)
last = max(columns["step"])
print(json.dumps({"step": last, "modules": [m for m, s in zip(columns["module"], columns["step"]) if s == last]}))
"""


def test_a_step_that_hangs_shows_the_spans_it_completed(torch_python) -> None:
    """Once training steps, the hooks leave records that a reader builds into spans: a read while a step
    hangs in a module shows the modules that step has finished, under its own step number."""
    done = torch_python(_HUNG_STEP)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"step": 3, "modules": ["0", "1"]}, seen


_TRAIN = """
import gc, json, os, weakref
import torch
from probe.tables.torch import trace

def train(model, optimizer, steps):
    for _ in range(steps):
        loss = model(torch.zeros(2, 4)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
"""
"""The prelude of the child scripts below: the trace's module and a training loop."""

_LONG_RUN = _TRAIN + """
import sys
from probe.tables.torch.trace_options import TraceOptions
model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(20)])
optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
size = int(sys.argv[1])
trace.start(TraceOptions(size=size))
log = trace.current()._log
most = 0
for _ in range(int(sys.argv[2])):
    train(model, optimizer, 1)
    most = max(most, sum(len(t.events) for t in log._threads.values()))
built = trace.current().ring.written()  # before any read: what the training thread built itself
status = trace.status()
columns = trace.columns()
steps = {}
for step, seq, module, stage, depth in zip(columns["step"], columns["seq"], columns["module"], columns["stage"],
                                           columns["depth"]):
    steps.setdefault(step, []).append((seq, module, stage, depth))
print(json.dumps({"built": built, "most": most, "rows": len(columns["step"]), "steps": sorted(steps),
                  "dropped": status["spans_dropped_unread"], "written": status["spans_recorded"],
                  "shapes": sorted({json.dumps(sorted(spans)) for step, spans in steps.items() if step > min(steps)})}))
"""

_WHOLE = [[0, "Sequential", "forward", 0]] + [[k, str(k - 1), "forward", 1] for k in range(1, 21)]
_WHOLE_STEP = json.dumps(sorted(_WHOLE + [[21, "SGD", "optimizer", 0]]))


def _long_run(torch_python: Callable[..., Any], size: int, steps: int) -> Dict[str, Any]:
    done = torch_python(_LONG_RUN, str(size), str(steps))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_a_long_run_leaves_its_spans_to_the_read_each_step_whole(torch_python) -> None:
    """The training thread builds nothing once an optimizer has stepped (the first step's hooks build their
    own spans): 300 steps of 21 module calls and an optimizer step, read once, give every step the same 22
    spans, in call order."""
    seen = _long_run(torch_python, 10_000, 300)
    assert seen["built"] == 22 and seen["dropped"] == 0, seen
    assert seen["steps"] == list(range(300)) and seen["rows"] == 300 * 22, seen["rows"]
    assert seen["shapes"] == [_WHOLE_STEP], seen["shapes"]


def test_records_nobody_reads_stay_bounded_and_a_read_builds_the_newest_steps_whole(torch_python) -> None:
    """With a buffer of 1000 spans, 1500 steps (33,000 spans) unread: the records never pass the limit,
    nothing is built until the read, and the read fills the buffer with the newest steps, each whole."""
    seen = _long_run(torch_python, 1000, 1500)  # (the oldest step held has lost its first spans to the ring)
    assert seen["built"] == 22 and seen["most"] <= limit_for(1000), seen  # the first step's, as above
    assert seen["rows"] == 1000 and seen["steps"][-1] == 1499, seen
    assert seen["steps"] == list(range(seen["steps"][0], 1500)), seen["steps"]  # the newest, no gap
    assert seen["shapes"] == [_WHOLE_STEP], seen["shapes"]
    assert seen["written"] + seen["dropped"] >= 30_000, seen  # each dropped span counted, about


_ENDED_THREAD = _TRAIN + """
import threading
from probe.tables.torch.trace_options import TraceOptions
model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(20)])
optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
trace.start(TraceOptions(size=100))
train(model, optimizer, 2)
evaluator = threading.Thread(target=lambda: model(torch.zeros(1, 4)))  # a forward, then the thread ends
evaluator.start()
evaluator.join()
train(model, optimizer, 400)  # past the limit: the training thread's hook cuts its records
log = trace.current()._log
print(json.dumps({"cut": log.steps_cut, "lists": len(log._threads), "built": trace.current().ring.written()}))
"""


def test_a_thread_that_ended_has_its_spans_built_and_its_list_dropped_at_a_cut(torch_python) -> None:
    """A thread that ran a forward and ended: when the training thread's hook cuts its own records, it
    builds what the ended thread left and forgets its list (the step marks would grow it for ever)."""
    done = torch_python(_ENDED_THREAD)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["cut"] > 0 and seen["lists"] == 1, seen
    assert seen["built"] == 22 + 21, seen  # the first step's spans (built by its hooks), then the ended thread's


_DROPPED_MODEL = _TRAIN + """
trace.start()
first = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
optimizer = torch.optim.SGD(first.parameters(), lr=0.01)
train(first, optimizer, 5)
pending = sum(len(t.events) for t in trace.current()._log._threads.values())
gone = weakref.ref(first), weakref.ref(optimizer)
del first, optimizer
gc.collect()
freed = [r() is None for r in gone]  # before anything builds the records
second = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())  # first called once records are kept
train(second, torch.optim.Adam(second.parameters()), 5)
third = weakref.ref(second)
del second
gc.collect()
freed.append(third() is None)  # the records of its calls wait too, unbuilt
columns = trace.columns()
kinds = sorted({(m, s) for m, s, step in zip(columns["module"], columns["stage"], columns["step"]) if step == 9})
print(json.dumps({"pending": pending, "freed": freed, "step": trace.current().step,
                  "last": kinds}))
"""


def test_a_model_the_program_drops_is_freed_while_its_records_wait(torch_python) -> None:
    """Records not yet built keep no module or optimizer alive: a job that drops its model (and its GPU
    memory) gets it back at once, a model first called once the hooks only keep records too; the next
    optimizer then counts the steps."""
    done = torch_python(_DROPPED_MODEL)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["pending"] > 0 and seen["freed"] == [True, True, True], seen
    assert seen["step"] == 10, seen
    assert seen["last"] == [["0", "forward"], ["1", "forward"], ["Adam", "optimizer"], ["Sequential", "forward"]], seen


_FORKED = _TRAIN + """
from probe.tables.torch.trace_options import TraceOptions
model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(20)])
optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
trace.start(TraceOptions(size=100))
train(model, optimizer, 3)
tracer = trace.current()
tracer._log._lock.acquire()  # as a reader's build under way on another thread when the program forks
child = os.fork()
if child == 0:
    train(model, optimizer, 300)  # records past the limit: the child's hooks must be able to cut them
    pending = sum(len(t.events) for t in tracer._log._threads.values())
    print(json.dumps({"pending": pending, "cut": tracer._log.steps_cut}), flush=True)
    os._exit(0)
os.waitpid(child, 0)
"""


def test_a_forked_child_bounds_its_own_records(torch_python) -> None:
    """A child forked while the parent's agent was building spans (its lock held) gets a lock of its own:
    its hooks cut their records at the limit, not keep them for ever."""
    done = torch_python(_FORKED)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["cut"] > 0 and seen["pending"] < limit_for(100), seen


_FORKED_MEMORY = _TRAIN + """
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
trace.start()
train(model, optimizer, 3)  # the parent's step marks hold its last RSS reading
parent = max(trace.columns()["allocated"])
child = os.fork()
if child == 0:
    hog = b"x" * (300 << 20)  # the child's own 300 MB, touched
    train(model, optimizer, 2)  # well within the 250 ms a reading may serve
    columns = trace.columns()
    last = max(columns["step"])
    mine = [a for a, s in zip(columns["allocated"], columns["step"]) if s == last]
    print(json.dumps({"parent": parent, "child": min(mine), "hog": len(hog) >> 20}), flush=True)
    os._exit(0)
os.waitpid(child, 0)
"""


def test_a_forked_child_s_steps_carry_its_own_memory_reading(torch_python) -> None:
    """The step marks keep an RSS reading for up to 250 ms; a child forked from a traced process reads
    its own at its first step, not the parent's last (a child that allocates 300 MB shows it)."""
    done = torch_python(_FORKED_MEMORY)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["child"] > seen["parent"] + 150, seen
