"""Run a snippet of Python in the target's ``__main__`` namespace, the way a REPL would.

The snippet runs on its own daemon thread so that the request can give up after its time limit; when
it does, the snippet is interrupted with an asynchronous exception (which stops Python code, though not
a C call that never returns). What the snippet prints is captured per thread: the target's own threads
keep printing to the real stdout and stderr meanwhile. Stdlib only; Python 3.9+.
"""

import ast
import io
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Dict, Optional

__all__ = ["EvalOutcome", "run_snippet", "EvalInterrupted"]

_MAX_CAPTURE = 1024 * 1024
_MAX_REPR = 64 * 1024


class EvalInterrupted(BaseException):
    """Raised inside a snippet that ran past its time limit."""


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


def _execute(code: str, namespace: Dict[str, Any], result: Dict[str, Any]) -> None:
    out, err = _Capture(), _Capture()
    ident = threading.get_ident()
    stdout, stderr = _capture("stdout", ident, out), _capture("stderr", ident, err)
    try:
        import linecache

        linecache.cache["<probe-eval>"] = (len(code), None, code.splitlines(True), "<probe-eval>")
        body, last = _compile(code)
        exec(body, namespace)
        if last is not None:
            value = eval(last, namespace)
            if value is not None:
                namespace["_"] = value
                text = repr(value)
                result["value"] = text if len(text) <= _MAX_REPR else text[:_MAX_REPR] + "...[truncated]"
    except EvalInterrupted:
        result["error"] = "EvalInterrupted: the snippet ran past its time limit and was interrupted\n"
    except BaseException as exc:
        result["error"] = _snippet_traceback(exc)
    finally:
        _release("stdout", stdout, ident)
        _release("stderr", stderr, ident)
        result["stdout"], result["stderr"] = out.getvalue(), err.getvalue()


def _snippet_traceback(exc: BaseException) -> str:
    """The traceback from the snippet's own frames down, without the agent's frames above them."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def run_snippet(code: str, timeout: float) -> EvalOutcome:
    """Run ``code`` in ``__main__``; wait at most ``timeout`` seconds for it."""
    namespace = sys.modules["__main__"].__dict__
    result: Dict[str, Any] = {}
    worker = threading.Thread(target=_execute, args=(code, namespace, result), name="probe-eval", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        _interrupt(worker)
        worker.join(1.0)
        return EvalOutcome(result.get("stdout", ""), result.get("stderr", ""), None,
                           "the snippet did not finish within %.1f s and was interrupted%s\n"
                           % (timeout, "" if not worker.is_alive() else " (it is still running: it is in a call "
                              "that cannot be interrupted)"), timed_out=True)
    return EvalOutcome(result.get("stdout", ""), result.get("stderr", ""), result.get("value"), result.get("error"))


def _interrupt(thread: threading.Thread) -> None:
    """Raise EvalInterrupted in ``thread`` at its next bytecode boundary."""
    try:
        import ctypes

        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident or 0), ctypes.py_object(EvalInterrupted))
    except Exception:
        pass
