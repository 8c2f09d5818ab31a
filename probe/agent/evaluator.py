"""Run a snippet of Python in the target's ``__main__`` namespace (or a frame's), the way a REPL would.

``probe.agent.placement`` decides on which thread it runs (its own daemon thread by default) so that
the request can give up after its time limit; then the snippet is interrupted with an asynchronous
exception (which stops Python code, though not a C call that never returns). What the snippet prints
is captured per thread: the target's own threads keep printing to the real stdout and stderr meanwhile. Stdlib only; Python 3.9+.
"""

import ast
import io
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Dict, Optional

from probe.agent.frames import FrameSpec, Scope, frame_scope, note_unwritten
from probe.agent.placement import EvalInterrupted, Job, submit
from probe.errors import ProbeError, Timeout

__all__ = ["EvalOutcome", "run_snippet", "EvalInterrupted"]

_MAX_CAPTURE = 1024 * 1024
_MAX_REPR = 64 * 1024


@dataclass(frozen=True)
class EvalOutcome:
    stdout: str
    stderr: str
    value: Optional[str]  # repr of a final expression's value, None when there is none (or it is None)
    error: Optional[str]  # the traceback, when the snippet raised
    timed_out: bool = False

    def to_json_dict(self) -> Dict[str, Any]:
        return {"stdout": self.stdout, "stderr": self.stderr, "value": self.value, "error": self.error,
                "ok": self.error is None and not self.timed_out, "timed_out": self.timed_out}


class _Capture(io.TextIOBase):
    """Bounded buffer that remembers how much it dropped."""

    def __init__(self) -> None:
        self._parts: list = []
        self._size = 0
        self.dropped = 0

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if self._size < _MAX_CAPTURE:
            keep = text[: _MAX_CAPTURE - self._size]
            self._parts.append(keep)
            self._size += len(keep)
            self.dropped += len(text) - len(keep)
        else:
            self.dropped += len(text)
        return len(text)

    def getvalue(self) -> str:
        value = "".join(self._parts)
        if self.dropped:
            value += "\n[probe: %d more characters not captured]\n" % self.dropped
        return value


class _ThreadRouter(io.TextIOBase):
    """Stands in for sys.stdout/sys.stderr: writes from a capturing thread go to its buffer."""

    def __init__(self, original: Any) -> None:
        self.original = original
        self.captures: Dict[int, _Capture] = {}

    def writable(self) -> bool:
        return True

    def _target(self) -> Any:
        return self.captures.get(threading.get_ident(), self.original)

    def write(self, text: str) -> int:
        target = self._target()
        if target is None:  # the target runs without this stream (a daemon): its writes go nowhere, as before
            return len(text)
        return target.write(text)

    def flush(self) -> None:
        target = self._target()
        if target is not None and hasattr(target, "flush"):
            target.flush()

    def __getattr__(self, name: str) -> Any:  # encoding, isatty, fileno... of the real stream
        return getattr(self.original, name)


_router_lock = threading.Lock()


def _capture(stream_name: str, ident: int, buffer: _Capture) -> _ThreadRouter:
    """Route ``ident``'s writes to ``buffer``, putting a router in place of the stream if needed."""
    with _router_lock:
        current = getattr(sys, stream_name)
        if not isinstance(current, _ThreadRouter):
            current = _ThreadRouter(current)
            setattr(sys, stream_name, current)
        current.captures[ident] = buffer
        return current


def _release(stream_name: str, router: _ThreadRouter, ident: int) -> None:
    """Stop capturing ``ident``; the last capture puts the target's own stream back."""
    with _router_lock:
        router.captures.pop(ident, None)
        if not router.captures and getattr(sys, stream_name) is router:
            setattr(sys, stream_name, router.original)


def _compile(code: str) -> "tuple[Any, Any]":
    """(body, final expression or None): a trailing expression is evaluated for its value, as in a REPL."""
    tree = ast.parse(code, "<probe-eval>", "exec")
    final = tree.body[-1] if tree.body else None
    if isinstance(final, ast.Expr):
        tree.body.pop()
        last = ast.Expression(final.value)
        return compile(tree, "<probe-eval>", "exec"), compile(last, "<probe-eval>", "eval")
    return compile(tree, "<probe-eval>", "exec"), None


def _execute(code: str, scope: Scope, result: Dict[str, Any], job: Job) -> None:
    out, err = _Capture(), _Capture()
    ident = threading.get_ident()
    stdout, stderr = _capture("stdout", ident, out), _capture("stderr", ident, err)
    before: Optional[Dict[str, int]] = None
    try:
        import linecache

        linecache.cache["<probe-eval>"] = (len(code), None, code.splitlines(True), "<probe-eval>")
        body, last = _compile(code)
        namespace, local_names = scope.globals, scope.locals
        if local_names is not None:
            before = {k: id(v) for k, v in local_names.items()}
            namespace = dict(scope.globals)  # functions the snippet defines see the frame's names too
            namespace.update(local_names)
        exec(body, namespace, local_names if local_names is not None else namespace)
        if last is not None:
            value = eval(last, namespace, local_names if local_names is not None else namespace)
            if value is not None:
                if local_names is None:
                    namespace["_"] = value
                text = repr(value)
                result["value"] = text if len(text) <= _MAX_REPR else text[:_MAX_REPR] + "...[truncated]"
    except EvalInterrupted:
        result["error"] = "EvalInterrupted: %s\n" % (job.why_interrupted or "the snippet was interrupted")
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            job.keyboard_interrupt = True  # type: ignore[attr-defined]
        result["error"] = _snippet_traceback(exc)
    finally:
        _release("stdout", stdout, ident)
        _release("stderr", stderr, ident)
        note = note_unwritten(scope, before)
        result["stdout"], result["stderr"] = out.getvalue(), err.getvalue() + note


def _snippet_traceback(exc: BaseException) -> str:
    """The traceback from the snippet's own frames down, without the agent's frames above them."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def run_snippet(code: str, timeout: float, place: str = "agent", frame: Optional[FrameSpec] = None,
                job_id: Optional[str] = None, wait: float = 10.0) -> EvalOutcome:
    """Run ``code`` in ``__main__`` (or in ``frame``'s namespace) on the thread ``place`` names.

    Waits at most ``wait`` seconds for that thread to take the snippet (``main``, ``step``), then at
    most ``timeout`` seconds for the snippet itself.
    """
    result: Dict[str, Any] = {}

    def body(job: Job) -> None:
        try:
            scope = frame_scope(frame) if frame is not None else Scope(sys.modules["__main__"].__dict__)
        except ProbeError as exc:
            result["error"] = "%s%s\n" % (exc.message, " -- %s" % exc.hint if exc.hint else "")
            return
        _execute(code, scope, result, job)

    job = Job(body, job_id)
    submit(job, place)
    if not job.started.wait(wait if place != "agent" else 10.0):
        if job.abandon_if_waiting():
            raise Timeout(_never_started(place, wait), hint=_NEVER_STARTED_HINT[place])
    if not job.finished.wait(timeout):
        job.interrupt("the snippet did not finish within %.1f s and was interrupted" % timeout)
        job.finished.wait(1.0)
        if not job.finished.is_set():
            return EvalOutcome("", "", None, "the snippet did not finish within %.1f s and was interrupted (it is "
                               "still running: it is in a call that cannot be interrupted)\n" % timeout,
                               timed_out=True)
        return EvalOutcome(result.get("stdout", ""), result.get("stderr", ""), None,
                           "the snippet did not finish within %.1f s and was interrupted\n" % timeout, timed_out=True)
    if job.state == "abandoned":  # the client cancelled it before it started
        return EvalOutcome("", "", None, "EvalInterrupted: cancelled before it started; nothing ran\n")
    return EvalOutcome(result.get("stdout", ""), result.get("stderr", ""), result.get("value"), result.get("error"))


_NEVER_STARTED_HINT = {
    "agent": "the process may be short of threads or memory",
    "main": "the main thread is blocked in C (a lock, I/O, a long native call), so it reaches no bytecode "
            "boundary; run the snippet concurrently (without --on main)",
    "step": "the job may be hung or between epochs; a hung job's state is not changing, so running the snippet "
            "concurrently (without --between-steps) reads it consistently",
}


def _never_started(place: str, wait: float) -> str:
    what = {"agent": "no thread could be started for the snippet",
            "main": "the main thread reached no bytecode boundary",
            "step": "no optimizer step finished"}[place]
    return "%s within %.1f s; the snippet did not run and never will" % (what, wait)
