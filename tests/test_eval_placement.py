"""Where a snippet runs: concurrently (the default), on the main thread, right after an optimizer step;
and in which namespace: ``__main__`` or a frame's. Real targets, driven through the client and the CLI."""

import threading
import time

import pytest

from procs import run_cli

import probe
from probe.errors import BadRequest, Timeout

MIXED = "seen = set()\nfor i in range(0, len(data), 2):\n    seen.add(data[i])\nlen(seen)"


def test_concurrent_reader_sees_two_steps_on_main_never(target_factory):
    proc = target_factory("slice_loop.py")
    client = probe.connect(str(proc.pid))
    concurrent = [int(client.eval(MIXED).value or 0) for _ in range(5)]
    assert max(concurrent) >= 2, concurrent  # the loop rewrote the list in the middle of the read
    on_main = [client.eval(MIXED, on="main").value for _ in range(8)]
    assert on_main == ["1"] * 8


def test_on_main_bounded_wait_and_a_late_call_runs_nothing(target_factory):
    proc = target_factory("blocked_main.py")
    client = probe.connect(str(proc.pid))
    started = time.monotonic()
    with pytest.raises(Timeout) as caught:
        client.eval("ran_on_main.append(1)", on="main", wait=0.5)
    assert time.monotonic() - started < 5
    assert "main thread reached no bytecode boundary" in caught.value.message and "never will" in caught.value.message
    cli = run_cli(str(proc.pid), "eval", "--on", "main", "--start-within", "0.3", "ran_on_main.append(2)")
    assert cli.code == 5 and "without --on main" in cli.err, cli.err
    # Let the main thread go on: its queued pending call fires now, and must run nothing.
    assert client.eval("release.set()").ok
    seen = int(client.eval("counter").value or 0)
    deadline = time.monotonic() + 10
    while int(client.eval("counter").value or 0) <= seen + 1000 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.eval("ran_on_main").value == "[]"
    assert client.eval("import threading; threading.current_thread().name", on="main").value == "'MainThread'"


def test_on_main_time_limit_and_interrupt_never_reach_the_program(target_factory):
    proc = target_factory("slice_loop.py")
    client = probe.connect(str(proc.pid))
    result = client.eval("while True: pass", on="main", timeout=0.5)
    assert result.timed_out and "interrupted" in (result.error or "")
    box = {}
    worker = threading.Thread(target=lambda: box.setdefault("r", client.eval("while True: pass", on="main",
                                                                             eval_id="spin-1")))
    worker.start()
    deadline = time.monotonic() + 10
    state = "unknown"
    while state == "unknown" and time.monotonic() < deadline:
        state = client.interrupt_eval("spin-1")
        time.sleep(0.05)
    worker.join(15)
    assert state in ("interrupted", "cancelled") and "EvalInterrupted" in (box["r"].error or "")
    before = int(client.eval("step").value or 0)
    time.sleep(0.3)
    assert proc.alive() and int(client.eval("step").value or 0) > before  # the loop runs on, unharmed


def test_frame_namespace_and_read_only_locals(target_factory):
    proc = target_factory("blocked_main.py")
    client = probe.connect(str(proc.pid))
    assert client.eval("release.wait", frame="MainThread:main").value.startswith("<bound method Event.wait")
    assert client.eval("counter", frame="MainThread:0").error  # depth 0 is Event.wait: no such name there
    missing = client.eval("1", frame="nosuch:0")
    assert "no thread named 'nosuch'" in (missing.error or "")
    with pytest.raises(BadRequest):
        client.eval("1", frame="MainThread")


def test_between_steps_needs_torch(idle_target):
    cli = run_cli(str(idle_target.pid), "eval", "--between-steps", "1")
    assert cli.code == 2 and "torch's optimizers are not loaded" in cli.err, cli.err
    both = run_cli(str(idle_target.pid), "eval", "--between-steps", "--on", "main", "1")
    assert both.code == 2 and "exclude each other" in both.err


def test_between_steps_reads_a_whole_step(target_factory):
    pytest.importorskip("torch")
    proc = target_factory("grad_loop.py", timeout=60)
    client = probe.connect(str(proc.pid))
    count = "sum(p.grad is None for p in model.parameters())"
    # Concurrently, .grad must not be touched while autograd or zero_grad replaces it from C++ (that corrupts
    # the heap: SIGABRT within a few hundred reads); probe's guarded read takes the references outside both.
    guarded = ("(lambda g: 'in backward' if g is None else sum(x is None for x in g))(__import__("
               "'probe.tables.torch._common', fromlist=['_']).grads_outside_backward(list(model.parameters())))")
    concurrent = [client.eval(guarded, frame="MainThread:main").value for _ in range(40)]
    assert set(concurrent) != {"0"}, concurrent  # some reads land mid-step (None grads, or a pass writing them)
    steps = [client.eval(count, on="step", frame="MainThread:main").value for _ in range(8)]
    assert steps == ["0"] * 8
    losses = run_cli(str(proc.pid), "eval", "--between-steps", "--frame", "MainThread:main", "len(losses) > 0")
    assert (losses.code, losses.out.strip()) == (0, "True"), losses.err
    assert proc.alive()


def test_an_interrupt_that_overtakes_its_snippet_stops_it_as_it_arrives(idle_target):
    """A client's Ctrl-C can reach the agent before the snippet it stops (several ranks, a slow link):
    the agent remembers the id, and the snippet never runs. Before, it ran on to its time limit."""
    client = probe.connect(str(idle_target.pid))
    assert client.interrupt_eval("early-1") == "cancelled"
    late = client.eval("overtaken = True\nwhile True: pass", eval_id="early-1", timeout=20)
    assert "cancelled before it started" in (late.error or ""), late
    assert client.eval("'overtaken' in globals()").value == "False"
    assert client.eval("1 + 1", eval_id="done-1").value == "2"
    assert client.interrupt_eval("done-1") == "finished"
