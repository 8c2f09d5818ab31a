"""The trace's hooks for training steps on the host: each appends a record of a few items to its thread's
list (a module and a clock reading, nothing more); the spans are built from those records later, many
steps at a time, in one loop.

Why: the hooks run right after a step's matmuls (or its backward, or the optimizer's pass over every
parameter), which have flushed the caches (and, on a nested VM, the TLB): there every object a hook
touches costs a miss, ~1-2 us each here. Building a span in a hook (naming, a record, a memory reading)
touched dozens, 5-8 us a module call, and building one step's spans in one go right after its backward
cost ~3.5 us a span for the same reason. Appending to a list touches the list and the clock (~0.3-1 us
a call); a build of thousands of records touches the same few modules, names and ring lines again and
again, and runs warm (~0.5 us a span).

Records (each appended in one ``list += tuple``: one C call, so a reader never sees half of one). They
keep no module or optimizer alive (a model the program drops is freed while records of it wait):

* ``(entry, clock)``: a module call begins; ``entry`` is the module's name entry (``trace_names``: it
  holds the module weakly), or, for a module not named yet, the module itself, and the hook then builds
  the records at once, which names it (and its tree: once per new model);
* ``(clock, id)``: a call ends (``id(module)``; a call whose forward raised has none: the build passes
  over it);
* ``(clock, OPTIMIZER_BEGINS)`` and ``(clock, OPTIMIZER_ENDS, its class)``: an optimizer's step;
* ``(clock, STEP_BEGINS, memory)``: the primary optimizer finished a step; appended to every thread's
  list, so each list says which step its records belong to. ``memory`` is the reading its spans get
  (on the host, RSS: one a step at most, shared as ``CpuMemory`` shares readings).

Who builds: whoever reads the table (its spans are then current: a step in progress, or one that hangs,
shows the spans it has completed), ``trace stop`` and ``trace status``. The training thread does not
build: a span costs ~1 us to build, and spans that no one reads before the ring would overwrite them
need never be built. When a thread's list reaches its limit (``limit_for``: room for the ring's worth of
spans, and more), its hook drops the oldest whole steps, down to about half, unbuilt (~1 ms every few
thousand spans): a read then builds the newest, which are what the ring would hold anyway. Only a list
with no step mark to cut at (a forward longer than the limit, or no optimizer stepping) is built there
instead, and so are the records when a hook meets a module not named yet (see above). A lock keeps two
builds (or a build and a cut) apart; a hook never waits for it.
"""

import itertools
import os
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

from probe.tables.torch.trace_ring import FORWARD, OPTIMIZER, RECORD_BYTES

__all__ = ["EventLog", "FLUSH_AT", "APPEND_NS", "limit_for"]

FLUSH_AT = 8192  # items in a thread's list, at least, before its hook cuts (or builds) it (~2000 module calls)
APPEND_NS = 600  # a hook call's estimated cost right after a matmul (0.3-1.2 us measured: bench_trace)
_MAX_OPEN = 10_000  # open calls on one thread: more means forwards raised and left theirs (start afresh)


def limit_for(size: int) -> int:
    """Items a thread's list may reach before its hook cuts it: a span is 4 items (its begin and end), so
    a cut to about half still holds the ring's ``size`` spans, with room for the steps' own records (at
    most ~2.5 MB a thread for the default 10000 spans: the list, and the clock readings it holds)."""
    return max(FLUSH_AT, 10 * size)


class _Marker:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


OPTIMIZER_BEGINS, OPTIMIZER_ENDS, STEP_BEGINS = _Marker("optimizer begins"), _Marker("optimizer ends"), _Marker("step")


class _Thread:
    """One thread's records, and where its build stands: the step its next records belong to, the calls
    still open, the optimizer step begun."""

    __slots__ = ("events", "ident", "open", "step", "step_start", "seq", "memory", "optimizer_start")

    def __init__(self, ident: int, step: int, step_start: int, memory: Any) -> None:
        self.events: List[Any] = []
        self.ident = ident
        self.open: List[List[Any]] = []  # [module id, entry, start ns, seq (-1: filtered out), children's host ns]
        self.step, self.step_start, self.memory = step, step_start, memory
        self.seq = itertools.count()
        self.optimizer_start: Optional[Tuple[int, int]] = None  # (clock, seq)


class EventLog:
    """The append-only hooks of one trace (``pre`` and ``post`` for modules, the ``optimizer_*`` and
    ``step_begins`` calls for the tracer's optimizer hooks) and ``flush``, which builds their spans into
    ``tracer.ring``. Inactive (``active`` False) until the tracer switches to it."""

    def __init__(self, tracer: Any, compiling: Callable[[], bool]) -> None:
        self._tracer = tracer
        self._names = tracer.names.entries  # cleared in place, never replaced
        self._compiling = compiling
        self._local = threading.local()
        self._threads: Dict[int, _Thread] = {}
        self._lists: List[List[Any]] = []  # each thread's ``events``, for the step marks (as ``_threads``)
        self._lock = threading.Lock()  # builds and cuts, and the list of threads
        # the step marks' memory reading, and the clock until which it serves them (0 in a child just forked:
        # it reads its own at its next step)
        self._memory: Any = _last_reading(tracer.memory)
        self._fresh_until = 0
        self.active = False
        self.calls = 0  # module hook calls built or cut so far (the hooks do not time themselves: see APPEND_NS)
        self.spans_cut = 0  # spans whose records a cut dropped before any read (about: 4 items a span)
        self.steps_cut = 0
        self.pre, self.post = self._hooks(compiling)
        self.fast_optimizer: Callable[[Any], None] = lambda reference: None  # see optimizer_hooks
        _logs.add(self)

    def activate(self) -> None:
        """From now on the records say which step they belong to (a thread's first records: the tracer's)."""
        self.active = True

    def _hooks(self, compiling: Callable[[], bool]) -> Tuple[Callable[..., None], Callable[..., None]]:
        local, clock, mine, named = self._local, time.perf_counter_ns, self._mine, self._names.get
        limit, unnamed = limit_for(self._tracer.ring.size), self._tracer.module_unnamed

        def full() -> None:
            self.cut()

        def first_call() -> None:
            """A module not named yet (a new model, a compiled module's wrapper about to compile): Dynamo's
            callbacks looked at, and the records built now, which names it and its tree, so that no
            record holds the module itself for longer than this (once per new tree)."""
            unnamed()
            self.flush(wait=0)

        def pre(module: Any, args: Any) -> None:
            if compiling():  # Dynamo folds this to True: a hook it traces is empty (see trace_hooks)
                return
            try:
                try:
                    events = local.events
                except AttributeError:
                    events = mine()
                entry = named(id(module))  # a live module's entry is its own (trace_names)
                if entry is None:
                    events += (module, clock())
                    first_call()
                else:
                    events += (entry, clock())
                if len(events) >= limit:
                    full()
            except Exception as exc:
                self._tracer._fail(exc)

        def post(module: Any, args: Any, output: Any) -> None:
            if compiling():
                return
            try:
                try:
                    events = local.events
                except AttributeError:
                    return  # no pre hook ran on this thread: no call of it is open
                events += (clock(), id(module))
            except Exception as exc:
                self._tracer._fail(exc)

        return pre, post

    def _here(self) -> List[Any]:
        """This thread's list (the module hooks inline this: a call there costs what they save)."""
        try:
            return self._local.events  # type: ignore[no-any-return]
        except AttributeError:
            return self._mine()

    def _mine(self) -> List[Any]:
        """This thread's list, made at its first record (no lock: a dict store is one step under the GIL)."""
        ident = threading.get_ident()
        thread = self._threads.get(ident)
        if thread is None:
            tracer = self._tracer
            thread = _Thread(ident, tracer.step, tracer.step_start, _last_reading(tracer.memory))
            self._threads[ident] = thread
            self._lists = self._lists + [thread.events]  # a new list: a step mark may be iterating the old
        self._local.events = thread.events
        return thread.events

    def optimizer_hooks(self, slow_pre: Callable[..., Any], slow_post: Callable[..., Any],
                        step_ends: Callable[[int], None]) -> Tuple[Callable[..., None], Callable[..., None]]:
        """The trace's optimizer step pre and post hooks: the tracer's own (``slow_*``) until ``fast_optimizer``
        names the primary optimizer, then a record each, and ``step_ends(now)`` after the primary's step.
        Closures, so that right after the optimizer's pass over every parameter they touch little."""
        clock, here, compiling, tracer, log = time.perf_counter_ns, self._here, self._compiling, self._tracer, self
        on = False
        primary: Any = None  # weak reference to the optimizer whose steps count

        def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
            if compiling():
                return
            if not on:
                slow_pre(optimizer, args, kwargs)
                return
            try:
                events = here()
                events += (clock(), OPTIMIZER_BEGINS)
            except Exception as exc:
                tracer._fail(exc)

        def post(optimizer: Any, args: Any, kwargs: Any) -> None:
            if compiling():
                return
            if not on:
                slow_post(optimizer, args, kwargs)
                return
            try:
                now = clock()
                events = here()
                events += (now, OPTIMIZER_ENDS, type(optimizer))
                first = primary()
                if optimizer is first:  # the step mark, here: a step's end touches as little as it can
                    if now >= log._fresh_until:
                        log._memory, log._fresh_until = _fresh_reading(tracer.memory, now)
                    mark = (now, STEP_BEGINS, log._memory)
                    for each in log._lists:
                        each += mark
                    step_ends(now)
                    return
                if first is not None:
                    return
            except Exception as exc:
                tracer._fail(exc)
                return
            slow_post(optimizer, args, kwargs)  # the primary optimizer is gone: the tracer names another

        def fast_optimizer(reference: Any) -> None:
            nonlocal on, primary
            primary, on = reference, reference is not None

        self.fast_optimizer = fast_optimizer
        return pre, post

    def step_begins(self, now: int, memory: Any) -> None:
        """A step begins at ``now`` (the tracer's, before its hooks append): a mark in every thread's list."""
        mark = (now, STEP_BEGINS, memory)
        for events in self._lists:
            events += mark

    def flush(self, wait: float = 1.0) -> bool:
        """Build the spans of every thread's records so far (any thread may call it; a failure switches the
        trace off, as a hook's would). Waits at most ``wait`` seconds for a build under way (one holds the
        lock for a few ms; a signal handler that interrupted one on its own thread would wait for ever);
        False if it did not build."""
        tracer = self._tracer
        started = time.perf_counter_ns()
        if not self._lock.acquire(timeout=wait) if wait > 0 else not self._lock.acquire(False):
            return False
        built = False
        try:
            half = limit_for(tracer.ring.size) // 2
            for thread in list(self._threads.values()):
                if len(thread.events) > half:
                    self._cut(thread, half)  # what the ring could not hold is not built
                built = self._build_all(thread) or built
            self._drop_ended()
        except Exception as exc:
            tracer._fail(exc)
        finally:
            self._lock.release()
        if built:  # the trace's time (a read that finds nothing to build is the reader's)
            tracer.hook_ns += time.perf_counter_ns() - started
        return True

    def cut(self) -> None:
        """A hook's list is full: each full list loses its oldest whole steps, unbuilt (see the module's
        docstring), down to about half, or, with no step mark in its second half to cut at, is built.
        Never waits: while a reader builds, the records are being consumed."""
        tracer = self._tracer
        started = time.perf_counter_ns()
        if not self._lock.acquire(False):
            return
        try:
            limit = limit_for(tracer.ring.size)
            for thread in list(self._threads.values()):
                if len(thread.events) >= limit and not self._cut(thread, limit // 2):
                    self._build_all(thread)
            self._drop_ended()
        except Exception as exc:
            tracer._fail(exc)
        finally:
            self._lock.release()
        tracer.hook_ns += time.perf_counter_ns() - started

    def _drop_ended(self) -> None:
        """Build what threads that have ended left, and forget their lists (the lock held): their id may be
        given to a new thread, and the step marks would go on growing them."""
        if len(self._threads) > 1:
            alive = {t.ident for t in threading.enumerate()}
            for ident in [i for i in self._threads if i not in alive]:
                self._build_all(self._threads.pop(ident))
            self._lists = [t.events for t in self._threads.values()]

    def _cut(self, thread: _Thread, keep: int) -> bool:
        """Drop ``thread``'s records before the first step mark among its last ``keep`` items; False if there
        is none (or the search failed: a module left unnamed with an ``__eq__`` that raises)."""
        events = thread.events
        try:
            # the mark's record: (clock, STEP_BEGINS, memory)
            at = events.index(STEP_BEGINS, max(len(events) - keep, 0)) - 1
            dropped = events[:at]
            steps = dropped.count(STEP_BEGINS)
        except Exception:
            return False
        if at <= 0:
            return False
        del events[:at]
        thread.step += steps  # the mark now first begins the step after them; it clears what was open
        items = len(dropped) - 3 * steps
        self.steps_cut += steps
        self.spans_cut += items // 4
        self.calls += items // 2
        return True

    def _build_all(self, thread: _Thread) -> bool:
        """Build the records ``thread`` holds now (the lock held); whether there were any."""
        events = thread.events
        n = len(events)  # records are whole (one extend each); the owner may add more
        if not n:
            return False
        items = events[:n]
        del events[:n]
        self._build(thread, items)
        return True

    def _build(self, thread: _Thread, items: List[Any]) -> None:
        tracer = self._tracer
        names, ring = tracer.names, tracer.ring
        count, pack, buffer, size = ring.writer()
        every = tracer.options.every  # a step it skips has no optimizer span (its module hooks are out)
        step, step_start, memory, seq = thread.step, thread.step_start, thread.memory, thread.seq
        m0, m1, m2, m3 = memory if memory is not None else _NO_MEMORY
        ident, stack = thread.ident, thread.open
        calls = 0
        k, n = 0, len(items)
        while k < n:
            first, second = items[k], items[k + 1]
            k += 2
            if first.__class__ is not int:  # a call begins: (its module's entry, or the module, clock)
                calls += 1
                if first.__class__ is tuple:
                    entry = first
                else:  # not named when the hook ran: named now, below the calls open
                    if len(stack) > _MAX_OPEN:
                        stack.clear()
                    entry = names.lookup(first, stack[0][1][0]() if stack else None, stack[-1][1] if stack else None)
                stack.append([entry[4], entry, second, next(seq) if entry[3] else -1, 0])
                continue
            if second.__class__ is not int:
                if second is STEP_BEGINS:
                    step, step_start, memory = step + 1, first, items[k]
                    m0, m1, m2, m3 = memory if memory is not None else _NO_MEMORY
                    seq = itertools.count()
                    stack.clear()
                    thread.optimizer_start = None
                    k += 1
                elif second is OPTIMIZER_BEGINS:
                    calls += 1
                    thread.optimizer_start = (first, next(seq)) if step % every == 0 else None
                else:  # OPTIMIZER_ENDS
                    calls += 1
                    begun, thread.optimizer_start = thread.optimizer_start, None
                    kind = items[k]  # the optimizer's class (a record keeps no optimizer alive)
                    k += 1
                    if begun is not None:
                        start, number_in_step = begun
                        host = first - start
                        number = next(count)
                        pack(buffer, number % size * RECORD_BYTES, number + 1, step, number_in_step,
                             ring.name_id(kind.__name__), OPTIMIZER, 0, ident, start, host / 1e9,
                             host / 1e9, host / 1e9, (start - step_start) / 1e9, m0, m1, m2, m3)
                continue
            calls += 1  # a call ends: (clock, its module's id)
            if not stack:
                continue
            item = stack.pop()
            while item[0] != second and stack:  # a forward that raised skipped its post hook
                item = stack.pop()
            if item[0] != second or item[3] < 0:  # a filtered-out call's own time is its traced caller's
                continue
            start = item[2]
            host = first - start
            number = next(count)
            pack(buffer, number % size * RECORD_BYTES, number + 1, step, item[3], item[1][2], FORWARD, len(stack),
                 ident, start, host / 1e9, max(host - item[4], 0) / 1e9, host / 1e9, (start - step_start) / 1e9,
                 m0, m1, m2, m3)
            if stack:  # the child's time, to the innermost traced call still open
                outer = stack[-1]
                if outer[3] < 0:
                    outer = next((o for o in reversed(stack) if o[3] >= 0), outer)
                if outer[3] >= 0:
                    outer[4] += host
        thread.step, thread.step_start, thread.memory, thread.seq = step, step_start, memory, seq
        self.calls += calls


_NO_MEMORY = (float("nan"),) * 4


def _fresh_reading(reading: Any, now: int) -> Tuple[Any, int]:
    """A memory reading for the step marks, and until when it serves them: ``CpuMemory.fresh`` (a reading
    shared for as long as its cost allows), else a reading each step."""
    fresh = getattr(reading, "fresh", None)
    return fresh(now) if fresh is not None else (reading(), now)


def _last_reading(reading: Any) -> Any:
    """The reading a new thread's first records get: the last one made, if the reader keeps it."""
    return getattr(reading, "last", None)


_logs: "weakref.WeakSet[EventLog]" = weakref.WeakSet()


def _forked() -> None:
    """In a child just forked (a DataLoader worker, multiprocessing): a build that another thread of the
    parent had under way holds a lock no thread of the child will release; each log gets a new one (else
    the child's hooks could never cut or build, and their records would grow without end). Its step
    marks take a memory reading of the child's own at its next step, not the parent's last."""
    for log in list(_logs):
        log._lock = threading.Lock()
        log._fresh_until = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)
