"""``torch.profile``: ops captured by ``torch.profiler`` over N training steps, summed per step, and the
capture behind ``probe T profile --steps N -o FILE`` (``POST /v1/torch/profile``).

A capture starts and stops at step boundaries: ``start`` puts a callable after probe's one optimizer
post-step hook (``probe.tables.torch.steps.after_each_step``); right after the next step it starts the
profiler on the thread that stepped (the profiler follows that thread, and the autograd threads it
hands work to), and right after the Nth step from there it stops it and takes itself out. So nothing
of it runs while no capture does. Under DeepSpeed the optimizer's step is part of the engine's (ZeRO
steps it once per parameter group, then gathers the weights): there the boundary is the engine's next
forward. The stop keeps the profiler's raw results; the trace events are built on the agent's thread
when first fetched, the rows then on a thread of their own (or when first read)
(``probe.tables.torch.profile_events``).

One capture per process; a new start replaces a finished one. Nothing here imports torch before the
target has: ``torch.profiler`` is imported from the target's own torch. No collective is run: each rank
captures its own steps, and the client lines the ranks up by their wall clocks.
"""

import functools
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from probe.errors import BadRequest, Busy, Forbidden, NotFound
from probe.tables.spec import Column
from probe.tables.torch._common import torch_or_raise

__all__ = ["NAME", "DESCRIPTION", "COLUMNS", "EXAMPLE", "rows", "control", "MAX_STEPS", "MAX_EVENTS"]

NAME = "torch.profile"
DESCRIPTION = ("Ops captured by torch.profiler over N training steps (`probe T profile --steps N`), summed per "
               "step: calls, self and total CPU (and device) time, input shapes and stacks when asked for.")
COLUMNS = (
    Column("rank", "INTEGER", "This process's rank (torch.distributed, else RANK), 0 if not distributed."),
    Column("step", "BIGINT", "The optimizer step the op ran in, counted as torch.steps counts (the capture's "
                             "first step is the one after the step it began at); NULL outside any step."),
    Column("op", "VARCHAR", "The op or labelled region (aten::mm, gloo:all_reduce, a record_function's name)."),
    Column("kind", "VARCHAR", "'communication' (a collective or send/recv: NCCL, Gloo, c10d) or 'compute'."),
    Column("calls", "BIGINT", "Times it ran in that step (with those shapes and that stack)."),
    Column("self_cpu_s", "DOUBLE", "Seconds of host time in the op itself, its child ops left out."),
    Column("total_cpu_s", "DOUBLE", "Seconds of host time from its begin to its end, children included."),
    Column("self_device_s", "DOUBLE", "Seconds of device (CUDA) kernel time the op launched itself; 0 on CPU."),
    Column("total_device_s", "DOUBLE", "Device seconds of the op and its children; 0 on CPU."),
    Column("input_shapes", "VARCHAR", "The shapes of its inputs, with --shapes; NULL otherwise."),
    Column("stack", "VARCHAR", "The Python frames that called it (innermost first, up to 8), with --stacks."),
)
EXAMPLE = ("SELECT op, kind, SUM(calls) AS calls, SUM(self_cpu_s) AS self_s FROM torch.profile "
           "GROUP BY op, kind ORDER BY self_s DESC LIMIT 10")

MAX_STEPS = 1000
MAX_EVENTS = 200_000
"""Trace events one rank sends at most (also bounded by the agent's result bytes); the cut are counted."""
_KEY = "profile"
_ENGINE_DEPTH = 24  # frames from the optimizer's post-step hook up to DeepSpeed's engine.step, at most

_lock = threading.Lock()


class _Capture:
    """One capture: asked for, running, finished, failed or cancelled."""

    def __init__(self, steps: int, shapes: bool, stacks: bool, memory: bool) -> None:
        self.steps, self.shapes, self.stacks, self.memory = steps, shapes, stacks, memory
        self.state = "waiting"  # -> capturing -> done | failed | cancelled
        self.asked = time.time()
        self.profiler: Any = None
        self.devices: List[str] = ["cpu"]
        self.first_step: Optional[int] = None  # torch.steps' count at the first captured step
        self.done = 0  # steps captured so far
        self.wall_us = 0.0  # time.time() as the profiler started, in us
        self.began = self.ended = 0.0
        self.stop_s = 0.0  # time the stop took on the training thread
        self.error: Optional[str] = None
        self.rows: Optional[Tuple[List[Tuple[Any, ...]], int]] = None
        self.trace: Optional[Dict[str, Any]] = None
        self.rows_asked = False  # their build is under way (``_rows_later``)
        self.engine_hook: Any = None  # a DeepSpeed engine's forward pre-hook, while its step's end is awaited


_capture: Optional[_Capture] = None


def _rank() -> int:
    from probe.tables.torch.anomalies import rank_and_world

    return rank_and_world(sys.modules["torch"])[0]


def _total_steps() -> int:
    from probe.tables.torch import steps

    return steps._total


def _on_step() -> None:
    """Right after each optimizer step, on the thread that made it, while a capture wants steps. Inside a
    DeepSpeed engine's step the boundary waits for the engine's next forward (``_engine_stepping``)."""
    capture = _capture
    if capture is None or capture.state not in ("waiting", "capturing", "cancelling"):
        _done_with_steps()
        return
    if capture.engine_hook is not None:
        return  # the engine's step goes on (ZeRO steps its optimizer once per parameter group)
    engine = _engine_stepping()
    if engine is not None:
        try:
            capture.engine_hook = engine.register_forward_pre_hook(functools.partial(_at_engine_forward, capture))
            return
        except Exception:  # an engine that takes no hook: the optimizer's step is the boundary
            capture.engine_hook = None
    _boundary(capture)


def _engine_stepping() -> Any:
    """The DeepSpeed engine whose ``step()`` this optimizer step runs in, or None. Its step goes on after the
    optimizer's: ZeRO steps it once per parameter group, then gathers the updated weights and steps the
    scheduler, so the engine's step ends at its next forward. Read from the frames (a capture's few steps)."""
    if "deepspeed" not in sys.modules:
        return None
    frame: Any = sys._getframe(2)
    for _ in range(_ENGINE_DEPTH):
        if frame is None:
            return None
        if frame.f_code.co_name == "step" and frame.f_globals.get("__name__") == "deepspeed.runtime.engine":
            engine = frame.f_locals.get("self")
            return engine if callable(getattr(engine, "register_forward_pre_hook", None)) else None
        frame = frame.f_back
    return None


def _at_engine_forward(capture: "_Capture", module: Any, args: Any) -> None:
    """The engine's forward pre-hook: its step has ended, so this is the boundary; the hook goes at once
    (torch calls the hooks from a copy of its dict)."""
    handle, capture.engine_hook = capture.engine_hook, None
    try:
        if handle is not None:
            handle.remove()
    except Exception:
        pass
    if capture is _capture and capture.state in ("waiting", "capturing", "cancelling"):
        _boundary(capture)


def _boundary(capture: "_Capture") -> None:
    """A step boundary while ``capture`` wants one: begin, count a step, stop, or cancel."""
    try:
        if capture.state == "cancelling":
            if capture.profiler is not None:
                capture.profiler.stop()
            capture.profiler, capture.state = None, "cancelled"
            _done_with_steps()
        elif capture.state == "waiting":
            _begin(capture)
        else:
            capture.done += 1
            if capture.done >= capture.steps:
                began = time.perf_counter()
                capture.profiler.stop()
                capture.stop_s = time.perf_counter() - began
                capture.ended = time.time()
                capture.state = "done"
                _done_with_steps()
            else:
                capture.profiler.step()
    except BaseException as exc:  # never into the training loop
        capture.error = "%s: %s" % (type(exc).__name__, exc)
        capture.state = "failed"
        _done_with_steps()
        try:
            if capture.profiler is not None:
                capture.profiler.stop()
        except BaseException:
            pass


def _begin(capture: _Capture) -> None:
    torch = sys.modules["torch"]
    import importlib

    profiler = importlib.import_module("torch.profiler")  # the target's torch is loaded: this is part of it
    activities = [profiler.ProfilerActivity.CPU]
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is not None and cuda.is_available() and cuda.is_initialized():
            activities.append(profiler.ProfilerActivity.CUDA)
            capture.devices.append("cuda")
    except Exception:
        pass
    record = profiler.ProfilerAction.RECORD
    capture.profiler = profiler.profile(activities=activities, record_shapes=capture.shapes,
                                        with_stack=capture.stacks, profile_memory=capture.memory,
                                        schedule=lambda step: record)  # a schedule marks ProfilerStep#k
    capture.first_step = _total_steps() + 1
    capture.wall_us = time.time() * 1e6
    capture.began = time.time()
    capture.profiler.start()
    capture.state = "capturing"


def _done_with_steps() -> None:
    from probe.tables.torch.steps import not_after_each_step

    not_after_each_step(_KEY)


def start(steps: int, shapes: bool = False, stacks: bool = False, memory: bool = False) -> Dict[str, Any]:
    """Capture the next ``steps`` steps; Busy while another capture runs."""
    global _capture
    torch = torch_or_raise()
    if "torch.optim.optimizer" not in sys.modules:
        raise NotFound("the target has no optimizer (torch.optim is not loaded), so no step to begin or end a "
                       "profile at", hint="profile a training job: one that calls optimizer.step()")
    del torch
    from probe.tables.torch.steps import after_each_step, install_step_hook

    with _lock:
        if _capture is not None and _capture.state in ("waiting", "capturing", "cancelling"):
            raise Busy("a profile is already being captured here (%s, %d of %d steps)"
                       % (_capture.state, _capture.done, _capture.steps),
                       hint="wait for it, or cancel it with {\"action\": \"stop\"}")
        _capture = _Capture(steps, shapes, stacks, memory)
        install_step_hook()
        after_each_step(_on_step, _KEY)
    return status()


def stop() -> Dict[str, Any]:
    """Cancel a capture that has not finished: it stops at the next step boundary, its results dropped."""
    capture = _capture
    if capture is not None:
        with _lock:
            if capture.state == "waiting":
                capture.state = "cancelled"
                _done_with_steps()
            elif capture.state == "capturing":
                capture.state = "cancelling"
    return status()


def status() -> Dict[str, Any]:
    capture = _capture
    if capture is None:
        return {"state": "off", "rank": _rank()}
    return {"state": capture.state, "steps": capture.steps, "steps_done": capture.done, "rank": _rank(),
            "first_step": capture.first_step, "devices": capture.devices, "error": capture.error,
            "waiting_s": round(time.time() - capture.asked, 3) if capture.state == "waiting" else None,
            "captured_s": round(capture.ended - capture.began, 6) if capture.state == "done" else None,
            "stop_s": round(capture.stop_s, 6), "shapes": capture.shapes, "stacks": capture.stacks}


def _finished() -> _Capture:
    capture = _capture
    if capture is None:
        raise NotFound("no profile has been captured in this process", hint="run `probe T profile --steps N -o FILE`")
    if capture.state != "done":
        raise Busy("the profile is %s, not finished (%d of %d steps)%s" % (
            capture.state, capture.done, capture.steps, ": " + capture.error if capture.error else ""))
    return capture


def fetch(max_bytes: int, max_events: int = MAX_EVENTS) -> Dict[str, Any]:
    """The finished capture's trace events (this rank as one process) and its epoch, with its status."""
    capture = _finished()
    with _lock:
        if capture.trace is None or capture.trace.get("max_events") != max_events:
            from probe.tables.torch.profile_events import trace_events

            capture.trace = trace_events(capture.profiler, _rank(), capture.wall_us, max_events, max_bytes)
            capture.trace["max_events"] = max_events
    answer = dict(capture.trace)
    rows = capture.rows
    answer.update(status=status(), rows=None if rows is None else len(rows[0]),
                  rows_cut=None if rows is None else rows[1])
    if rows is None:
        _rows_later(capture)
    return answer


def _rows_later(capture: _Capture) -> None:
    """Sum the rows on a thread of their own, once: the trace goes back without waiting for them (they take
    a few times as long as the trace: torch's ``events()``), and a query of ``torch.profile`` waits for the
    lock where they are not ready yet."""
    if capture.rows_asked:
        return
    capture.rows_asked = True
    from probe._threads import daemon_thread

    def build() -> None:
        try:
            _rows_of(capture)
        except Exception:  # the table's read builds them again and says what went wrong
            pass

    daemon_thread(build, "probe-profile-rows").start()


def _rows_of(capture: _Capture) -> Tuple[List[Tuple[Any, ...]], int]:
    with _lock:
        if capture.rows is None:
            from probe.tables.torch.profile_events import summed_rows

            capture.rows = summed_rows(list(capture.profiler.events()), _rank(), capture.first_step or 0)
        return capture.rows


def rows() -> List[Tuple[Any, ...]]:
    """The last finished capture's rows; none before one has finished."""
    torch_or_raise()
    capture = _capture
    if capture is None or capture.state != "done":
        return []
    return list(_rows_of(capture)[0])


def control(body: Dict[str, Any], eval_enabled: bool, max_bytes: int) -> Dict[str, Any]:
    """``POST /v1/torch/profile``: ``{"action": "start", "steps": N, "shapes": b, "stacks": b}``, ``status``,
    ``fetch`` (the trace events) or ``stop`` (cancel). ``start`` changes what the training step runs, so a
    read-only agent refuses it, as it refuses ``trace start``."""
    action = body.get("action")
    torch_or_raise()  # every action: a process without torch has no capture, and no rank to say
    if action == "start":
        if not eval_enabled:
            raise Forbidden("this agent is read-only (--no-eval / PROBE_EVAL=0), and a profile changes what the "
                            "target runs", hint="give the agent eval to profile it")
        steps = body.get("steps")
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
            raise BadRequest("steps must be a whole number from 1 to %d" % MAX_STEPS)
        flags = {key: body.get(key, False) for key in ("shapes", "stacks", "memory")}
        if not all(isinstance(v, bool) for v in flags.values()):
            raise BadRequest("shapes, stacks and memory are true or false")
        return start(steps, **flags)
    if action == "stop":
        return stop()
    if action == "status":
        return status()
    if action == "fetch":
        limit = body.get("max_events", MAX_EVENTS)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise BadRequest("max_events must be a whole number >= 1")
        return fetch(int(max_bytes * 0.8), min(limit, MAX_EVENTS))
    raise BadRequest("action must be start, status, fetch or stop, got %r" % (action,))

