"""When a checkpoint is taken (``probe.tables.torch.checkpoint``, whose doc tells it whole): armed right after
an optimizer step and written as the next step begins, from our global pre-step hook on the training
thread (or from the agent's thread where no step begins soon); else concurrently, on a worker of its own.
Either way within the request's time limit, past which the save is told to stop. Never raises into the
training loop; never imports torch.
"""

import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from probe._threads import daemon_thread
from probe.errors import BadRequest, ProbeError, Timeout
from probe.tables.torch._common import torch_or_raise

__all__ = ["BetweenSteps", "NEXT_STEP_WAIT_S", "at_next_step", "in_worker"]

#: Runs ``work(cancel)`` right after the next optimizer step: (its result, "") or (None, why it did not).
BetweenSteps = Callable[[Callable[[threading.Event], Dict[str, Any]], float], Tuple[Optional[Dict[str, Any]], str]]

NEXT_STEP_WAIT_S = 2.0


class _Pending:
    """A save armed for the start of the next optimizer step."""

    def __init__(self, work: Callable[[threading.Event, Any], Dict[str, Any]], rng: Dict[str, Any],
                 timeout: float) -> None:
        self.work = work
        self.rng = rng
        self.timeout = timeout
        self.cancel = threading.Event()
        self.claimed_by = ""  # "step" (the training thread) or "agent"
        self.done = threading.Event()
        self.result: Dict[str, Any] = {}

    def run(self) -> None:
        try:
            self.result["value"] = self.work(self.cancel, self.rng)
        except BaseException as exc:  # for the requester; never into the training loop
            self.result["error"] = exc
        finally:
            self.done.set()


_gate = threading.Lock()
_armed: List[_Pending] = []  # at most one: the save waiting for the next step to begin
_pre_hook: List[Any] = []  # the handle of our global pre-step hook, once installed (it stays)


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Our global optimizer pre-step hook: nearly free while no save is armed. Never raises."""
    if not _armed:
        return
    try:
        with _gate:
            if not _armed:
                return
            pending = _armed.pop()
            mine = not pending.claimed_by
            if mine:
                pending.claimed_by = "step"
        if mine:
            pending.run()
        else:
            pending.done.wait(pending.timeout)  # the agent writes it: this step waits until it is written
    except BaseException:
        pass


def _install_pre_hook() -> None:
    """On the training thread, right after a step: the global pre-step hooks are not being walked by it."""
    if _pre_hook:
        return
    module = sys.modules.get("torch.optim.optimizer")
    register = getattr(module, "register_optimizer_step_pre_hook", None)
    if register is None:
        raise BadRequest("this torch has no global optimizer pre-step hooks (torch 2.0 or later has them)")
    _pre_hook.append(register(_before_step))


def at_next_step(between_steps: BetweenSteps, work: Callable[..., Dict[str, Any]],
                 read_rng: Callable[[Any], Dict[str, Any]], timeout: float) -> Tuple[Optional[Dict[str, Any]], str]:
    """Arm the save right after the next step (RNG read there, by ``read_rng(torch)``), run it as the step
    after begins; (result, "") or (None, why no step came)."""
    torch = torch_or_raise()
    started = time.monotonic()
    armed: List[_Pending] = []

    def arm(cancel: threading.Event) -> Dict[str, Any]:
        pending = _Pending(work, read_rng(torch), timeout)
        _install_pre_hook()
        with _gate:
            _armed[:] = [pending]
        armed.append(pending)
        return {}

    try:
        done, why = between_steps(arm, min(timeout, 30.0))
    except Timeout:
        raise Timeout("no optimizer step let the checkpoint in within %.0f s" % timeout) from None
    if done is None or not armed:
        return None, why
    pending = armed[0]
    how = "between optimizer steps (the training loop waited while it was written)"
    if not pending.done.wait(NEXT_STEP_WAIT_S):
        with _gate:
            if not pending.claimed_by:
                pending.claimed_by = "agent"
                _armed[:] = [p for p in _armed if p is not pending]
        if pending.claimed_by == "agent":
            # The loop is between steps (its last one, an evaluation, a slow batch): written from here,
            # and a step that begins meanwhile waits in our pre-step hook until it is written.
            how = ("between optimizer steps (no step began within %.0f s, so it was written alongside the loop; "
                   "a step that began meanwhile waited)" % NEXT_STEP_WAIT_S)
            worker = daemon_thread(pending.run, "probe-checkpoint")
            worker.start()
    left = max(0.1, timeout - (time.monotonic() - started))
    if not pending.done.wait(left):
        pending.cancel.set()
        pending.done.wait(2.0)
        with _gate:
            _armed[:] = [p for p in _armed if p is not pending]
        raise Timeout("the checkpoint did not finish within %.0f s; it was stopped and its temporary file "
                      "removed" % timeout, hint="give it longer with --checkpoint-timeout")
    error = pending.result.get("error")
    if error is not None:
        _raise_as_request_error(error)
    return dict(pending.result["value"], taken=how), ""


def _raise_as_request_error(error: BaseException) -> None:
    if isinstance(error, ProbeError):
        raise error
    if isinstance(error, OSError):
        raise BadRequest("cannot write the checkpoint: %s" % error) from None
    raise error


def in_worker(work: Any, timeout: float) -> Dict[str, Any]:
    """Run ``work`` on its own thread; past ``timeout`` tell it to stop and answer ``Timeout``."""
    cancel = threading.Event()
    result: Dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = work(cancel)
        except BaseException as exc:  # reported to the request below; never into the target
            result["error"] = exc

    worker = daemon_thread(run, "probe-checkpoint")
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        cancel.set()  # checked at every write: a writing save stops within one write() call
        worker.join(2.0)
        raise Timeout("the checkpoint did not finish within %.0f s; it was stopped and its temporary file "
                      "removed%s" % (timeout, "" if not worker.is_alive() else " (it is still inside a call that "
                                     "cannot be stopped; the file it was writing is removed when it returns)"),
                      hint="give it longer with --checkpoint-timeout")
    error = result.get("error")
    if error is not None:
        _raise_as_request_error(error)
    return result["value"]
