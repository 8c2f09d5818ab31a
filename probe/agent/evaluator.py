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
from probe.errors import Busy, ProbeError, Timeout

__all__ = ["EvalOutcome", "run_snippet", "EvalInterrupted", "MAX_STUCK"]

_MAX_CAPTURE = 1024 * 1024
_MAX_REPR = 64 * 1024
MAX_STUCK = 8
"""Snippets past their time limit that could not be interrupted (a C call that never returns) each keep
a thread; past this many, new snippets are refused (``busy``) until some return."""
_stuck: "set[Job]" = set()
_stuck_lock = threading.Lock()


@dataclass(frozen=True)
class EvalOutcome:
    stdout: str
    stderr: str
    value: Optional[str]  # repr of a final expression's value, None when there is none (or it is None)
    error: Optional[str]  # the traceback, when the snippet raised
    timed_out: bool = False
    stdout_dropped: int = 0  # characters past the capture limit, counted, not kept
    stderr_dropped: int = 0

    def to_json_dict(self) -> Dict[str, Any]:
        return {"stdout": self.stdout, "stderr": self.stderr, "value": self.value, "error": self.error,
                "ok": self.error is None and not self.timed_out, "timed_out": self.timed_out,
                "stdout_dropped": self.stdout_dropped, "stderr_dropped": self.stderr_dropped}


class _Capture(io.TextIOBase):
    """Bounded buffer that remembers how much it dropped."""

    def __init__(self, limit: int = _MAX_CAPTURE) -> None:
        self._parts: list = []
        self._size = 0
        self._limit = limit
        self.dropped = 0

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if self._size < self._limit:
            keep = text[: self._limit - self._size]
            self._parts.append(keep)
            self._size += len(keep)
            self.dropped += len(text) - len(keep)
        else:
            self.dropped += len(text)
        return len(text)

    def getvalue(self) -> str:
        """What was kept; ``dropped`` says how much was not (reported beside the output, never inside it)."""
        return "".join(self._parts)


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
    """(body, final expression or None): a trailing expression is evaluated for its value, as in a REPL,
    except a call of a ``write`` method, whose count of characters written is no answer to show."""
    tree = ast.parse(code, "<probe-eval>", "exec")
    final = tree.body[-1] if tree.body else None
    if isinstance(final, ast.Expr) and not _is_write_call(final.value):
        tree.body.pop()
        last = ast.Expression(final.value)
        return compile(tree, "<probe-eval>", "exec"), compile(last, "<probe-eval>", "eval")
    return compile(tree, "<probe-eval>", "exec"), None


def _is_write_call(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("write", "writelines"))


def _execute(code: str, scope: Scope, result: Dict[str, Any], job: Job, limit: int) -> None:
    out, err = _Capture(limit), _Capture(limit)
    result["captures"] = (out, err)  # read as they are, should the snippet outlive its time limit
    ident = threading.get_ident()
    stdout, stderr = _capture("stdout", ident, out), _capture("stderr", ident, err)
    before: Optional[Dict[str, int]] = None
    lr_watch = None
    try:
        lr_watch = _lr_watch_before(code)
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
        note = note_unwritten(scope, before) + _lr_watch_after(lr_watch)
        result["stdout"], result["stderr"] = out.getvalue(), err.getvalue() + note
        result["dropped"] = (out.dropped, err.dropped)


def _lr_watch_before(code: str) -> Any:
    """In a torch job, a snippet that may set a group's lr: the optimizers' lr before it (see
    ``probe.tables.torch.lr.watch_before``); None, at no cost, anywhere else. Never raises."""
    if "torch.optim" not in sys.modules or "lr" not in code and "param_groups" not in code:
        return None
    try:
        from probe.tables.torch.lr import watch_before

        return watch_before(code)
    except Exception:  # an interrupt meant for the snippet goes on to stop it
        return None


def _lr_watch_after(snapshot: Any) -> str:
    """A warning line where the snippet set an lr that a scheduler sets back at its next step."""
    if snapshot is None:
        return ""
    try:
        from probe.tables.torch.lr import watch_after

        return watch_after(snapshot)
    except BaseException:  # the snippet has ended: a late interrupt was for it
        return ""


def _snippet_traceback(exc: BaseException) -> str:
    """The traceback from the snippet's own frames down, without the agent's frames above them; a
    syntax error as the caret under the snippet's line (its frames are the parser's, not the snippet's)."""
    if isinstance(exc, SyntaxError) and exc.filename == "<probe-eval>":
        return "".join(traceback.format_exception_only(type(exc), exc))
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def run_snippet(code: str, timeout: float, place: str = "agent", frame: Optional[FrameSpec] = None,
                job_id: Optional[str] = None, wait: float = 10.0, max_output: int = _MAX_CAPTURE) -> EvalOutcome:
    """Run ``code`` in ``__main__`` (or in ``frame``'s namespace) on the thread ``place`` names.

    Waits at most ``wait`` seconds for that thread to take the snippet (``main``, ``step``), then at
    most ``timeout`` seconds for the snippet itself. Keeps ``max_output`` characters of each stream.
    """
    with _stuck_lock:
        _stuck.difference_update([j for j in _stuck if j.finished.is_set()])
        if len(_stuck) >= MAX_STUCK:
            raise Busy("%d snippets that ran past their time limit could not be interrupted and still run here, "
                       "each on its own thread; no more are started until some return" % len(_stuck),
                       hint="they are in calls that never return (see `probe TARGET backtrace`, threads "
                            "\"probe-eval\"); a snippet that must block should take a timeout of its own")
    result: Dict[str, Any] = {}

    def body(job: Job) -> None:
        try:
            scope = frame_scope(frame) if frame is not None else Scope(sys.modules["__main__"].__dict__)
        except ProbeError as exc:
            result["error"] = "%s%s\n" % (exc.message, " -- %s" % exc.hint if exc.hint else "")
            return
        _execute(code, scope, result, job, max_output)

    job = Job(body, job_id)
    submit(job, place)
    if not job.started.wait(wait if place != "agent" else 10.0):
        if job.abandon_if_waiting():
            raise Timeout(_never_started(place, wait), hint=_NEVER_STARTED_HINT[place])
    if not job.finished.wait(timeout):
        job.interrupt("the snippet did not finish within %.1f s and was interrupted" % timeout)
        job.finished.wait(1.0)
        if not job.finished.is_set():
            with _stuck_lock:
                _stuck.add(job)
            out, err = result.get("captures", (_Capture(0), _Capture(0)))  # what it printed so far
            return EvalOutcome(out.getvalue(), err.getvalue(), None,
                               "the snippet did not finish within %.1f s and could not be interrupted: it is in a "
                               "call that never returns, and goes on running on its own thread\n" % timeout,
                               timed_out=True, stdout_dropped=out.dropped, stderr_dropped=err.dropped)
        dropped = result.get("dropped", (0, 0))
        return EvalOutcome(result.get("stdout", ""), result.get("stderr", ""), None,
                           "the snippet did not finish within %.1f s and was interrupted\n" % timeout, timed_out=True,
                           stdout_dropped=dropped[0], stderr_dropped=dropped[1])
    if job.state == "abandoned":  # the client cancelled it before it started
        return EvalOutcome("", "", None, "EvalInterrupted: cancelled before it started; nothing ran\n")
    if job.why_interrupted is not None and not result.get("error") and result.get("value") is None:
        # The interrupt landed outside the snippet's own try (while its run was being set up or wound
        # down): Job.run_here swallowed it, so say here that it was interrupted.
        result["error"] = "EvalInterrupted: %s\n" % job.why_interrupted
    dropped = result.get("dropped", (0, 0))
    return EvalOutcome(result.get("stdout", ""), result.get("stderr", ""), result.get("value"), result.get("error"),
                       stdout_dropped=dropped[0], stderr_dropped=dropped[1])


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
