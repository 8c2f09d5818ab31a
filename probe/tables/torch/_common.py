"""What the torch tables share: the target's own torch (never imported by us), and safe readings of tensors.

Reading a tensor's value from the agent's thread must never synchronise a device (a CUDA ``.item()``
waits for every kernel queued before it) nor issue a collective (any op on a DTensor may), so values
are read only from plain CPU tensors, and a DTensor only through its local shard.
"""

import math
import sys
import threading
import time
from typing import Any, Callable, Optional, Tuple

from probe.errors import TorchNotLoaded

__all__ = ["torch_or_raise", "read_grads", "grads_outside_backward", "in_backward", "at_step_boundary", "Deadline", "is_dtensor",
           "local_of", "plain_cpu",
           "tensor_stats", "shape_text", "dtype_text", "number", "device_text"]


def torch_or_raise() -> Any:
    """The target's ``torch`` module; ``TorchNotLoaded`` when the target never imported it."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "Tensor"):
        raise TorchNotLoaded("torch is not loaded in the target (it has not imported torch, and probe never "
                             "imports it)", hint="torch's tables, the trace, lr and checkpoint work once the program "
                                                 "has run `import torch`")
    return torch


between_steps: Optional[Callable[..., Tuple[Any, str]]] = None
"""Set by the agent (its placement's ``run_between_steps``): runs work on the training thread right
after the next optimizer step; None where no agent set it."""


_boundary = threading.local()  # .inside: this thread runs work at a step boundary (the training thread)


def at_step_boundary(work: Callable[[], Any], timeout: float) -> Tuple[Any, str]:
    """``work()`` on the training thread right after the next optimizer step, where nothing else
    touches tensors: (its result, "") or (None, why not: no optimizer, no step within 2 s)."""
    if getattr(_boundary, "inside", False):
        return work(), ""  # already there (a table read at the boundary that reads gradients too)
    if between_steps is None:
        return None, "no agent placement"

    def marked(cancel: Any) -> Any:
        _boundary.inside = True
        try:
            return work()
        finally:
            _boundary.inside = False
    return between_steps(marked, timeout)


def read_grads(params: Any) -> Tuple[Optional[list], str]:
    """Every ``param.grad`` (None where unset), or (None, why they were not read).

    Another thread must not read ``.grad`` while the training thread may be replacing it: releasing the
    old gradient (``zero_grad``, ``p.grad = None``, autograd's accumulation) frees it while the
    parameter still points to it, and torch lets go of the GIL in the middle of that; a read landing
    there takes a reference to freed memory (measured: SIGABRT or SIGSEGV within a few hundred reads of
    a small CPU loop, with or without a backward-pass check). So the references are taken on the
    training thread itself, right after an optimizer step. Where no step comes within 2 s (a hung job,
    no torch optimizer), they are taken from here with the switch interval raised and only when no
    thread is in a backward pass or a ``zero_grad``: a loop that stands still is not replacing grads.
    The references keep the gradients alive; their values are read afterwards, off the training thread.
    """
    params = list(params)
    taken, _ = at_step_boundary(lambda: [param.grad for param in params], 5.0)
    if taken is not None:
        return taken, ""
    grads = grads_outside_backward(params)
    if grads is None:
        return None, "a backward pass or zero_grad was running: the gradient was not read (torch replaces it " \
                     "without the GIL)"
    return grads, ""


_GRAD_WRITERS = (("backward", ("torch/autograd/__init__.py", "torch/_tensor.py", "torch/autograd/graph.py")),
                 ("zero_grad", ("torch/optim/optimizer.py", "torch/nn/modules/module.py")))


def grads_outside_backward(params: Any) -> Optional[list]:
    """Every ``param.grad`` (None where unset), read from this thread at a moment when no thread is
    inside a backward pass or a ``zero_grad``; None when one is. Prefer :func:`read_grads`, which
    reads them on the training thread where it can (see there why).

    The references are taken with the switch interval raised, so that no other Python thread can run
    (and start replacing gradients) meanwhile, after checking every thread's stack.
    """
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1.0)  # attribute reads below never release the GIL: nobody else runs
    try:
        if in_backward():
            return None
        return [param.grad for param in params]
    finally:
        sys.setswitchinterval(previous)


def in_backward() -> bool:
    """Whether some thread's stack is inside torch's ``backward`` or a ``zero_grad`` (gradients are
    being written or released)."""
    import gc

    enabled = gc.isenabled()
    gc.disable()  # nothing in the walk may let another thread run (see python_backtrace.snapshot)
    try:
        frames = sys._current_frames()
        frame: Any = None
        try:
            for frame in frames.values():
                while frame is not None:
                    code = frame.f_code
                    for func, files in _GRAD_WRITERS:
                        if code.co_name == func and code.co_filename.replace("\\", "/").endswith(files):
                            return True
                    frame = frame.f_back
        finally:
            frames.clear()
            frame = None
    finally:
        if enabled:
            gc.enable()
    return False


class Deadline:
    """A time budget for a scan: ``spent()`` turns true once ``seconds`` have passed."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._end = time.monotonic() + seconds

    def spent(self) -> bool:
        return time.monotonic() >= self._end


def is_dtensor(tensor: Any) -> bool:
    """A DTensor (FSDP2, tensor parallel): any op on it may be a collective; its local shard is safe."""
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None) if module is not None else None
    return cls is not None and isinstance(tensor, cls)


def local_of(tensor: Any) -> Any:
    """The tensor whose bytes live in this process: a DTensor's local shard, else the tensor itself."""
    if is_dtensor(tensor):
        return tensor._local_tensor  # what to_local() returns, without going through autograd
    return tensor


def plain_cpu(torch: Any, tensor: Any) -> bool:
    """Whether reading ``tensor``'s values is safe here: a plain (not subclass) dense tensor on the CPU."""
    return (type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.device.type == "cpu"
            and tensor.layout == torch.strided)


def tensor_stats(torch: Any, tensor: Any) -> Tuple[Optional[float], Optional[bool], Optional[bool]]:
    """(L2 norm, has NaN, has Inf) of a plain CPU tensor; (None, None, None) for anything else.

    One pass for the norm; the NaN and Inf checks only run when the norm is not finite (a finite
    norm means neither is there).
    """
    if not plain_cpu(torch, tensor) or not (tensor.is_floating_point() or tensor.is_complex()):
        return None, None, None
    with torch.no_grad():
        data = tensor.detach()
        if data.numel() == 0:
            return 0.0, False, False
        norm = float(torch.linalg.vector_norm(data, dtype=torch.float64 if data.dtype == torch.float64
                                              else torch.float32))
        if math.isfinite(norm):
            return norm, False, False
        has_nan = bool(torch.isnan(data).any())
        has_inf = bool(torch.isinf(data).any())
        return norm, has_nan, has_inf


def shape_text(tensor: Any) -> str:
    return "[%s]" % ", ".join(str(int(d)) for d in tensor.shape)


def dtype_text(dtype: Any) -> str:
    """``torch.float32`` -> ``float32``."""
    return str(dtype).replace("torch.", "")


def device_text(tensor: Any) -> str:
    return str(tensor.device)


def number(torch: Any, value: Any) -> Optional[float]:
    """A hyperparameter as a float: plain numbers, and CPU tensors (a CUDA one would need a device sync)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, torch.Tensor) and plain_cpu(torch, value) and value.numel() == 1:
        return float(value.detach())
    return None
