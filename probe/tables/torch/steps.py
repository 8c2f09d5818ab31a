"""``torch.steps``: optimizer steps counted as they happen, without the trace.

Counted by probe's one global optimizer post-step hook (this module's; the agent's placement adds its
work ``--between-steps`` to it through ``after_each_step``): per optimizer, the steps seen, when the last
one ended, and the last ``RING`` step durations (the time from one step's end to the next one's: the whole iteration, data,
forward, backward, collectives and the step itself). What ``probe diagnose`` reads to tell progress and
step time per rank on every torch job.

The hook is put in once the program has imported ``torch.optim`` (probe never imports torch): the
agent's accept thread looks for it at each wake (a dict lookup), and a read of the table puts it in
too. ``PROBE_STEP_COUNTER=0`` leaves it out. Per step it costs one call of a few attribute updates
(``bench/bench_step_counter.py``); memory is bounded (``MAX_OPTIMIZERS`` counters of ``RING`` floats).
Runs in the target: stdlib only, never raises into the training loop.

The progress file: each step also goes into ``<runtime dir>/progress-<pid>.bin`` (``PROGRESS``: 64 bytes,
made on the first step, mode 0600, mapped into memory and written in place: no syscall a step; removed by
the agent at exit), which the node helper's watch (``probe.host.watch``) reads without this process's GIL.
Its step extras (the optimizer's learning rate, CUDA memory, the collective sequence number, data wait)
follow the 64 bytes, refreshed at a step at most once a second: ``probe.tables.torch.step_extras``.
"""

import os
import struct
import sys
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import probe.tables.torch.step_extras as step_extras
from probe.errors import BadRequest, ProbeError, Timeout, TorchNotLoaded
from probe.tables.spec import Column

__all__ = ["NAME", "DESCRIPTION", "COLUMNS", "EXAMPLE", "rows", "count", "steps_seen", "watch", "arm", "RING", "MAX_OPTIMIZERS",
           "PROGRESS", "Progress", "read_progress", "remove_progress", "after_each_step",
           "not_after_each_step"]

NAME = "torch.steps"
DESCRIPTION = ("Optimizer steps counted as they happen (the agent's optimizer post-step hook; no trace needed): "
               "per optimizer, steps, how long ago the last ended, and step times over the last 64 steps.")
COLUMNS = (
    Column("optimizer", "VARCHAR", "The optimizer, named as torch.optimizers names it (joins its optimizer column: "
                                   "the same search, run again at most every 30 s while one is not found); its "
                                   "optimizer_id until it is found."),
    Column("optimizer_id", "VARCHAR", "Its class name and address, e.g. SGD@0x7f3a5c0e1d90: the same for its life."),
    Column("class", "VARCHAR", "Its class, e.g. torch.optim.sgd.SGD."),
    Column("steps", "BIGINT", "Steps it made since probe began counting (see counted_for_s)."),
    Column("last_step_age_s", "DOUBLE", "Seconds since its last step ended."),
    Column("step_time_last_s", "DOUBLE", "Time from the step before the last to the last: one whole iteration "
                                         "(data, forward, backward, collectives, step); NULL before 2 steps."),
    Column("step_time_median_s", "DOUBLE", "Median of the recent step times (the last 64 at most)."),
    Column("step_time_min_s", "DOUBLE", "Shortest of the recent step times."),
    Column("step_time_max_s", "DOUBLE", "Longest of the recent step times."),
    Column("step_times", "INTEGER", "How many recent step times the three columns above rest on."),
    Column("counted_for_s", "DOUBLE", "Seconds since its first counted step."),
    Column("alive", "BOOLEAN", "Whether the optimizer object still exists (a discarded one is kept a while)."),
)
EXAMPLE = "SELECT optimizer, steps, last_step_age_s, step_time_median_s FROM torch.steps"

RING = 64
MAX_OPTIMIZERS = 32
_RETRY_S = 30.0
_TRIES = 3

_clock = time.monotonic


class _Counter:
    __slots__ = ("ref", "key", "label", "name", "cls", "steps", "first", "last", "ring", "times")

    def __init__(self, optimizer: Any, key: int, now: float) -> None:
        try:
            self.ref: Any = weakref.ref(optimizer)
        except TypeError:
            self.ref = None
        kind = type(optimizer)
        self.key = key
        self.label = "%s@0x%x" % (kind.__name__, key)
        self.name: Optional[str] = None  # torch.optimizers' name for it, once found (_name_counters)
        self.cls = "%s.%s" % (kind.__module__, kind.__qualname__)
        self.steps = 0
        self.first = now
        self.last = now
        self.ring = [0.0] * RING
        self.times = 0  # step times written to the ring, in all


_counters: Dict[int, _Counter] = {}


def count(optimizer: Any) -> None:
    """One step of ``optimizer`` has ended (called by the post-step hook on the training thread)."""
    global _total
    try:
        now = _clock()
        key = id(optimizer)
        counter = _counters.get(key)
        took = 0.0
        if counter is None or (counter.ref is not None and counter.ref() is not optimizer):
            counter = _new(optimizer, key, now)
        elif counter.steps:
            took = now - counter.last
            counter.ring[counter.times % RING] = took
            counter.times += 1
        counter.steps += 1
        counter.last = now
        _total += 1
        if _progress:
            _write_step(_progress, 16, _total, now, took)
            if now >= _extras_next:
                _extras(optimizer, now)
        elif _progress is None:
            _open_progress(optimizer, now, took)
    except BaseException:
        pass


def steps_seen(optimizer: Any) -> Optional[int]:
    """The steps of ``optimizer`` this counter has seen (since the hook went in), or None where it saw none."""
    counter = _counters.get(id(optimizer))
    if counter is None or (counter.ref is not None and counter.ref() is not optimizer):
        return None
    return counter.steps


def _new(optimizer: Any, key: int, now: float) -> _Counter:
    counter = _Counter(optimizer, key, now)
    if len(_counters) >= MAX_OPTIMIZERS:  # the one whose last step is oldest makes room
        stalest = min(list(_counters.values()), key=lambda c: c.last)
        _counters.pop(stalest.key, None)
    _counters[key] = counter
    return counter


# -- the progress file ----------------------------------------------------------------------------
#
# 64 bytes, little-endian: magic "probeprg", version (u32), pid (u32), steps of every optimizer together
# (i64), when the last step ended (f64, time.monotonic(): CLOCK_MONOTONIC, one clock for every process of
# the host), that step's time (f64, from the same optimizer's step before; 0 for its first), when the
# first step ended (f64, monotonic), the process's start time in clock ticks (u64: with the pid, which
# process wrote it), 8 bytes reserved. A step writes bytes 16-40 in place. The step extras' section
# follows (step_extras.SECTION, its own magic and version): the head stays version 1, read as before by a
# reader that knows nothing of them.

PROGRESS = struct.Struct("<8sIIqdddQ8x")
PROGRESS_MAGIC = b"probeprg"
PROGRESS_VERSION = 1
_write_step = struct.Struct("<qdd").pack_into
_total = 0
_progress: Any = None  # the mapped file; None before the first step; False where there is none (cannot be, off)
_extras_next = float("inf")  # when the step extras are refreshed next (at a step): never until the file has them


class Progress(NamedTuple):
    """What a progress file says (``read_progress``)."""

    pid: int
    steps: int
    last: float  # time.monotonic() of the last step's end
    step_time: float  # that step's time (0: not known)
    first: float  # time.monotonic() of the first step's end
    start_ticks: int


def _open_progress(optimizer: Any, now: float, took: float) -> None:
    """Make this process's progress file (on its first step; once: a failure leaves it off)."""
    global _progress
    _progress = False
    import mmap

    from probe import _paths

    pid = os.getpid()
    try:
        ticks = _paths.process_start_ticks()
    except (OSError, ValueError):
        ticks = 0
    path = _paths.progress_path(pid)
    extras = step_extras.wanted()
    size = step_extras.OFFSET + step_extras.SECTION.size if extras else PROGRESS.size
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        mapped = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    PROGRESS.pack_into(mapped, 0, PROGRESS_MAGIC, PROGRESS_VERSION, pid, _total, now, took, now, ticks)
    _progress = mapped
    _where[0], _where[1] = path, pid
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_forget_progress)
    if extras:
        _extras(optimizer, now)


def _extras(optimizer: Any, now: float) -> None:
    """Refresh the step extras (a step's end, at most every ``step_extras.EVERY_S``; PROBE_STEP_EXTRAS=0: never)."""
    global _extras_next
    _extras_next = now + step_extras.EVERY_S
    step_extras.refresh(_progress, optimizer, _total, now, _steps_now)


def _steps_now() -> int:
    return _total


_where: List[Any] = [None, 0]  # the file's path and the pid that made it


def _forget_progress() -> None:
    """In a forked child (a DataLoader worker): the parent's file is not ours to write."""
    global _progress
    _progress = False


def remove_progress() -> None:
    """At the agent's exit: no more writes, and the file goes (only in the process that made it)."""
    global _progress
    mapped, _progress = _progress, False
    path, pid = _where
    if not path or pid != os.getpid():
        return
    _where[0] = None
    try:
        os.unlink(path)
    except OSError:
        pass
    if mapped:
        try:
            mapped.close()
        except (BufferError, ValueError, OSError):
            pass


def read_progress(path: str) -> Optional[Progress]:
    """The progress file at ``path``; None where it is missing, short, or not one (its magic and version)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        raw = os.pread(fd, PROGRESS.size, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) < PROGRESS.size:
        return None
    magic, version, pid, steps, last, took, first, ticks = PROGRESS.unpack(raw)
    if magic != PROGRESS_MAGIC or version != PROGRESS_VERSION:
        return None
    return Progress(pid, steps, last, took, first, ticks)


# -- putting the hook in ----------------------------------------------------------------------------

_state = {"installed": False, "busy": False, "tries": 0, "next": 0.0, "why": ""}
_install_lock = threading.Lock()


def _wanted() -> bool:
    return os.environ.get("PROBE_STEP_COUNTER", "1").strip().lower() not in ("0", "false", "no", "off")


def watch() -> None:
    """The accept thread's check (every wake): once ``torch.optim`` is loaded, put the hook in, on a
    thread of its own (it may wait for a step to end). A dict lookup otherwise; never raises."""
    try:
        if _state["installed"] or _state["busy"] or "torch.optim.optimizer" not in sys.modules:
            return
        if _state["tries"] >= _TRIES or _clock() < _state["next"] or not _wanted():
            return
        from probe._threads import daemon_thread

        _state["busy"] = True
        daemon_thread(_arm_quietly, "probe-steps").start()
    except BaseException:
        _state["busy"] = False


def _arm_quietly() -> None:
    try:
        arm()
    except BaseException:
        pass
    finally:
        _state["busy"] = False


def arm() -> None:
    """Put the hook in now, if not yet: raises (a ProbeError) when it cannot be."""
    with _install_lock:
        if _state["installed"]:
            return
        if not _wanted():
            raise ProbeError("the step counter is off in this process (PROBE_STEP_COUNTER=0)")
        if "torch.optim.optimizer" not in sys.modules:
            raise TorchNotLoaded("torch.optim is not loaded in the target: it has no optimizer, so no step to count",
                                 hint="torch.steps answers once the program has imported torch")
        _state["tries"] += 1
        _state["next"] = _clock() + _RETRY_S
        try:
            install_step_hook()
        except ProbeError as exc:
            _state["why"] = exc.message
            raise
        _state["installed"] = True


def installed() -> bool:
    return bool(_state["installed"])


# -- the table ----------------------------------------------------------------------------------------


def rows() -> List[Tuple[Any, ...]]:
    if "torch" not in sys.modules:
        raise TorchNotLoaded("torch is not loaded in the target (it has not imported torch, and probe never "
                             "imports it)", hint="torch.* tables answer once the program has run `import torch`")
    arm()
    _name_counters()
    now = _clock()
    out = []
    for counter in sorted(list(_counters.values()), key=lambda c: c.last, reverse=True):
        out.append(_row(counter, now))
    return out


_naming = {"next": 0.0}


def _name_counters() -> None:
    """Name the counters as torch.optimizers does (its search: probe.watch, __main__, the main thread's frames,
    the garbage collector), so that the tables join on ``optimizer``; a table read, never the hook. Once a
    counter is named its name stays; while a live one is not, the search runs again at most every _RETRY_S."""
    unnamed = [c for c in list(_counters.values()) if c.name is None and c.ref is not None and c.ref() is not None]
    if not unnamed or _clock() < _naming["next"]:
        return
    _naming["next"] = _clock() + _RETRY_S
    try:
        from probe.tables.torch.discovery import find_optimizers

        found = {id(o): (n, o) for n, o in find_optimizers(sys.modules["torch"])}
    except Exception:  # the search's surprise leaves the counters with their ids
        return
    for counter in unnamed:
        name, optimizer = found.get(counter.key, (None, None))
        if name is not None and counter.ref() is optimizer:
            counter.name = name


def _row(counter: _Counter, now: float) -> Tuple[Any, ...]:
    times, seen = counter.times, min(counter.times, RING)
    recent = sorted(counter.ring[:seen]) if seen else []
    last: Optional[float] = counter.ring[(times - 1) % RING] if times else None
    median: Optional[float] = None
    if recent:
        mid = len(recent) // 2
        median = recent[mid] if len(recent) % 2 else (recent[mid - 1] + recent[mid]) / 2
    alive = True if counter.ref is None else counter.ref() is not None
    return (counter.name or counter.label, counter.label, counter.cls, counter.steps, now - counter.last, last, median,
            recent[0] if recent else None, recent[-1] if recent else None, seen, now - counter.first, alive)


# -- the one global optimizer post-step hook ----------------------------------------------------------

_hook_lock = threading.Lock()
_step_hook_installed = False
_then: Tuple[Callable[[], None], ...] = ()  # what else runs right after a step (replaced whole, never changed)
_then_by: Dict[str, Callable[[], None]] = {}  # the same by who asked: placement's --between-steps, a profile


def after_each_step(then: Callable[[], None], key: str = "placement") -> None:
    """Have the post-step hook call ``then()`` after counting each step, on the thread that ended it (the
    agent's placement runs its snippets ``--between-steps`` so; a profile starts and stops there); ``then``
    must be cheap and never raise. One callable per ``key``, replaced by the next one of that key.
    The counter knows nothing of what ``then`` does: the import runs from the agent to here only."""
    global _then
    with _hook_lock:
        _then_by[key] = then
        _then = tuple(_then_by.values())


def not_after_each_step(key: str) -> None:
    """Take ``key``'s callable out: from the next step the hook no longer calls it (a finished profile)."""
    global _then
    with _hook_lock:
        if _then_by.pop(key, None) is not None:
            _then = tuple(_then_by.values())


def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """torch's global optimizer post-step hook: counts the step (``torch.steps``), then runs what waits for
    one, if anything does (``after_each_step``); nearly free otherwise."""
    count(optimizer)
    for then in _then:
        then()


def install_step_hook() -> None:
    """Register ``_after_step`` once per process, never importing torch: for the step counter, which puts
    it in as soon as torch is loaded, and for snippets ``--between-steps`` (``probe.agent.placement``).

    The hook stays: removing it from the training thread's hook dict while that thread may be
    iterating it would raise there. Adding it is safe while no global post-step hook exists (torch
    iterates that dict only inside one C-level ``next()`` then); where others exist it waits until no
    thread is inside an optimizer step.
    """
    global _step_hook_installed
    if _step_hook_installed:
        return
    module = sys.modules.get("torch.optim.optimizer")
    register = getattr(module, "register_optimizer_step_post_hook", None)
    if module is None:
        raise BadRequest("torch's optimizers are not loaded in this process, so there is no optimizer step to "
                         "wait for", hint="run the snippet without --between-steps")
    if register is None:
        raise BadRequest("this torch has no global optimizer hooks (torch 2.0 or later has them)",
                         hint="run the snippet with --on main, or concurrently")
    if getattr(module, "_global_optimizer_post_hooks", None):
        _wait_until_no_step(module)
    with _hook_lock:
        if not _step_hook_installed:
            register(_after_step)
            _step_hook_installed = True


def _wait_until_no_step(module: Any, limit: float = 5.0) -> None:
    import time

    filename = getattr(module, "__file__", None)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if not _any_thread_in_step(filename):
            return
        time.sleep(0.002)
    raise Timeout("a thread stayed inside an optimizer step for %.0f s; the hook was not installed" % limit,
                  hint="run the snippet with --on main, or concurrently")


def _any_thread_in_step(filename: Any) -> bool:
    """Whether a thread runs torch's step wrapper: frames read as python.backtrace reads them."""
    import gc

    enabled = gc.isenabled()
    if enabled:
        gc.disable()
    try:
        current = sys._current_frames()
        current.pop(threading.get_ident(), None)
        found = False
        frame: Any
        for frame in current.values():
            while frame is not None and not found:
                found = frame.f_code.co_filename == filename and frame.f_code.co_name == "wrapper"
                frame = frame.f_back
        current.clear()
        return found
    finally:
        if enabled:
            gc.enable()
