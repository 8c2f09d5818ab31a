"""Backward spans through autograd graph hooks, not torch's module backward hooks.

torch's full backward hooks wrap a module's inputs and outputs in an identity autograd Function on every
call (costly even when idle, and an in-place op on the wrapped output, ``ReLU(inplace=True)``, fails).
Here nothing is wrapped: at a traced forward's end, pre-hooks are put on graph nodes that exist anyway.

* begins: a pre-hook on the ``grad_fn`` of each output (the module's last op): the engine is about to
  run it, so every gradient of that output has arrived;
* ends: a pre-hook on the ``grad_fn`` of each input (the op that made the input, which runs once the
  module's own backward has handed it the input's gradient). For an in-place module, whose output is
  its input, the nodes behind the output's node stand in. A module none of whose inputs needs a
  gradient (the first layer) ends when the backward pass ends (``queue_callback`` of the engine).

The hooks live on the graph, so they go with it: nothing to remove, nothing kept after the step.
Children and parents that share a node begin at the same instant, so exported spans nest.
Traced by torch.compile (compiled autograd) they return at once, as the forward hooks do.
"""

import functools
import time
from typing import Any, Callable, List, Optional

__all__ = ["BackwardSpans"]

_perf_ns = time.perf_counter_ns


def _not_compiling() -> bool:
    return False


_compiling: Any = _not_compiling  # torch.compiler.is_compiling once a BackwardSpans is made


class _Span:
    __slots__ = ("entry", "depth", "step", "seq", "start", "event", "ends", "done", "parent", "inner", "children")

    def __init__(self, entry: Any, depth: int, step: int, ends: bool) -> None:
        self.entry = entry
        self.depth = depth
        self.step = step
        self.seq = -1
        self.start = 0
        self.event: Any = None
        self.ends = ends
        self.done = False
        self.parent: Optional[_Span] = None  # the enclosing module's backward span: its time holds ours
        self.inner = 0  # host ns of the children's backward spans
        self.children: Optional[List[int]] = None  # their ring numbers (CUDA: for device self time)


class BackwardSpans:
    """Attaches the graph hooks of one traced forward; ``record(span, end_ns, grads)`` stores a finished span."""

    def __init__(self, torch: Any, begin_hook: Callable[[Any], None], record: Callable[[Any, int, Any], None],
                 fail: Callable[[BaseException], None]) -> None:
        global _compiling
        _compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or _not_compiling
        self._Tensor = torch.Tensor
        self._engine = torch.autograd.Variable._execution_engine
        self._begin_hook = begin_hook
        self._record = record
        self._fail = fail
        self._last = (0, 0)  # (id of the node that fired last, when): spans on one node begin together
        self.active = True

    def attach(self, entry: Any, depth: int, step: int, args: Any, output: Any,
               children: Optional[List[_Span]]) -> Optional[_Span]:
        """Hooks for the backward of one module call; ``children``: the spans of the calls it made."""
        outs = _nodes(output, self._Tensor)
        if not outs:
            return None
        ins: List[Any] = []
        for node in _nodes(args, self._Tensor):
            if any(node is o for o in outs):  # in place: the output's node replaced the input's
                ins.extend(n for n, _ in node.next_functions if n is not None)
            elif not any(node is n for n in ins):
                ins.append(node)
        span = _Span(entry, depth, step, bool(ins))
        for child in children or ():
            child.parent = span
        for node in outs:
            node.register_prehook(functools.partial(self._begin, span, id(node)))
        for node in ins:
            node.register_prehook(functools.partial(self._end, span))
        return span

    def _begin(self, span: _Span, node_id: int, grads: Any) -> None:
        if _compiling():
            return
        try:
            if span.start or not self.active:
                return
            last_id, last_at = self._last
            now = _perf_ns()
            span.start = last_at if last_id == node_id and now - last_at < 1_000_000 else now
            self._last = (node_id, span.start)
            self._begin_hook(span)
            if not span.ends:
                self._engine.queue_callback(functools.partial(self._end, span, None))
        except Exception as exc:
            self._fail(exc)

    def _end(self, span: _Span, grads: Optional[Any]) -> None:
        if _compiling():
            return
        try:
            if span.done or not span.start or not self.active:
                return
            span.done = True
            self._record(span, _perf_ns(), grads)
        except Exception as exc:
            self._fail(exc)


def _nodes(value: Any, Tensor: Any) -> List[Any]:
    """The distinct ``grad_fn`` nodes of the tensors in ``value`` (a tensor, or a tuple/list of them)."""
    items = (value,) if isinstance(value, Tensor) else value if isinstance(value, (tuple, list)) else ()
    found: List[Any] = []
    for item in items:
        node = item.grad_fn if isinstance(item, Tensor) else None
        if node is not None and not any(node is f for f in found):
            found.append(node)
    return found

