"""What the torch tables share: the target's own torch (never imported by us), and safe readings of tensors.

Reading a tensor's value from the agent's thread must never synchronise a device (a CUDA ``.item()``
waits for every kernel queued before it) nor issue a collective (any op on a DTensor may), so values
are read only from plain CPU tensors, and a DTensor only through its local shard.
"""

import math
import sys
import time
from typing import Any, Callable, Optional, Tuple

from probe.errors import TorchNotLoaded

__all__ = ["torch_or_raise", "grads_outside_backward", "in_backward", "at_step_boundary", "Deadline", "is_dtensor",
           "local_of", "plain_cpu",
           "tensor_stats", "shape_text", "dtype_text", "number", "device_text"]


def torch_or_raise() -> Any:
    """The target's ``torch`` module; ``TorchNotLoaded`` when the target never imported it."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "Tensor"):
        raise TorchNotLoaded("torch is not loaded in the target (it has not imported torch, and probe never "
                             "imports it)", hint="torch.* tables answer once the program has run `import torch`")
    return torch


between_steps: Optional[Callable[..., Tuple[Any, str]]] = None
"""Set by the agent (its placement's ``run_between_steps``): runs work on the training thread right
after the next optimizer step; None where no agent set it."""


def at_step_boundary(work: Callable[[], Any], timeout: float) -> Tuple[Any, str]:
    """``work()`` on the training thread right after the next optimizer step, where nothing else
    touches tensors: (its result, "") or (None, why not: no optimizer, no step within 2 s)."""
    if between_steps is None:
        return None, "no agent placement"
    return between_steps(lambda cancel: work(), timeout)


_BACKWARD_FILES = ("torch/autograd/__init__.py", "torch/_tensor.py", "torch/autograd/graph.py")


def grads_outside_backward(params: Any) -> Optional[list]:
    """Every ``param.grad`` (None where unset), read at a moment when no thread is inside a backward
    pass; None when one is.

    Autograd writes ``.grad`` from C++ without the GIL; reading it from another thread meanwhile races
    on the tensor's reference count and corrupts the heap (seen here: "free(): corrupted unsorted
    chunks", SIGABRT, within about a hundred concurrent reads). So the references are taken with the
    switch interval raised, so that no other Python thread can run (and start a backward) meanwhile,
    after checking that no thread's stack is inside ``backward`` already. The references keep the
    gradients alive; their values are read afterwards.
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
    """Whether some thread's stack is inside torch's ``backward`` (autograd is writing tensors)."""
    import gc

    enabled = gc.isenabled()
    gc.disable()  # nothing in the walk may let another thread run (see python_backtrace.snapshot)
    try:
        frames = sys._current_frames()
        frame: Any = None
        try:
            for frame in frames.values():
                while frame is not None:
                    name = frame.f_code.co_filename.replace("\\", "/")
                    if frame.f_code.co_name == "backward" and name.endswith(_BACKWARD_FILES):
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
