"""Where a snippet runs: the agent's own thread, the main thread, or the thread that just ended a
training step.

* ``agent`` (the default): a fresh daemon thread, concurrent with the program: the program's state may
  change while the snippet reads it.
* ``main``: the main thread, at its next bytecode boundary, through a pending call
  (``Py_AddPendingCall``, the same call the injector makes from outside). The main thread waits while
  the snippet runs, so a long read is never torn by it; it may still have stopped in the middle of a
  Python-level update. A main thread blocked in C never reaches a boundary: after ``wait`` seconds the
  request gives up and the snippet will never run, even if the pending call fires later.
* ``step``: on the thread that ran an optimizer step, right after it (torch's global
  ``register_optimizer_step_post_hook``), only where the target itself has imported torch.

A snippet that runs past its time limit, or that its client interrupts, gets ``EvalInterrupted`` at
its next bytecode boundary (``PyThreadState_SetAsyncExc``). On the program's own threads that
exception must never escape the snippet: it is sent at most once, only while the snippet runs, under a
lock, and taken back (``SetAsyncExc(ident, NULL)``) by the same lock when the snippet ends first; one
that lands in our frames after the snippet is caught there. Runs in the target; stdlib only, 3.9+.
"""

import sys
import threading
from typing import Any, Callable, Dict, List, Optional

from probe.errors import BadRequest, Busy
from probe._threads import daemon_thread
from probe.tables.torch import steps as _steps
from probe.tables.torch.steps import after_each_step, install_step_hook

__all__ = ["Job", "PLACES", "submit", "interrupt", "interrupt_and_settle", "EvalInterrupted"]

PLACES = ("agent", "main", "step")
_MAX_JOBS = 64  # jobs waiting or running at once, all places together

_lock = threading.Lock()
_jobs: Dict[str, "Job"] = {}  # by client-given id, while waiting or running
# Ids that ended, and ids interrupted before their snippet arrived (a client's Ctrl-C can overtake its
# eval): the last _REMEMBERED of each, oldest first, so that such a snippet is dropped as it arrives.
_REMEMBERED = 256
_ended_ids: Dict[str, None] = {}
_cancelled_ids: Dict[str, None] = {}
_main_queue: List["Job"] = []
_after_step = _steps._after_step  # the post-step hook itself (bench/bench_step_counter.py times it here)
_step_queue: List["Job"] = []
_pending_queued = False  # one pending call of ours at most sits in the interpreter's small queue
_callback: Any = None  # the C thunk the interpreter calls; kept forever (it may fire long after a request)


class EvalInterrupted(BaseException):
    """Raised inside a snippet that ran past its time limit or that its client interrupted."""


class Job:
    """One snippet on its way to the thread that runs it, and back."""

    def __init__(self, body: Callable[["Job"], None], job_id: Optional[str] = None) -> None:
        self.body = body
        self.id = job_id
        self.state = "waiting"  # -> running -> done, or waiting -> abandoned
        self.ident = 0
        self.why_interrupted: Optional[str] = None
        self.started = threading.Event()
        self.finished = threading.Event()

    # -- on the thread that runs it ---------------------------------------------------------------

    def run_here(self) -> None:
        """Run the body on this thread, unless the requester gave up; never raises."""
        with _lock:
            if self.state != "waiting":
                return
            self.state, self.ident = "running", threading.get_ident()
        self.started.set()
        try:
            try:
                self.body(self)
            finally:
                self._finish()
        except BaseException:  # EvalInterrupted landing after the snippet's own frames: it was for the snippet
            self._finish()

    def _finish(self) -> None:
        consume = False
        with _lock:
            if self.state == "running":
                self.state = "done"
                consume = self.why_interrupted is not None
                if self.id is not None:
                    _jobs.pop(self.id, None)
                    _remember(_ended_ids, self.id)
        if consume:
            _consume_pending_interrupt()
        self.finished.set()

    # -- from other threads -----------------------------------------------------------------------

    def interrupt(self, why: str) -> str:
        """Stop the snippet: ``"cancelled"`` before it started, ``"interrupted"``, or ``"finished"``."""
        with _lock:
            if self.state == "waiting":
                self._abandon_locked()
                return "cancelled"
            if self.state != "running":
                return "finished"
            if self.why_interrupted is None:
                self.why_interrupted = why
                _set_async_exc(self.ident, EvalInterrupted)
            return "interrupted"

    def abandon_if_waiting(self) -> bool:
        """The requester gives up on a job that never started: it will never run. True if so."""
        with _lock:
            if self.state != "waiting":
                return False
            self._abandon_locked()
            return True

    def _abandon_locked(self) -> None:
        self.state = "abandoned"
        for queue in (_main_queue, _step_queue):
            if self in queue:
                queue.remove(self)
        if self.id is not None:
            _jobs.pop(self.id, None)
        self.started.set()  # wakes the requester, which finds it abandoned
        self.finished.set()


def _remember(ids: Dict[str, None], job_id: str) -> None:
    """Called with ``_lock`` held."""
    ids[job_id] = None
    while len(ids) > _REMEMBERED:
        ids.pop(next(iter(ids)))


class _Consumed(BaseException):
    """Sent by a thread to itself to take its own pending interrupt (see ``_consume_pending_interrupt``)."""


def _consume_pending_interrupt() -> None:
    """Called on the snippet's thread after an interrupted snippet ended: make sure no interrupt is left
    pending, here or in the interpreter.

    An interrupt may not have landed yet (the snippet ended first). Taking it back with
    ``SetAsyncExc(ident, NULL)`` is not enough before Python 3.12: that call raises the interpreter-wide
    "asynchronous exception pending" flag even for NULL, and only a thread that then receives an exception
    lowers it. Left raised, every thread of the target checks for pending work at every loop and call from
    then on; with a trace function on (a debugger, coverage), a thread then loops for ever at a function's
    first line holding the GIL (seen after ``probe T debug`` and one snippet that ran past its limit: SQL,
    backtraces and the program's own threads stuck). So the thread replaces whatever is pending with an
    exception of its own and receives it at once, here, which lowers the flag."""
    try:
        _set_async_exc(threading.get_ident(), _Consumed)
        for _ in range(100000):  # the exception lands at the first check, long before the end
            pass
    except (_Consumed, EvalInterrupted):
        pass


def _set_async_exc(ident: int, exc: Any) -> None:
    try:
        import ctypes

        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc) if exc else None)
    except Exception:
        pass


def submit(job: Job, place: str) -> None:
    """Hand ``job`` to the thread of ``place``; errors say why it cannot go there."""
    with _lock:
        if len(_jobs) >= _MAX_JOBS:
            raise Busy("%d snippets are waiting or running in this process" % len(_jobs),
                       hint="interrupt them or wait for them to finish")
        if job.id is not None:
            if job.id in _jobs:
                raise BadRequest("a snippet with id %r is already waiting or running" % job.id)
            if job.id in _cancelled_ids:  # its interrupt came first: it never runs
                del _cancelled_ids[job.id]
                job.state = "abandoned"
                job.started.set()
                job.finished.set()
                return
            _jobs[job.id] = job
    try:
        if place == "agent":
            daemon_thread(job.run_here, "probe-eval").start()
        elif place == "main":
            _to_main(job)
        elif place == "step":
            _to_step(job)
        else:
            raise BadRequest("a snippet runs on one of %s, not %r" % (", ".join(PLACES), place))
    except BaseException:
        job.abandon_if_waiting()
        raise


def run_between_steps(work: Callable[[threading.Event], Any], timeout: float,
                      step_wait: float = 2.0) -> "tuple[Any, str]":
    """Run ``work(cancel)`` on the training thread right after the next optimizer step, waiting at most
    ``step_wait`` for that step and ``timeout`` for the work: (its result, "") or (None, why it did not
    run). Past ``timeout`` ``cancel`` is set (work checks it) and ``Timeout`` raised. Its own errors are
    raised here, never in the training loop."""
    from probe.errors import ProbeError, Timeout

    cancel = threading.Event()
    result: Dict[str, Any] = {}

    def body(job: Job) -> None:
        try:
            result["value"] = work(cancel)
        except BaseException as exc:  # for the requester below; never into the training loop
            result["error"] = exc

    job = Job(body)
    try:
        submit(job, "step")
    except ProbeError as exc:
        return None, exc.message
    no_step = "no optimizer step came within %.0f s (the job is not progressing)" % step_wait
    if not job.started.wait(step_wait) and job.abandon_if_waiting():
        return None, no_step
    if not job.finished.wait(timeout):
        cancel.set()
        job.finished.wait(2.0)
        raise Timeout("it did not finish within %.0f s and was stopped" % timeout)
    if job.state == "abandoned":
        return None, no_step
    if "error" in result:
        raise result["error"]
    return result.get("value"), ""


def interrupt(job_id: str) -> str:
    """Interrupt the snippet sent with ``job_id``: ``interrupted``, ``finished``, or ``cancelled``: not
    started (or not arrived yet: the interrupt can overtake its snippet, which is then dropped as it
    arrives)."""
    with _lock:
        job = _jobs.get(job_id)
        if job is None:
            if job_id in _ended_ids:
                return "finished"
            _remember(_cancelled_ids, job_id)
            return "cancelled"
    return job.interrupt("it was interrupted at the client's request (Ctrl-C)")


def interrupt_and_settle(job_id: str, settle_s: float = 0.5) -> Dict[str, Any]:
    """Interrupt as :func:`interrupt`, then wait up to ``settle_s`` for the snippet to end, so the answer
    says what is true: ``interrupted`` (it ended), or ``stopping`` with ``where`` (the innermost Python
    line of its thread) when it is inside a call into C, which the interrupt cannot enter: it lands when
    that call returns to Python, and what the call does (a ``torch.save``) completes first."""
    with _lock:
        job = _jobs.get(job_id)
    state = interrupt(job_id)
    if state != "interrupted" or job is None:
        return {"state": state}
    if job.finished.wait(max(0.0, settle_s)):
        return {"state": "interrupted"}
    return {"state": "stopping", "where": _where(job.ident)}


def _where(ident: Optional[int]) -> Optional[str]:
    frame = sys._current_frames().get(ident) if ident is not None else None
    if frame is None:
        return None
    code = frame.f_code
    return "%s (%s:%d)" % (code.co_name, code.co_filename, frame.f_lineno)


# -- the main thread ------------------------------------------------------------------------------

def _run_main_queue(_arg: Any) -> int:
    """The pending call: runs on the main thread between two bytecodes. Returns 0, always."""
    global _pending_queued
    try:
        with _lock:
            _pending_queued = False
            jobs = list(_main_queue)
            del _main_queue[:]
        for job in jobs:
            job.run_here()
            _redeliver_keyboard_interrupt(job)
    except BaseException:
        pass
    return 0


def _to_main(job: Job) -> None:
    global _pending_queued, _callback
    import ctypes

    with _lock:
        _main_queue.append(job)
        if _pending_queued:
            return  # the call already queued runs this job too
        if _callback is None:
            _callback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(_run_main_queue)
        if ctypes.pythonapi.Py_AddPendingCall(_callback, None) != 0:
            raise Busy("the interpreter's queue of pending calls is full",
                       hint="the main thread has not reached a bytecode boundary for a while; run concurrently "
                            "(without --on main)")
        _pending_queued = True


def _redeliver_keyboard_interrupt(job: Job) -> None:
    """A Ctrl-C meant for the program that arrived while a snippet ran on its main thread goes back to it."""
    if getattr(job, "keyboard_interrupt", False):
        try:
            import _thread

            _thread.interrupt_main()
        except BaseException:
            pass


# -- right after an optimizer step ----------------------------------------------------------------

def _run_step_queue() -> None:
    """The snippets waiting for a step, run by the step counter's post-step hook on the thread that just
    ended a step (``probe.tables.torch.steps.after_each_step``); nearly free while none waits."""
    if not _step_queue:
        return
    try:
        with _lock:
            jobs = list(_step_queue)
            del _step_queue[:]
        for job in jobs:
            job.run_here()
            if threading.current_thread() is threading.main_thread():
                _redeliver_keyboard_interrupt(job)
    except BaseException:
        pass


def _to_step(job: Job) -> None:
    after_each_step(_run_step_queue)
    install_step_hook()
    with _lock:
        _step_queue.append(job)
