"""The torch trace's cost on a training step, the hook's cost per module call, and the agent with a full buffer.

    python bench/bench_trace.py [--rounds 40] [--pairs 5] [--steps 3] [--model MLP|transformer] [--extra]
                                [--no-blocks] [--quick] [--only SECTION] [--before DIR [--runs 4]]
                                [--read-every SECONDS]

1. Overhead on a training step (forward, loss, backward, SGD step) of an MLP (8 x Linear(1024), batch 64)
   and of a small transformer (6 encoder layers, d_model 256, 4 heads, batch 16 x 32 tokens), in this
   process, CPU, one intra-op thread, every step timed in CPU time of the training thread
   (``time.thread_time_ns``: what the machine's other work takes from us does not count), glibc malloc
   told to keep its memory (``MALLOC_ENV``: else page faults make the step swing by -4..+18 %). Beside
   the trace, measured the same way in the same run: two empty global module hooks (torch's own part of
   any global hook: its slow ``__call__`` path), the floor of any recording hook (``HookSet``: module and
   optimizer hooks that each append one clock reading), a planted cost (a busy-wait of 0.3 % of the untraced
   step, added to the step: the method must see it) and the method's zero (untraced against untraced).
   Two ways, each giving per-pair ratios, their median, IQR and a bootstrap 95 % interval of the median:

   * step by step (the figure held to the goal): steps alternate one by one between on and off; for
     the trace, all its hooks (modules' and optimizer's) go in before an on step and out after it
     (``TraceToggle``). Twice: with every span read (the round's spans, which a reader builds, are
     built at the round's end and their CPU time shared out over its on steps), and with nobody reading
     (what a training thread's cut of the records costs them is shared out instead); each on step
     against the mean of the off steps on either side. ``--rounds`` rounds of ``--pairs`` pairs per
     setting, settings rotating.
   * blocks: ``--steps`` steps of each setting (the trace started and stopped around them, as ``probe T
     trace start/stop`` does, the first step after each switch not timed) between untraced blocks; a
     block's figure its mean step or its fastest step. ``--extra`` adds ``--every 10`` (blocks of 10),
     backward spans and the anomaly check.
2. Per module call, forward only (no_grad), CPU time, interleaved blocks: 200 x Linear(16, 16), batch 4
   (the hooks' own instructions, caches warm), and the MLP's layers (each hook right after a matmul that
   flushed the caches, as in training): (setting - untraced) / module calls, for torch's part (two empty
   hooks), the trace (as before any optimizer step: each hook builds its span; and after one: the hooks
   append records, whose build is timed and counted), the trace with anomalies, and a module the filter
   leaves out.
3. The agent (a real target, ``tests/targets/train_trace.py`` with ``PROBE_TORCH_TRACE=1`` and backward
   spans): VmRSS before the trace starts and once the default buffer (10000 spans) is full; then the
   slow-module query of DESIGN.md, ``elapsed_ms`` as served inside the agent (DESIGN-like target 20 ms).
4. (``--only read``) What a reader costs a step when it reads every ``--read-every`` seconds (5: the
   page's refresh): the traced MLP trains that long, then a read builds those steps' spans, timed.

``--before DIR`` (a tree of an earlier commit: ``git archive REV | tar -x -C DIR``) measures that tree
beside this one: section 2 alternates child processes running this bench with each tree's probe,
section 3 runs a target of each and alternates the queries between them.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List

from _common import REPO, Summary, clean_env, header, table, verdict

SLOW_SQL = ("SELECT module, stage, COUNT(*) AS count, AVG(duration) AS avg_time, SUM(duration) AS total_time "
            "FROM python.torch_trace WHERE step > (SELECT MAX(step) - 5 FROM python.torch_trace) "
            "GROUP BY module, stage ORDER BY total_time DESC LIMIT 10")


def models(torch: Any) -> Dict[str, Callable[[], Callable[[], None]]]:
    nn = torch.nn

    def mlp() -> Callable[[], None]:
        layers: List[Any] = []
        for _ in range(8):
            layers += [nn.Linear(1024, 1024), nn.ReLU()]
        model = nn.Sequential(*layers)
        return _trainer(torch, model, torch.randn(64, 1024), torch.randn(64, 1024), nn.MSELoss())

    def transformer() -> Callable[[], None]:
        layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.1, batch_first=True)
        model = nn.Sequential(nn.TransformerEncoder(layer, 6, enable_nested_tensor=False), nn.Linear(256, 256))
        return _trainer(torch, model, torch.randn(16, 32, 256), torch.randn(16, 32, 256), nn.MSELoss())

    return {"MLP 8 x Linear(1024), batch 64": mlp, "transformer 6 x d256, 16 x 32 tokens": transformer}


def _trainer(torch: Any, model: Any, x: Any, y: Any, loss_fn: Any) -> Callable[[], None]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return step


def block(step: Callable[[], None], steps: int) -> float:
    """Mean seconds per step over ``steps`` steps (a mean, so a sampled step among skipped ones counts)."""
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


CLOCK = time.thread_time_ns
"""CPU time of the training thread: with one intra-op thread a CPU step (forward, autograd's backward, the
optimizer) runs on the calling thread, and what the machine's other work takes from us does not count."""

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 32),
              "MALLOC_TOP_PAD_": str(1 << 28)}
"""glibc malloc told to keep what it got: otherwise every step maps and unmaps its 4 MB gradients, and the
page faults (2000-8000 a step, 0-24 ms of system time) make the MLP's step CPU time swing by -4..+18 %
(IQR); with them its IQR is about +-1 %. The training is the same; only the allocator's noise goes."""


def _spin(ns: int) -> None:
    """Busy for ``ns`` ns of this thread's CPU time: the planted cost."""
    end = CLOCK() + ns
    while CLOCK() < end:
        pass


def _timed_block(step: Callable[[], None], steps: int, mark: Callable[[], None] = lambda: None) -> List[int]:
    """One untimed step (a switch's transition: the trace naming modules, the optimizer hooks leaving),
    ``mark()``, then the CPU ns of each of ``steps`` steps."""
    step()
    mark()
    out = []
    for _ in range(steps):
        start = CLOCK()
        step()
        out.append(CLOCK() - start)
    return out


def bootstrap_ci(values: List[float], draws: int = 2000, block: int = 1, seed: int = 1) -> "tuple[float, float]":
    """95 % interval of the median of ``values`` by resampling them (percentile bootstrap); ``block`` > 1:
    runs of that many neighbours at a time (ratios that share a peer step are not independent)."""
    import random

    rand = random.Random(seed)
    n = len(values)
    medians = []
    for _ in range(draws):
        if block <= 1:
            sample = rand.choices(values, k=n)
        else:
            sample = []
            while len(sample) < n:
                at = rand.randrange(n - block + 1)
                sample.extend(values[at:at + block])
        medians.append(statistics.median(sample[:n]))
    medians.sort()
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def alternating(settings: Dict[str, Any], rounds: int, pairs: int,
                off_steps: Any = None) -> Dict[str, List[float]]:
    """Steps that alternate, one by one, between a setting's on and off states: per round and setting
    (their order rotating), ``2 * pairs`` steps after one untimed one; each on step's CPU time against
    the mean of the off steps on either side of it gives a ratio. ``settings[name]`` is
    ``(step, enter, leave, is_on, switch)``: ``enter``/``leave`` around the setting's steps, ``is_on()`` says
    whether the next step runs on, ``switch()`` (between steps) flips what the next step runs. ``leave()`` may
    return CPU ns of work the setting left for later (the trace's span building, which runs on the
    training thread every ~100 steps, or on a reader's): shared out over the round's on steps, so it
    counts. ``off_steps``: a dict that gets each setting's off steps' CPU ns."""
    names = list(settings)
    ratios: Dict[str, List[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            step, enter, leave, is_on, switch = settings[name]
            enter()
            try:
                step()
                switch()
                times: List[Any] = []
                for _ in range(2 * pairs + 1):
                    on = is_on()
                    start = CLOCK()
                    step()
                    times.append((on, CLOCK() - start))
                    switch()
            finally:
                later = leave() or 0
            ons = sum(1 for on, _ in times if on)
            times = [(on, ns + later / ons if on else ns) for on, ns in times] if later and ons else times
            for k in range(1, len(times) - 1):
                (before_on, before), (on, took), (after_on, after) = times[k - 1:k + 2]
                if on and not before_on and not after_on:
                    ratios[name].append(took / ((before + after) / 2) - 1.0)
            if off_steps is not None:
                off_steps.setdefault(name, []).extend(ns for on, ns in times if not on)
    return ratios


class TraceToggle:
    """The trace, every step, in for one step and out for the next: between steps (not timed) its module
    and optimizer hooks are put in or taken out, as a trace's start and stop do but keeping its buffer,
    names and step, so an on step pays all that a traced step costs and an off step nothing. For
    ``alternating``: ``enter``, ``is_on``, ``switch``, and ``leave``, which returns the CPU time of what the
    round's records cost later, to be shared out over its on steps:

    * ``read=True``: every span is read: their build (a reader's, in the target) is timed and counted;
    * ``read=False``: nobody reads: a training thread cuts its records once they pass their limit
      (``trace_events``), so what is counted is what that cut costs them (half of them cut here and timed,
      the cost scaled to all of them); they are then built, untimed (``build_us_per_span`` says how long).
    """

    def __init__(self, trace: Any, options: Any, read: bool = True) -> None:
        self.trace, self.options, self.read = trace, options, read
        self.tracer: Any = None
        self.on = False
        self.hook_us = 0.0  # time in the hooks over the last round's timed steps (Tracer.hook_time_ns)
        self.build_us_per_span: List[float] = []
        self._hook_ns: Any = None

    def enter(self) -> None:
        self.trace.start(self.options)
        self.tracer, self.on = self.trace.current(), True  # the untimed first step runs traced
        self._hook_ns = None  # from the first switch: the first step (modules named, hooks set) is not timed

    def is_on(self) -> bool:
        return self.on

    def switch(self) -> None:
        tracer, self.on = self.tracer, not self.on
        if self._hook_ns is None:
            self._hook_ns = tracer.hook_time_ns()
        if self.on:
            optim = sys.modules["torch.optim.optimizer"]
            pre, post = tracer._optimizer_hooks
            tracer._optimizer_handles = [optim.register_optimizer_step_pre_hook(pre),
                                         optim.register_optimizer_step_post_hook(post)]
            tracer._arm(True)
        else:
            tracer._remove(tracer._optimizer_handles)
            tracer._arm(False)

    def leave(self) -> int:
        later = 0
        log = self.tracer._log
        if not self.read:
            threads = list(log._threads.values())
            held = sum(len(t.events) for t in threads)
            started = CLOCK()
            for thread in threads:
                log._cut(thread, len(thread.events) // 2)
            took = CLOCK() - started
            cut = held - sum(len(t.events) for t in threads)
            later = int(took * held / cut) if cut > 0 else 0
        hook_ns = self.tracer.hook_time_ns()  # without the build that follows (a reader's)
        written = self.tracer.ring.written()
        started = CLOCK()
        self.tracer.flush()
        built = CLOCK() - started
        if self.tracer.ring.written() > written:
            self.build_us_per_span.append(built / 1e3 / (self.tracer.ring.written() - written))
        self.trace.stop()
        self.hook_us = ((self.tracer.hook_time_ns() if self.read else hook_ns + later) - self._hook_ns) / 1e3
        return built if self.read else later


class HookSet:
    """Global module and optimizer hooks, in before an on step and out after it (for ``alternating``, as
    ``TraceToggle``): ``floor=False``, empty ones: torch's own part of any such hook (its slower module
    call path, its hook loops); ``floor=True``, the least a recording hook does: Dynamo's guard (as the
    trace's hooks have) and one clock reading appended to a list. What a trace costs beyond the floor is
    what its own work costs."""

    def __init__(self, torch: Any, floor: bool) -> None:
        self.modules, self.optim = sys.modules["torch.nn.modules.module"], sys.modules["torch.optim.optimizer"]
        self.on, self.handles, self.records = False, [], []  # type: bool, List[Any], List[int]
        if floor:
            compiling = getattr(torch.compiler, "is_dynamo_compiling", None) or torch.compiler.is_compiling
            records, clock = self.records, time.perf_counter_ns

            def hook(*args: Any) -> None:
                if compiling():
                    return
                records.append(clock())
            self.hook = hook
        else:
            self.hook = lambda *args: None

    def _put(self, on: bool) -> None:
        if on:
            self.handles = [self.modules.register_module_forward_pre_hook(self.hook),
                            self.modules.register_module_forward_hook(self.hook),
                            self.optim.register_optimizer_step_pre_hook(self.hook),
                            self.optim.register_optimizer_step_post_hook(self.hook)]
        else:
            for handle in self.handles:
                handle.remove()
            self.handles = []

    def enter(self) -> None:
        self.on = True  # the untimed first step runs with them
        self._put(True)

    def is_on(self) -> bool:
        return self.on

    def switch(self) -> None:
        self.on = not self.on
        self._put(self.on)

    def leave(self) -> int:
        self._put(False)
        self.records.clear()
        return 0


class Setting:
    """What a block of the paired measurement runs: ``enter`` before it, ``leave`` after (it may return
    CPU ns of work left for later: shared over the block's steps), each step ``step`` (None: the
    model's), ``steps`` of them (``--every N``: N, so one sampled step a block)."""

    def __init__(self, enter: Callable[[], None] = lambda: None, leave: Callable[[], Any] = lambda: None,
                 step: Any = None, steps: int = 0, mark: Callable[[], None] = lambda: None) -> None:
        self.enter, self.leave, self.step, self.steps, self.mark = enter, leave, step, steps, mark


ESTIMATORS = {"mean": lambda times: sum(times) / len(times), "min": min}
"""A block's figure: its mean step (every step counts; under ``--every N`` the sampled one among the
skipped), or its fastest step (what another process on the same core adds to a step, caches flushed
and all, only ever adds: the fastest of a few steps carries the least of it)."""


def paired(step: Callable[[], None], settings: Dict[str, Setting], rounds: int,
           steps: int) -> "tuple[Dict[str, Dict[str, List[float]]], List[float]]":
    """Untraced blocks of ``steps`` steps with a block of each setting between two of them: U S1 U S2 U
    ..., the settings' order rotating each round. Each setting block gives one pair ratio per estimator:
    its figure / the mean of the untraced blocks' on either side - 1. Returns the ratios per estimator
    and setting, and the untraced blocks' mean ns per step."""
    names = list(settings)
    ratios: Dict[str, Dict[str, List[float]]] = {e: {name: [] for name in names} for e in ESTIMATORS}
    base = [_timed_block(step, steps)]
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            setting = settings[name]
            setting.enter()
            later = 0
            try:
                took = _timed_block(setting.step or step, setting.steps or steps, setting.mark)
            finally:
                later = setting.leave() or 0
            took = [ns + later / len(took) for ns in took]
            base.append(_timed_block(step, steps))
            for e, figure in ESTIMATORS.items():
                ratios[e][name].append(figure(took) / ((figure(base[-2]) + figure(base[-1])) / 2) - 1.0)
    return ratios, [ESTIMATORS["mean"](b) for b in base]


def overhead(torch: Any, rounds: int, steps: int, only: str = "", extra: bool = False, pairs: int = 5,
             blocks: bool = True) -> List[List[str]]:
    """Section 1: the paired measurement of each model under each trace setting, beside a planted cost
    (a busy-wait of 0.3 % of the untraced step, in the step) and the method's zero (untraced against
    untraced)."""
    from probe.tables.torch import trace
    from probe.tables.torch.trace_options import TraceOptions

    traced = {"forward, every step": TraceOptions()}
    if extra:
        traced.update({"forward, --every 10": TraceOptions(every=10), "forward + backward": TraceOptions(backward=True),
                       "forward + anomalies": TraceOptions(anomalies=True)})
    hooks_module = sys.modules["torch.nn.modules.module"]
    out = []
    for label, make in models(torch).items():
        if only and only not in label:
            continue
        step = make()
        for _ in range(3):
            step()
        untraced_ns = statistics.median(_timed_block(step, 5))
        planted_ns = int(untraced_ns * PLANTED)

        def planted(step: Callable[[], None] = step, planted_ns: int = planted_ns) -> None:
            step()
            _spin(planted_ns)

        hooks: Dict[str, List[float]] = {name: [] for name in traced}
        spans: Dict[str, List[float]] = {name: [] for name in traced}
        marks: List[Any] = [None]

        def mark(marks: List[Any] = marks) -> None:  # after a block's untimed first step
            tracer = trace.current()
            marks[0] = tracer and (tracer.hook_time_ns(), tracer.steps_seen, tracer.ring.written())

        def stopper(name: str, marks: List[Any] = marks, hooks: Dict[str, List[float]] = hooks,
                    spans: Dict[str, List[float]] = spans) -> Callable[[], None]:
            def leave() -> int:
                tracer = trace.current()
                started = CLOCK()
                if tracer is not None:
                    tracer.flush()  # the block's spans: built here and counted (see alternating)
                built = CLOCK() - started
                trace.stop()
                if tracer is not None and marks[0] and tracer.steps_seen > marks[0][1]:
                    hook_ns, seen, written = marks[0]
                    hooks[name].append((tracer.hook_time_ns() - hook_ns) / (tracer.steps_seen - seen) / 1e3)
                    spans[name].append((tracer.ring.written() - written) / (tracer.steps_seen - seen))
                return built
            return leave

        settings = {name: Setting(lambda options=options: trace.start(options), stopper(name),
                                  steps=options.every if options.every > 1 else 0, mark=mark)
                    for name, options in traced.items()}
        empty: List[Any] = []

        def empty_in(empty: List[Any] = empty) -> None:
            empty[:] = [hooks_module.register_module_forward_pre_hook(lambda m, i: None),
                        hooks_module.register_module_forward_hook(lambda m, i, o: None)]

        def empty_out(empty: List[Any] = empty) -> None:
            for handle in empty:
                handle.remove()

        settings["two empty global hooks (torch's part)"] = Setting(empty_in, empty_out)
        settings["planted %.2f %% (busy-wait in the step)" % (PLANTED * 100)] = Setting(step=planted)
        settings["untraced (the method's zero)"] = Setting()
        ratios, base = paired(step, settings, rounds, steps) if blocks else ({e: {} for e in ESTIMATORS}, [])
        state = [False]

        def flip(on: Callable[[], None] = lambda: None, off: Callable[[], None] = lambda: None,
                 state: List[bool] = state) -> Callable[[], None]:
            def switch() -> None:
                state[0] = not state[0]
                (on if state[0] else off)()
            return switch

        def begin(state: List[bool] = state) -> None:
            state[0] = True  # flipped off before the first timed step

        def planted_if_on(step: Callable[[], None] = step, planted_ns: int = planted_ns,
                          state: List[bool] = state) -> None:
            step()
            if state[0]:
                _spin(planted_ns)

        toggle, unread = TraceToggle(trace, TraceOptions()), TraceToggle(trace, TraceOptions(), read=False)

        def trace_out(name: str = "forward, every step", toggle: "TraceToggle" = toggle,
                      hooks: Dict[str, List[float]] = hooks) -> int:
            later = toggle.leave()
            hooks.setdefault(name + " (steps)", []).append(toggle.hook_us / pairs)
            return later

        def is_on(state: List[bool] = state) -> bool:
            return state[0]

        floor = HookSet(torch, floor=True)
        steps_of = {"forward, every step": (step, toggle.enter, trace_out, toggle.is_on, toggle.switch),
                    UNREAD: (step, unread.enter, lambda unread=unread: trace_out(UNREAD, unread), unread.is_on, unread.switch),
                    "two empty global hooks (torch's part)": (step, begin, empty_out, is_on, flip(empty_in, empty_out)),
                    "the floor: module and optimizer hooks, a clock reading appended": (
                        step, floor.enter, floor.leave, floor.is_on, floor.switch),
                    "planted %.2f %% (busy-wait in the step)" % (PLANTED * 100): (planted_if_on, begin, lambda: None,
                                                                                is_on, flip()),
                    "untraced (the method's zero)": (step, begin, lambda: None, is_on, flip())}
        off: Dict[str, List[int]] = {}
        by_step = alternating(steps_of, rounds, pairs, off)
        for name, values in by_step.items():
            ratios.setdefault("steps", {})[name] = values
        out.append([label, "untraced step, CPU", "", "%.2f ms" % (statistics.median(base or [untraced_ns]) / 1e6),
                    "", "", "", ""])
        for e in ("steps",) + tuple(ESTIMATORS):
            for name, values in ratios.get(e, {}).items():
                s = Summary.of(values)
                low, high = bootstrap_ci(values, block=4 if e == "steps" else 1)
                note = ""
                key = name + " (steps)" if e == "steps" else name
                if key in hooks and hooks[key]:
                    note = "%.0f us in hooks a step" % statistics.median(hooks[key])
                    if e == "steps" and name == UNREAD and unread.build_us_per_span:
                        note += "; a read builds a span in %.2f us" % statistics.median(unread.build_us_per_span)
                    if spans.get(name) and e != "steps":
                        note += ", %.1f spans a step" % statistics.median(spans[name])
                elif name.startswith("planted"):
                    # what was planted, against the step as the run found it (the 0.3 % is of the step at the start)
                    planted_share = planted_ns / statistics.median(off[name]) if e == "steps" and name in off else PLANTED
                    seen = low > 0 and low <= planted_share <= high
                    note = "planted %+.2f %% of the off steps' median: %s" % (planted_share * 100,
                                                                                "seen" if seen else "NOT SEEN")
                method = "step by step" if e == "steps" else "blocks, %s step" % ("fastest" if e == "min" else e)
                out.append([label, name, method, "%+.2f %%" % (s.median * 100),
                            "%+.2f..%+.2f %%" % (s.q1 * 100, s.q3 * 100), "%+.2f..%+.2f %%" % (low * 100, high * 100),
                            str(s.n), note])
    return out


PLANTED = 0.003
UNREAD = "forward, every step, nobody reads (records cut, not built)"


def worst_case(torch: Any, rounds: int) -> List[List[str]]:
    """Section 2: per module call, forward only (no_grad), CPU time of this thread, blocks of each
    setting interleaved (order rotating); a setting's cost per call is the median over rounds of (its
    block - the untraced block of the same round) / the module calls of a block. Two models: many tiny
    modules (the hooks' own instructions, caches warm) and the MLP's layers (8 x Linear(1024) + ReLU,
    batch 64: each hook runs right after a matmul has flushed the caches, as in training)."""
    from probe.tables.torch import trace
    from probe.tables.torch.trace_options import TraceOptions

    hooks = sys.modules["torch.nn.modules.module"]
    shapes = {"200 x Linear(16, 16), batch 4 (caches warm)": ([torch.nn.Linear(16, 16) for _ in range(200)],
                                                             torch.randn(4, 16), 20),
              "8 x (Linear(1024) + ReLU), batch 64 (caches flushed)": (
                  [m for _ in range(8) for m in (torch.nn.Linear(1024, 1024), torch.nn.ReLU())],
                  torch.randn(64, 1024), 4)}
    rows = []
    for label, (layers, x, repeat) in shapes.items():
        model = torch.nn.Sequential(*layers)
        calls = len(layers) + 1

        def forward(model: Any = model, x: Any = x) -> None:
            with torch.no_grad():
                model(x)

        def run(forward: Callable[[], None] = forward, repeat: int = repeat) -> float:
            forward()  # the first call after a switch (naming, the janitor) is not timed
            start = CLOCK()
            for _ in range(repeat):
                forward()
            return (CLOCK() - start) / repeat

        def empty_hooks(run: Callable[[], float] = run) -> float:
            a = hooks.register_module_forward_pre_hook(lambda m, i: None)
            b = hooks.register_module_forward_hook(lambda m, i, o: None)
            try:
                return run()
            finally:
                a.remove()
                b.remove()

        def traced(options: Any, run: Callable[[], float] = run, repeat: int = repeat,
                   stepped: bool = False) -> Callable[[], float]:
            def go() -> float:
                trace.start(options)
                try:
                    if stepped:  # an optimizer has stepped: the append-only hooks (trace_events)
                        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0).step()
                    took = run()
                    started = CLOCK()
                    trace.current().flush()  # their spans' build, on this thread: counted
                    return took + (CLOCK() - started) / repeat
                finally:
                    trace.stop()
            return go

        runners = {"untraced": run, "two empty global hooks (torch's part)": empty_hooks,
                   "traced (forward)": traced(TraceOptions()),
                   "traced, after an optimizer step (append-only hooks, build counted)": traced(TraceOptions(),
                                                                                                 stepped=True),
                   "traced + anomalies": traced(TraceOptions(anomalies=True)),
                   "traced, module filtered out": traced(TraceOptions(modules="nothing*"))}
        names = list(runners)
        results: Dict[str, List[float]] = {name: [] for name in names}
        for r in range(rounds):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                results[name].append(runners[name]())
        for name in names:
            block_ms = statistics.median(results[name]) / 1e6
            if name == "untraced":
                rows.append([label, name, "%.3f ms" % block_ms, "-"])
                continue
            per_call = Summary.of([(a - b) / calls / 1e3 for a, b in zip(results[name], results["untraced"])])
            rows.append([label, name, "%.3f ms" % block_ms, "%.2f us [%.2f..%.2f]" % (per_call.median, per_call.q1,
                                                                                    per_call.q3)])
    return rows


def _trace_target(repo: str) -> Any:
    """``tests/targets/train_trace.py`` of the tree at ``repo``, run with that tree's probe, tracing from the
    start with backward spans; returns (process, client) once its agent answers."""
    import probe

    env = clean_env(probe=True)
    env.update({"PROBE_TORCH_TRACE": "1", "PROBE_TORCH_TRACE_BACKWARD": "1", "PYTHONPATH": repo})
    script = os.path.join(repo, "tests", "targets", "train_trace.py")
    popen = subprocess.Popen([sys.executable, script, "normal"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    try:
        line = popen.stdout.readline() if popen.stdout else ""
        if not line.startswith("READY"):
            raise RuntimeError("target did not get ready: %r" % line)
        client = probe.connect(str(popen.pid))
        deadline = time.monotonic() + 30
        while True:
            try:
                client.health()
                break
            except probe.errors.ProbeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    except BaseException:
        popen.kill()
        popen.wait(10)
        raise
    return popen, client


def _wait_full(client: Any) -> Dict[str, Any]:
    deadline = time.monotonic() + 180
    while True:
        status = client.trace_status()
        if status["rows"] >= status["size"]:
            return status
        if time.monotonic() > deadline:
            raise RuntimeError("buffer not full after 180 s: %r" % status)
        time.sleep(0.5)


def _served_ms(client: Any) -> float:
    from probe.client import transport

    body = json.dumps({"sql": SLOW_SQL}).encode()
    answer = transport.request(client.target.address, "POST", "/v1/query", body, {})
    return float(json.loads(answer.body)["elapsed_ms"])


def agent_figures(runs: int, before: str = "") -> List[List[str]]:
    """Section 3. With ``before`` (a tree of an earlier commit), a second target runs that tree's probe
    beside this one, both buffers full, and the queries alternate between the two (A B B A ...), the
    target not queried stopped (SIGSTOP) meanwhile."""
    sys.path.insert(0, REPO)
    trees = [("this tree", REPO)] + ([("before (%s)" % os.path.basename(before.rstrip("/")), before)]
                                     if before else [])
    started: List[Any] = []
    try:
        for _, repo in trees:
            started.append(_trace_target(repo))
        popen, client = started[0]
        start_rss = _rss_mb(popen.pid)
        statuses = [_wait_full(c) for _, c in started]
        status = statuses[0]
        full_rss = _rss_mb(popen.pid)
        for _, c in started:
            c.query_rows("SELECT 1")  # DuckDB and pyarrow in the agent
            _served_ms(c)
        inside: List[List[float]] = [[] for _ in started]
        for r in range(runs):
            order = list(range(len(started))) if r % 2 == 0 else list(range(len(started)))[::-1]
            for i in order:
                # Only the target queried trains meanwhile (the other is stopped): the machine is as busy
                # as with one target, as without --before.
                for j, (other, _) in enumerate(started):
                    os.kill(other.pid, signal.SIGCONT if j == i else signal.SIGSTOP)
                time.sleep(0.3)
                inside[i].append(_served_ms(started[i][1]))
        for other, _ in started:
            os.kill(other.pid, signal.SIGCONT)
        query_rss = _rss_mb(popen.pid)
        ring_mb = status["size"] * (8 * 8 + 7 * 8 + 8) / 1e6
        rows = [
            ["spans held / buffer size", "%d / %d" % (status["rows"], status["size"]), ""],
            ["ring arrays (preallocated at start)", "%.2f MB" % ring_mb, ""],
            ["target VmRSS, trace started -> buffer full", "%.1f -> %.1f MB" % (start_rss, full_rss),
             "+%.1f MB (includes the training's own growth)" % (full_rss - start_rss)],
            ["target VmRSS after the queries (DuckDB + pyarrow loaded)", "%.1f MB" % query_rss, ""],
        ]
        for (label, _), values in zip(trees, inside):
            s = Summary.of(values)
            rows.append(["slow-module query on the full buffer, served in the agent, %s (n=%d)" % (label, s.n),
                         "median %.2f ms, IQR %.2f-%.2f, min-max %.2f-%.2f" % (s.median, s.q1, s.q3, s.low, s.high),
                         "<= 20 ms: %s" % verdict(s.median <= 20.0)])
        if before:
            ratios = Summary.of([a / b for a, b in zip(inside[0], inside[1])])
            rows.append(["this tree / before, per pair", "median %.2fx, IQR %.2f-%.2fx" % (ratios.median, ratios.q1,
                                                                                           ratios.q3), ""])
        rows.append(["trace status overhead estimate (time inside hooks)", "%.3f %%" % status["overhead_percent"],
                     "%s us per step" % status["hook_us_per_step"]])
        return rows
    finally:
        for popen, _ in started:
            popen.kill()
            popen.wait(10)


def worst_case_in(repo: str, rounds: int) -> List[List[str]]:
    """Section 2 of this bench run with the probe of the tree at ``repo``, in a child process."""
    code = ("import json, sys; sys.path.insert(0, %r); import probe; assert probe.__file__.startswith(%r), "
            "probe.__file__; sys.path.insert(0, %r); import torch, bench_trace; torch.set_num_threads(1); "
            "print(json.dumps(bench_trace.worst_case(torch, %d)))" % (repo, repo, os.path.join(REPO, "bench"), rounds))
    done = subprocess.run([sys.executable, "-c", code], env=dict(clean_env(), **MALLOC_ENV), capture_output=True,
                          text=True, timeout=600, cwd=repo)
    if done.returncode != 0:
        raise RuntimeError("worst case in %s failed: %s" % (repo, done.stderr[-2000:]))
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare_worst_case(before: str, rounds: int, runs: int) -> List[List[str]]:
    """Per-hook cost, this tree against ``before``: ``runs`` child runs each, alternating; the median
    over the runs of each run's median cost per call."""
    per_call: Dict[str, Dict[tuple, List[float]]] = {"this tree": {}, "before": {}}
    for r in range(runs):
        order = [("this tree", REPO), ("before", before)]
        for label, repo in (order if r % 2 == 0 else order[::-1]):
            for model, name, _, cost in worst_case_in(repo, rounds):
                if cost != "-":
                    per_call[label].setdefault((model, name), []).append(float(cost.split()[0]))
    rows = []
    for key in per_call["this tree"]:
        a, b = Summary.of(per_call["this tree"][key]), Summary.of(per_call["before"][key])
        rows.append([key[0], key[1], "%.2f us (%.2f-%.2f)" % (a.median, a.low, a.high),
                     "%.2f us (%.2f-%.2f)" % (b.median, b.low, b.high)])
    return rows


def read_cost(torch: Any, seconds: float, reads: int) -> List[List[str]]:
    """Section 4: what a reader that reads every ``seconds`` (the page refreshes every 5 s) costs each
    step of the MLP: its spans are built at the read (on the reader's thread, in the target). The traced
    MLP trains for ``seconds``, then a read builds what those steps left, its CPU time timed; ``reads``
    times."""
    from probe.tables.torch import trace

    step = models(torch)["MLP 8 x Linear(1024), batch 64"]()
    for _ in range(3):
        step()
    trace.start()
    try:
        tracer = trace.current()
        step()
        step()
        tracer.flush()
        per_step, per_span, steps_per_read, step_ms = [], [], [], []
        for _ in range(reads):
            steps, spans = tracer.steps_seen, tracer.ring.written()
            started, end = CLOCK(), time.monotonic() + seconds
            while time.monotonic() < end:
                step()
            trained = CLOCK() - started
            started = CLOCK()
            tracer.flush()
            built = CLOCK() - started
            steps, spans = tracer.steps_seen - steps, tracer.ring.written() - spans
            per_step.append(built / steps / 1e3)
            per_span.append(built / spans / 1e3)
            steps_per_read.append(steps)
            step_ms.append(trained / steps / 1e6)
    finally:
        trace.stop()
    share = statistics.median(per_step) / 1e3 / statistics.median(step_ms) * 100
    return [["MLP 8 x Linear(1024), batch 64", "a read every %g s: the build, a step" % seconds,
             "%.1f us (%.1f-%.1f)" % (statistics.median(per_step), min(per_step), max(per_step)),
             "%.3f %% of a %.1f ms step; %.2f us a span, %d steps a read" % (
                 share, statistics.median(step_ms), statistics.median(per_span), statistics.median(steps_per_read))]]


def _rss_mb(pid: int) -> float:
    with open("/proc/%d/status" % pid) as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per block (section 1)")
    parser.add_argument("--quick", action="store_true", help="8 rounds of 2 steps")
    parser.add_argument("--only", choices=("overhead", "worst", "agent", "read"), help="run one section")
    parser.add_argument("--read-every", type=float, default=5.0, help="section 4: seconds between reads")
    parser.add_argument("--model", default="", help="section 1: only the model whose label holds this (MLP, transformer)")
    parser.add_argument("--extra", action="store_true", help="section 1: also --every 10, backward and anomalies")
    parser.add_argument("--pairs", type=int, default=5, help="section 1: on/off step pairs per round and setting")
    parser.add_argument("--no-blocks", action="store_true", help="section 1: step by step only")
    parser.add_argument("--runs", type=int, default=4, help="section 2 with --before: child runs per tree")
    parser.add_argument("--queries", type=int, default=20, help="slow-module queries per target (section 3)")
    parser.add_argument("--before", default="", help="a tree of an earlier commit (git archive REV | tar -x -C "
                        "DIR): sections 2 and 3 measure it beside this one")
    args = parser.parse_args()
    if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable] + sys.argv, dict(os.environ, **MALLOC_ENV))
    if args.quick:
        args.rounds, args.steps = 8, 2
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    header("torch trace: overhead on a training step, worst case per hook, agent with a full buffer",
           ["section 1: %d rounds of %d on/off step pairs%s, step CPU time of the training thread; torch %s, 1 "
            "intra-op thread; load average %.2f at start" % (args.rounds, args.pairs, "" if args.no_blocks else
                                                             ", and of blocks of %d steps" % args.steps,
                                                             torch.__version__, os.getloadavg()[0])])
    if args.only in (None, "overhead"):
        print(table(overhead(torch, args.rounds, args.steps, args.model, args.extra, args.pairs,
                             not args.no_blocks),
                    ["model", "setting", "block", "overhead median", "IQR of pairs", "95 % CI of median", "pairs",
                     "note"]))
        print("load average %.2f at the end of section 1" % os.getloadavg()[0])
        print()
    if args.only in (None, "worst"):
        if args.before:
            print(table(compare_worst_case(args.before, args.rounds, args.runs),
                        ["forward only, per module call", "setting", "this tree: median of runs (min-max)",
                         "before"]))
        else:
            print(table(worst_case(torch, args.rounds), ["forward only", "setting", "block CPU", "per module call: "
                                                         "median [IQR] over rounds"]))
        print()
    if args.only in (None, "agent"):
        print(table(agent_figures(args.queries, args.before), ["agent, default buffer", "figure", "note"]))
        print()
    if args.only in (None, "read"):
        print(table(read_cost(torch, args.read_every, 6), ["model", "reader", "median (min-max)", "note"]))


if __name__ == "__main__":
    main()
