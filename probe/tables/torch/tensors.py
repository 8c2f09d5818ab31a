"""``torch.tensors``: the live tensors the garbage collector knows, with what each one is (a parameter,
a gradient, optimizer state, a buffer) where that can be told.

The collector's objects are read by ``probe.tables.tracked`` (the program never runs while we hold its every
object); the table stops at :data:`MAX_TENSORS` tensors or after :data:`BUDGET_S` seconds of describing
them, and then every row says so (``complete``).
"""

import sys
import time
from typing import Any, Dict, List, Tuple

from probe.tables.spec import Column
from probe.tables.tracked import tracked_of
from probe.tables.torch._common import (Deadline, at_step_boundary, device_text, dtype_text, grads_outside_backward,
                                        in_backward, is_dtensor, shape_text, torch_or_raise)
from probe.tables.torch.discovery import find_models, find_optimizers

__all__ = ["NAME", "DESCRIPTION", "COLUMNS", "EXAMPLE", "rows", "scan", "BUDGET_S", "MAX_TENSORS"]

BUDGET_S = 3.0
MAX_TENSORS = 200_000

NAME = "torch.tensors"
DESCRIPTION = ("Live tensors found through the garbage collector: shape, dtype, device, bytes, and whether "
               "each is a parameter, gradient, buffer or optimizer state (and of what). The scan stops after "
               "%.0f s or %d tensors; then `complete` is false on every row." % (BUDGET_S, MAX_TENSORS))
COLUMNS = (
    Column("kind", "VARCHAR", "parameter, gradient, buffer, optimizer_state, or tensor (anything else)."),
    Column("owner", "VARCHAR", "What it belongs to: model.param_name for parameters, gradients and buffers; "
                               "optimizer[model.param_name].state_key for optimizer state; NULL when unknown."),
    Column("shape", "VARCHAR", "Its shape, e.g. [512, 256]."),
    Column("dtype", "VARCHAR", "Element type, e.g. float32."),
    Column("device", "VARCHAR", "Where it lives: cpu, cuda:0, meta ..."),
    Column("numel", "BIGINT", "Number of elements."),
    Column("bytes", "BIGINT", "Bytes of its own elements (numel x element size); 0 for a DTensor, whose local "
                              "shard is a row of its own. Views of one storage each count their own extent: "
                              "sum storage_bytes over DISTINCT storage_ptr for memory held."),
    Column("storage_ptr", "BIGINT", "Address of its storage (equal for views of one storage); NULL where it has "
                                    "none (a DTensor, a sparse tensor)."),
    Column("storage_bytes", "BIGINT", "Size of that storage in bytes."),
    Column("requires_grad", "BOOLEAN", "Whether autograd tracks it."),
    Column("is_view", "BOOLEAN", "Whether it is a view of another tensor's storage."),
    Column("type", "VARCHAR", "Its Python class: Tensor, Parameter, DTensor, ..."),
    Column("complete", "BOOLEAN", "False on every row when the scan stopped early (time or row budget): the table "
                                  "then holds only some of the live tensors."),
)
EXAMPLE = "SELECT device, dtype, count(*), sum(bytes) FROM torch.tensors GROUP BY ALL ORDER BY 4 DESC"


def rows() -> Dict[str, List[Any]]:
    """Read on the training thread right after an optimizer step when the job steps (the loop waits
    while the tensors are read, at most BUDGET_S): autograd and the ops of a running step change
    tensors from C++ without the GIL, and describing one meanwhile crashed the target (SIGSEGV,
    SIGABRT in the tests' stress runs). A job that makes no step within 2 s is read where it stands,
    outside any backward pass."""
    torch = torch_or_raise()
    done, _ = at_step_boundary(lambda: _rows_now(torch), BUDGET_S + 5.0)
    return done if done is not None else _rows_now(torch)


def _rows_now(torch: Any) -> Dict[str, List[Any]]:
    tensors, complete = scan(torch)
    roles = _roles(torch)
    out: Dict[str, List[Any]] = {c.name: [] for c in COLUMNS}
    deadline = Deadline(BUDGET_S)
    with torch._C.DisableTorchFunctionSubclass():  # attribute reads run no subclass's Python code
        for start in range(0, len(tensors), CHUNK):
            chunk = tensors[start:start + CHUNK]
            described = outside_backward(lambda part=chunk: [_safely(_describe, torch, t) for t in part], deadline)
            if described is None:  # backward passes kept running until the budget was spent
                complete = False
                break
            for tensor, values in zip(chunk, described):
                if values is None:
                    continue  # a tensor that cannot describe itself (freed storage, an odd subclass): skip it
                kind, owner = roles.get(id(tensor), ("tensor", None))
                for name, value in zip(COLUMNS, (kind, owner) + values + (complete,)):
                    out[name.name].append(value)
    if not complete:
        out["complete"] = [False] * len(out["complete"])
    return out


CHUNK = 2048  # tensors described per exclusive hold of the GIL (a few milliseconds)


def _safely(describe: Any, torch: Any, tensor: Any) -> Any:
    try:
        return describe(torch, tensor)
    except Exception:
        return None


def outside_backward(work: Any, deadline: Deadline) -> Any:
    """``work()`` run while no thread is in a backward pass (autograd changes tensors from C++ without
    the GIL; describing one meanwhile crashed the target with SIGSEGV), with no other Python thread able
    to start one; waits for a backward pass to end, up to the deadline (then None)."""
    while True:
        previous = sys.getswitchinterval()
        sys.setswitchinterval(1.0)
        try:
            if not in_backward():
                return work()
        finally:
            sys.setswitchinterval(previous)
        if deadline.spent():
            return None
        time.sleep(0.002)


def scan(torch: Any) -> Tuple[List[Any], bool]:
    """The tensors the collector tracks (``probe.tables.tracked``), and whether all of them are here (at most
    :data:`MAX_TENSORS`)."""
    tensor_type = torch.Tensor
    found = tracked_of(lambda cls: issubclass(cls, tensor_type))  # the class, not isinstance: no proxy's code runs
    if len(found) > MAX_TENSORS:
        del found[MAX_TENSORS:]
        return found, False
    return found, True


def _describe(torch: Any, tensor: Any) -> Tuple[Any, ...]:
    dtensor = is_dtensor(tensor)
    numel = int(tensor.numel())
    ptr = size = None
    if not dtensor and tensor.layout == torch.strided:
        storage = tensor.untyped_storage()
        ptr, size = int(storage.data_ptr()), int(storage.nbytes())
    own = 0 if dtensor else numel * int(tensor.element_size())
    return (shape_text(tensor), dtype_text(tensor.dtype), device_text(tensor), numel, own, ptr, size,
            bool(tensor.requires_grad), bool(tensor._is_view()), type(tensor).__name__)


def _roles(torch: Any) -> Dict[int, Tuple[str, str]]:
    """id(tensor) -> (kind, owner) for the parameters, gradients, buffers and optimizer state found."""
    roles: Dict[int, Tuple[str, str]] = {}
    names: Dict[int, str] = {}

    def mark(tensor: Any, kind: str, owner: str) -> None:
        if isinstance(tensor, torch.Tensor):
            roles.setdefault(id(tensor), (kind, owner))
            local = getattr(tensor, "_local_tensor", None)  # a DTensor's shard: the same role
            if local is not None:
                roles.setdefault(id(local), (kind, owner))

    for model_name, model in find_models(torch):
        named = list(model.named_parameters())
        # On the training thread at a step boundary where the job steps (see rows), else from here while
        # no thread replaces gradients; None when one does (see _common.read_grads for why).
        grads = grads_outside_backward([param for _, param in named])
        for index, (name, param) in enumerate(named):
            owner = "%s.%s" % (model_name, name)
            names[id(param)] = owner
            mark(param, "parameter", owner)
            if grads is not None:
                mark(grads[index], "gradient", owner)
        for name, buffer in model.named_buffers():
            mark(buffer, "buffer", "%s.%s" % (model_name, name))
    for opt_name, optimizer in find_optimizers(torch):
        for param, state in list(optimizer.state.items()):
            if isinstance(state, dict):
                for key, value in list(state.items()):
                    mark(value, "optimizer_state", "%s[%s].%s" % (opt_name, names.get(id(param), "?"), key))
    return roles
