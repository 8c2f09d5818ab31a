"""The tracer: global module and optimizer hooks that time each forward, backward and optimizer step.

Hot path rules (these hooks run for every module call of the training step):

* no device sync: CPU time from ``perf_counter_ns``, device time from CUDA events read later;
* with host times only (no CUDA events, backward spans or anomaly check: ``_plain``), once the first
  optimizer has stepped, the module hooks only append a record to a list, and the optimizer's hooks
  theirs (``trace_events``): they run right after a step's matmuls have flushed the caches, where every
  object and call touched costs a miss; the spans are built from the records later, many steps at
  once, where that work runs warm. Until then (and on CUDA, or with backward spans or anomalies), a hook
  builds its span: nothing allocated per call beyond a stack entry, names from a cache keyed by
  ``id(module)``, a span one ``pack_into`` into a preallocated record (``trace_ring``), a filtered-out
  module one dict look-up;
* steps that ``--every N`` skips cost nothing: the module hooks are taken out for them (torch's
  ``Module.__call__`` then takes its fast path again) and put back for the next sampled step;
* every exception is caught: a hook that raised would kill the training step. The first one switches
  the trace off and keeps its reason for ``trace status``.

Steps: the step advances when the first optimizer this trace saw finishes ``step()`` (a global
optimizer step post hook; other optimizers' steps are spans of the same step). Until an optimizer has
stepped (inference, evaluation), a step is one call of the first top-level module seen.

Removing hooks: module hooks may go at any time (``Module.__call__`` copies the hook dicts into a
tuple in one C call before running them). The optimizer's hook dicts are iterated by a Python loop
inside ``Optimizer.step``, so removing an entry from another thread could break that loop; they are
removed on the training thread, by a one-shot module forward pre-hook at the next forward.

torch.compile: Dynamo must never trace these hooks (``perf_counter_ns``, ``get_ident`` and the ring's
``array`` stores are graph breaks; the hook dicts' keys would become guards). Two things keep them out:

* every hook (and the backward ones) returns at once while ``torch.compiler.is_dynamo_compiling()`` (or
  ``is_compiling()`` on a torch without it): Dynamo folds that call to True, so a hook it traces
  (inlined in a module call, or as a frame of its own under a compiled module's ``__call__``) is an
  empty function: no op, no graph break. At run time, inside a
  compiled graph no module hook runs at all; a compiled module's wrapper (``OptimizedModule``) is called
  eagerly, so it has a span, named after the module it wraps (``trace_names``).
* once the program has loaded ``torch._dynamo``, the module hooks leave torch's hook dicts for the time
  of each Dynamo compile and come back after (Dynamo's compile start/end callbacks): what Dynamo
  compiles, and guards on, is what it would see without probe, so starting, stopping, sampling or
  restarting the trace recompiles nothing. The optimizer hooks stay (``Optimizer.step`` may be iterating
  them); a compiled ``optimizer.step()`` meets them as empty functions.
"""

import importlib
import itertools
import sys
import threading
import time
import warnings
import weakref
from typing import Any, List, Optional

from probe.tables.torch.trace_anomaly import AnomalyCheck
from probe.tables.torch.trace_backward import BackwardSpans
from probe.tables.torch.trace_device import CpuMemory, CudaMemory, CudaTimer, memory_reader
from probe.tables.torch.trace_events import APPEND_NS, EventLog
from probe.tables.torch.trace_names import ModuleNames
from probe.tables.torch.trace_options import TraceOptions
from probe.tables.torch.trace_ring import BACKWARD, FORWARD, OPTIMIZER, RECORD_BYTES, SpanRing

__all__ = ["Tracer"]

_perf_ns = time.perf_counter_ns
_ident = threading.get_ident
_MAX_STACK = 10_000


def _not_compiling() -> bool:
    return False


_compiling: Any = _not_compiling  # torch.compiler.is_dynamo_compiling once a trace is made (torch is loaded then)
_active: Optional["Tracer"] = None  # the trace started last: the one whose hooks a compile hides
_compile_handler: Any = None  # Dynamo's compile callback handler, once the program has loaded torch._dynamo
_cpu_memory = CpuMemory()  # one per process: its descriptor is never closed under a running hook


class Tracer:
    def __init__(self, torch: Any, options: TraceOptions, anomaly_store: Any) -> None:
        global _compiling
        compiler = getattr(torch, "compiler", None)
        # Dynamo folds either to True; is_dynamo_compiling is a bare ``return False`` in eager code (one call
        # where is_compiling makes two, in every hook)
        _compiling = (getattr(compiler, "is_dynamo_compiling", None) or getattr(compiler, "is_compiling", None)
                      or _not_compiling)
        # (hooks in, janitor in) when a compile began: what goes back when it ends
        self._hidden = (False, False)
        self.torch = torch
        self.options = options
        self.ring = SpanRing(options.size)
        self.names = ModuleNames(options.modules, self.ring.name_id)
        self._entries = self.names.entries  # the same dict, bound for the hooks (cleared in place, never replaced)
        memory = memory_reader(torch)
        self.memory: Any = _cpu_memory if isinstance(memory, CpuMemory) else memory
        self.device = self.memory.device
        self.timer: Optional[CudaTimer] = CudaTimer(torch) if isinstance(memory, CudaMemory) else None
        self.anomaly: Optional[AnomalyCheck] = AnomalyCheck(torch, anomaly_store) if options.anomalies else None
        self.backward: Optional[BackwardSpans] = (BackwardSpans(torch, self._backward_begins, self._backward_ends,
                                                                self._fail) if options.backward else None)
        # host times only: no CUDA events, no backward spans, no anomaly check (the hooks' short path)
        self._plain = self.timer is None and self.anomaly is None and self.backward is None
        # once the first optimizer has stepped, a plain trace's hooks only append records (trace_events)
        self._log: Optional[EventLog] = EventLog(self, _compiling) if self._plain else None
        self._fast: Optional[EventLog] = None  # the log, once its hooks are the ones in (None again at stop)
        self._optimizer_hooks = ((self._log.optimizer_hooks(self._optimizer_pre, self._optimizer_post, self._step_ends)
                                  if self._log is not None else (self._optimizer_pre, self._optimizer_post)))
        self._writer = self.ring.writer()
        self.step = 0
        self.steps_seen = 0
        self.step_start = _perf_ns()
        self.sampled = True
        self.running = False
        self.failure: Optional[str] = None
        self.hook_ns = 0
        self.started_perf_ns = _perf_ns()
        self.started_wall_ns = time.time_ns()
        self.stopped_perf_ns: Optional[int] = None
        self._seq = itertools.count()
        self._by_optimizer = False
        self._primary: Optional[Any] = None  # weak reference to the optimizer whose steps count
        self._first_root: Optional[Any] = None  # weak reference to the module whose calls count, until then
        self._local = threading.local()
        self._module_handles: List[Any] = []
        self._optimizer_handles: List[Any] = []
        self._janitor_handle: Optional[Any] = None
        self._lock = threading.RLock()  # start/stop/arm only; held for no call into user code

    # -- life cycle -------------------------------------------------------------------------------

    def start(self) -> None:
        global _active
        _quiet_compiled_wrappers(True)
        optim = _submodule("torch.optim.optimizer")
        pre, post = self._optimizer_hooks
        self._optimizer_handles = [optim.register_optimizer_step_pre_hook(pre),
                                   optim.register_optimizer_step_post_hook(post)]
        self.running = True
        _active = self
        _watch_compiles()
        self._arm(True)

    def stop(self, failure: Optional[str] = None) -> None:
        """Switch off now: module hooks removed at once, optimizer hooks at the next forward (see above)."""
        with self._lock:
            if failure and not self.failure:
                self.failure = failure
            if not self.running:
                return
            self.running = False
            self._fast = None
            if self._log is not None:
                self._log.fast_optimizer(None)
            if _active is self:
                _quiet_compiled_wrappers(False)
            self.stopped_perf_ns = _perf_ns()
            if self.backward is not None:
                self.backward.active = False
            self._remove(self._module_handles)
            if self._optimizer_handles and self._janitor_handle is None:
                module = _submodule("torch.nn.modules.module")
                self._janitor_handle = module.register_module_forward_pre_hook(self._janitor)

    def flush(self) -> None:
        """Build the spans of the append-only hooks' events so far (for a reader; any thread)."""
        if self._log is not None:
            self._log.flush()

    def hook_time_ns(self) -> int:
        """Time in this trace's hooks: measured, plus ``APPEND_NS`` for each call of an append-only hook
        (timing those would double what they cost)."""
        return self.hook_ns + self.append_only_calls() * APPEND_NS

    def append_only_calls(self) -> int:
        """Calls of the append-only hooks built so far (``hook_time_ns`` counts each at ``APPEND_NS``)."""
        return self._log.calls if self._log is not None else 0

    def spans_cut(self) -> int:
        """Spans (about) whose records were dropped unbuilt: the ring would not have held them (trace_events)."""
        return self._log.spans_cut if self._log is not None else 0

    def hooks_left(self) -> int:
        """Hooks of this trace still registered in torch (0 once a stopped trace has fully left)."""
        return len(self._module_handles) + len(self._optimizer_handles) + (self._janitor_handle is not None)

    def _janitor(self, module: Any, args: Any) -> None:
        if _compiling():
            return
        try:
            with self._lock:
                self._remove(self._optimizer_handles)
                if self._janitor_handle is not None:
                    self._janitor_handle.remove()
                    self._janitor_handle = None
        except Exception:
            pass

    def _arm(self, on: bool) -> None:
        """Module hooks in (``on``) or out; called at step boundaries and at start."""
        with self._lock:
            if on and self.running and not self._module_handles:
                module = _submodule("torch.nn.modules.module")
                fast = self._fast
                pre, post = (fast.pre, fast.post) if fast is not None else (self._pre, self._post)
                self._module_handles = [module.register_module_forward_pre_hook(pre),
                                        module.register_module_forward_hook(post)]
            elif not on and self._module_handles:
                self._remove(self._module_handles)

    def hide(self, hidden: bool) -> None:
        """Module hooks out of torch's dicts while Dynamo compiles (``hidden``), back in after; never raises."""
        try:
            with self._lock:
                if hidden:
                    self._hidden = (bool(self._module_handles), self._janitor_handle is not None)
                    self._remove(self._module_handles)
                    if self._janitor_handle is not None:
                        self._janitor_handle.remove()
                        self._janitor_handle = None
                    return
                hooks, janitor = self._hidden
                self._hidden = (False, False)
                if hooks:
                    self._arm(True)  # only if still running
                if janitor and self._optimizer_handles and self._janitor_handle is None:
                    module = _submodule("torch.nn.modules.module")
                    self._janitor_handle = module.register_module_forward_pre_hook(self._janitor)
        except Exception as exc:
            self._fail(exc)

    @staticmethod
    def _remove(handles: List[Any]) -> None:
        for handle in handles:
            try:
                handle.remove()
            except Exception:
                pass
        handles.clear()

    def _fail(self, exc: BaseException) -> None:
        try:
            self.stop("%s: %s" % (type(exc).__name__, str(exc)[:300]))
        except Exception:
            self.running = False

    # -- module forward ---------------------------------------------------------------------------

    def _pre(self, module: Any, args: Any) -> None:
        if _compiling():
            return
        t0 = _perf_ns()
        try:
            stack = getattr(self._local, "stack", None)
            entry = self._entries.get(id(module))
            if not stack or entry is None or entry[0]() is not module or len(stack) > _MAX_STACK:
                stack, entry = self._pre_slow(module, stack, t0)  # a root call, a module not yet named
            if entry[3] and self.sampled and self.running:
                if self._plain:
                    # [module, entry, start, seq, CUDA event, children's host ns, children's spans, their backward]
                    stack.append([module, entry, _perf_ns(), next(self._seq), None, 0, None, None])
                else:
                    timer = self.timer
                    stack.append([module, entry, _perf_ns(), next(self._seq), timer.mark() if timer else None, 0,
                                  None, None])
                    if len(stack) == 1 and self.anomaly is not None:  # the batch, before any module ran
                        self.anomaly.check_inputs(args, entry[1], self.step, stack[0][3],
                                                  (t0 - self.step_start) / 1e9)
            else:
                stack.append([module, entry, 0, -1, None, 0, None, None])
        except Exception as exc:
            self._fail(exc)
        self.hook_ns += _perf_ns() - t0

    def _pre_slow(self, module: Any, stack: Optional[List[Any]], t0: int) -> Any:
        """``_pre`` for a call outside any forward on this thread (a root), or of a module not named yet."""
        if stack is None:
            stack = self._local.stack = []
        if stack:
            if len(stack) > _MAX_STACK:  # forwards that raised left their entries: start afresh
                stack.clear()
        if stack:
            outer, parent = stack[0][0], stack[-1][1]
        else:
            outer = parent = None
            if _compile_handler is None or _compile_starts not in _compile_handler.start_callbacks:
                _watch_compiles()  # before a compiled module's first call compiles it
            if not self._by_optimizer:
                self._root_begins(module, t0)
        entry = self.names.entries.get(id(module))
        if entry is None or entry[0]() is not module:
            entry = self.names.lookup(module, outer, parent)
        return stack, entry

    def _post(self, module: Any, args: Any, output: Any) -> None:
        if _compiling():
            return
        t0 = _perf_ns()
        try:
            stack = getattr(self._local, "stack", None)
            if stack:
                item = stack.pop()
                while item[0] is not module and stack:  # a forward that raised skipped its post hook
                    item = stack.pop()
                if item[0] is module:
                    if item[3] >= 0 and self.running:
                        if self._plain:  # as _forward_ends, in one frame: a frame costs, caches cold
                            start = item[2]
                            host = t0 - start
                            memory = self.memory  # a reading shared by spans that end soon after it: no call
                            m = (memory._last if memory is _cpu_memory and t0 - memory._at < memory._reuse
                                 else memory())
                            count, pack, buffer, size = self._writer
                            number = next(count)
                            pack(buffer, number % size * RECORD_BYTES, number + 1, self.step, item[3], item[1][2],
                                 FORWARD, len(stack), _ident(), start, host / 1e9, max(host - item[5], 0) / 1e9,
                                 host / 1e9, (start - self.step_start) / 1e9, m[0], m[1], m[2], m[3])
                            if stack:
                                parent = stack[-1]
                                if parent[3] >= 0:
                                    parent[5] += host
                                else:
                                    parent = _traced_parent(stack)
                                    if parent is not None:
                                        parent[5] += host
                        else:
                            self._forward_ends(item, stack, args, output, t0)
                    if not stack and self.anomaly is not None:
                        self._maybe_loss(output)
        except Exception as exc:
            self._fail(exc)
        self.hook_ns += _perf_ns() - t0

    def _forward_ends(self, item: Any, stack: List[Any], args: Any, output: Any, end: int) -> None:
        """``_post`` of a traced span where CUDA events, backward spans or the anomaly check are in play."""
        _, entry, start, seq, event, inner, children, below = item
        host = end - start
        offset = (start - self.step_start) / 1e9
        number = self.ring.add(self.step, seq, entry[2], FORWARD, len(stack), _ident(), start, host,
                               max(host - inner, 0) / 1e9, host / 1e9, offset, self.memory())
        parent = _traced_parent(stack)
        if parent is not None:
            parent[5] += host
        if event is not None and self.timer is not None:
            self.timer.pending(number, event, self.timer.mark(), children)
            if parent is not None:
                parent[6] = (parent[6] or []) + [number]
        if self.backward is not None and self.torch.is_grad_enabled():
            span = self.backward.attach(entry, len(stack), self.step, args, output, below)
            if span is not None and parent is not None:
                parent[7] = (parent[7] or []) + [span]
        if self.anomaly is not None:
            self.anomaly.check(output, entry[1], "forward", self.step, seq, offset)

    def _maybe_loss(self, output: Any) -> None:
        assert self.anomaly is not None
        self.anomaly.note_loss(output)

    def _root_begins(self, module: Any, now: int) -> None:
        """Until an optimizer steps: each call of the first top-level module begins a step."""
        first = self._first_root() if self._first_root is not None else None
        if first is None:
            self._first_root = weakref.ref(module)
        elif first is module:
            self._advance(now)

    # -- backward ---------------------------------------------------------------------------------

    def _backward_begins(self, span: Any) -> None:
        span.seq = next(self._seq)
        if self.timer is not None:
            span.event = self.timer.mark()

    def _backward_ends(self, span: Any, end: int, grads: Any) -> None:
        if not self.running:
            return
        host = end - span.start
        offset = (span.start - self.step_start) / 1e9
        number = self.ring.add(span.step, span.seq, span.entry[2], BACKWARD, span.depth, _ident(), span.start, host,
                               max(host - span.inner, 0) / 1e9, host / 1e9, offset, self.memory())
        parent = span.parent
        if parent is not None:
            parent.inner += host
        if span.event is not None and self.timer is not None:
            self.timer.pending(number, span.event, self.timer.mark(), span.children)
            if parent is not None:
                parent.children = (parent.children or []) + [number]
        if self.anomaly is not None and grads is not None:
            self.anomaly.check(grads, span.entry[1], "backward", span.step, span.seq, offset)

    # -- optimizer --------------------------------------------------------------------------------

    def _optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if _compiling():
            return
        t0 = _perf_ns()
        try:
            if self.running and self.sampled:
                timer = self.timer
                self._local.optimizer = (t0, next(self._seq), timer.mark() if timer else None)
        except Exception as exc:
            self._fail(exc)
        self.hook_ns += _perf_ns() - t0

    def _optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The optimizer's post-step hook until the append-only ones take over (and where their primary
        optimizer is gone: this names another)."""
        if _compiling():
            return
        t0 = _perf_ns()
        try:
            if self.running:
                fast = self._fast
                if fast is None:
                    started = getattr(self._local, "optimizer", None)
                    self._local.optimizer = None
                    if started is not None:
                        self._optimizer_span(optimizer, started, t0)
                primary = self._primary() if self._primary is not None else None
                if primary is None:
                    self._primary, primary = weakref.ref(optimizer), optimizer
                    if fast is not None:
                        fast.fast_optimizer(self._primary)
                if primary is optimizer:
                    stack = getattr(self._local, "stack", None)
                    if stack:
                        stack.clear()
                    self._by_optimizer = True
                    if fast is not None:  # the primary optimizer was gone: this one's step ends the step
                        now = _perf_ns()
                        fast.step_begins(now, self.memory())
                        self._step_ends(now, timed=False)  # this hook times itself
                    else:
                        self._advance(_perf_ns())
                        log = self._log
                        if log is not None and self.running:  # from now on the append-only hooks (trace_events)
                            log.activate()
                            self._fast = log
                            log.fast_optimizer(self._primary)
                            if self._module_handles:
                                self._arm(False)
                                self._arm(True)
        except Exception as exc:
            self._fail(exc)
        self.hook_ns += _perf_ns() - t0

    def module_unnamed(self) -> None:
        """The append-only hooks met a module they have not named: it may be a compiled module's wrapper
        whose first call compiles, so Dynamo's callbacks are looked at now (as ``_pre_slow`` does)."""
        if _compile_handler is None or _compile_starts not in _compile_handler.start_callbacks:
            _watch_compiles()

    def _step_ends(self, now: int, timed: bool = True) -> None:
        """``_advance`` for the append-only hooks, once their step mark is in the records (the rest is done
        at the build); ``timed``: the hook's time counted from ``now``, its clock reading, on. Dynamo's
        callbacks are looked at every 64 steps (after a ``reset()``, a compile may wait that long to hide
        the hooks)."""
        self.step += 1
        self.steps_seen += 1
        self.step_start = now
        if not self.steps_seen & 63:
            handler = _compile_handler
            if handler is None or _compile_starts not in handler.start_callbacks:
                _watch_compiles()
        every = self.options.every
        if every > 1:
            self.sampled = self.step % every == 0
            self._arm(self.sampled)
        if timed:
            self.hook_ns += _perf_ns() - now

    def _optimizer_span(self, optimizer: Any, started: Any, end: int) -> None:
        start, seq, event = started
        host = end - start
        name = self.ring.name_id(type(optimizer).__name__)
        number = self.ring.add(self.step, seq, name, OPTIMIZER, 0, _ident(), start, host, host / 1e9, host / 1e9,
                               (start - self.step_start) / 1e9, self.memory())
        if event is not None and self.timer is not None:
            self.timer.pending(number, event, self.timer.mark())

    def _advance(self, now: int) -> None:
        if _compile_handler is None or _compile_starts not in _compile_handler.start_callbacks:
            _watch_compiles()
        ended = self.step
        self.step += 1
        self.steps_seen += 1
        self.step_start = now
        self._seq = itertools.count()
        if self.timer is not None:
            self.timer.resolve(self.ring.set_device_time)
        if self.anomaly is not None:
            self.anomaly.step_ended(ended)
        log = self._log
        if log is not None and log.active:
            log.step_begins(now, self.memory())
        every = self.options.every
        self.sampled = self.step % every == 0
        if every > 1:
            self._arm(self.sampled or not self._by_optimizer)


_GLOBAL_HOOKS_WARNING = (r"Using `torch\.compile\(module\)` when there are global hooks on modules", UserWarning)


def _quiet_compiled_wrappers(quiet: bool) -> None:
    """While a trace runs, torch's warning at each call of a compiled module's wrapper that global hooks
    (the trace's) also fire for the wrapper is ignored: the trace names the wrapper as the module it wraps,
    and the warning would be the trace's doing in the job's log (and its cost at every call). One filter
    of ours, put in at start and taken out at stop; never raises."""
    try:
        message, category = _GLOBAL_HOOKS_WARNING
        ours = [f for f in warnings.filters if f[0] == "ignore" and getattr(f[1], "pattern", None) == message
                and f[2] is category]
        if quiet and not ours:
            warnings.filterwarnings("ignore", message=message, category=category)
        elif not quiet:
            for entry in ours:
                warnings.filters.remove(entry)
            getattr(warnings, "_filters_mutated", lambda: None)()  # as filterwarnings does after a change
    except Exception:
        pass


def _watch_compiles() -> None:
    """Have Dynamo call us at each compile's start and end, once the program has loaded it (never loaded
    here); again after ``torch._dynamo.reset()``, which forgets its callbacks. Never raises."""
    global _compile_handler
    try:
        handler = _compile_handler
        if handler is None:
            handler = getattr(sys.modules.get("torch._dynamo"), "callback_handler", None)
            if handler is None or not hasattr(handler, "register_start_callback"):
                return
        if _compile_starts not in handler.start_callbacks:
            handler.register_start_callback(_compile_starts)
        if _compile_ends not in handler.end_callbacks:
            handler.register_end_callback(_compile_ends)
        _compile_handler = handler
    except Exception:
        pass


def _compile_starts(*args: Any) -> None:
    tracer = _active
    if tracer is not None:
        tracer.hide(True)


def _compile_ends(*args: Any) -> None:
    tracer = _active
    if tracer is not None:
        tracer.hide(False)


def _traced_parent(stack: List[Any]) -> Optional[List[Any]]:
    """The innermost traced span still open on this thread (modules the filter skips are passed over)."""
    for item in reversed(stack):
        if item[3] >= 0:
            return item
    return None


def _submodule(name: str) -> Any:
    """A torch submodule that ``import torch`` has loaded already (so this imports nothing new)."""
    return importlib.import_module(name)
