"""``torch.parameters``: every parameter of every model found, with its norm and its gradient's."""

from typing import Any, Dict, List

from probe.tables.spec import Column
from probe.tables.torch._common import (Deadline, device_text, dtype_text, is_dtensor,
                                        local_of, read_grads, shape_text, tensor_stats, torch_or_raise)
from probe.tables.torch.discovery import find_models

__all__ = ["NAME", "DESCRIPTION", "COLUMNS", "EXAMPLE", "rows", "BUDGET_S"]

BUDGET_S = 5.0

NAME = "torch.parameters"
DESCRIPTION = ("Every parameter of every model found (probe.watch, __main__, the main thread's frames, then the garbage "
               "collector): shape, dtype, device, and the L2 norm of its value and gradient, with NaN/Inf flags.")
_STATS = ("; NULL on a CUDA tensor (reading it would synchronise the device), on a DTensor's remote shards, "
          "and past the table's time budget (%.0f s, see note)" % BUDGET_S)
COLUMNS = (
    Column("model", "VARCHAR", "The root model it belongs to: its watch() name, the expression that reaches "
                               "it (model, trainer.model), or its class when only the garbage collector found it."),
    Column("name", "VARCHAR", "Its qualified name in that model (as in named_parameters())."),
    Column("shape", "VARCHAR", "Its shape, e.g. [512, 256] (for a DTensor: the global shape)."),
    Column("dtype", "VARCHAR", "Element type, e.g. float32, bfloat16."),
    Column("device", "VARCHAR", "Where it lives: cpu, cuda:0, meta ..."),
    Column("numel", "BIGINT", "Number of elements (global, for a DTensor)."),
    Column("requires_grad", "BOOLEAN", "Whether autograd computes a gradient for it."),
    Column("is_dtensor", "BOOLEAN", "A DTensor (FSDP2 fully_shard, tensor parallel): values are of this rank's "
                                    "local shard."),
    Column("placements", "VARCHAR", "A DTensor's placements, e.g. (Shard(dim=0),); NULL otherwise."),
    Column("norm", "DOUBLE", "L2 norm of its value (this rank's shard for a DTensor)" + _STATS + "."),
    Column("has_nan", "BOOLEAN", "Whether its value holds a NaN" + _STATS + "."),
    Column("has_inf", "BOOLEAN", "Whether its value holds an infinity" + _STATS + "."),
    Column("has_grad", "BOOLEAN", "Whether .grad is set; NULL when it could not be read safely (see note)."),
    Column("grad_norm", "DOUBLE", "L2 norm of .grad; NULL without a gradient" + _STATS + "."),
    Column("grad_has_nan", "BOOLEAN", "Whether .grad holds a NaN; NULL without a gradient" + _STATS + "."),
    Column("grad_has_inf", "BOOLEAN", "Whether .grad holds an infinity; NULL without a gradient" + _STATS + "."),
    Column("note", "VARCHAR", "Why norms are NULL where they are (cuda, not a plain tensor, time budget spent)."),
)
EXAMPLE = "SELECT name, grad_norm FROM torch.parameters WHERE grad_has_nan OR grad_has_inf"


def rows() -> Dict[str, List[Any]]:
    torch = torch_or_raise()
    out: Dict[str, List[Any]] = {c.name: [] for c in COLUMNS}
    deadline = Deadline(BUDGET_S)
    with torch._C.DisableTorchFunctionSubclass():  # attribute reads run no subclass's Python code
        for model_name, model in find_models(torch):
            named = list(model.named_parameters())
            grads, why_not = read_grads(param for _, param in named)
            for index, (name, param) in enumerate(named):
                _add(torch, out, model_name, name, param, deadline, grads[index] if grads is not None else None,
                     why_not)
    return out


def _add(torch: Any, out: Dict[str, List[Any]], model: str, name: str, param: Any, deadline: Deadline,
         grad: Any, grads_not_read: str) -> None:
    dtensor = is_dtensor(param)
    in_backward = bool(grads_not_read)
    values = [model, name, shape_text(param), dtype_text(param.dtype), device_text(param), int(param.numel()),
              bool(param.requires_grad), dtensor, str(tuple(param.placements)) if dtensor else None]
    note = _why_no_stats(torch, param, deadline)
    if note is None:
        value_stats = tensor_stats(torch, local_of(param))
        grad_stats = tensor_stats(torch, local_of(grad)) if grad is not None else (None, None, None)
    else:
        value_stats = grad_stats = (None, None, None)
    if in_backward:
        note = grads_not_read
    values += [value_stats[0], value_stats[1], value_stats[2], None if in_backward else grad is not None,
               grad_stats[0], grad_stats[1], grad_stats[2], note]
    for column, value in zip(COLUMNS, values):
        out[column.name].append(value)


def _why_no_stats(torch: Any, param: Any, deadline: Deadline) -> Any:
    local = local_of(param)
    if type(local) not in (torch.Tensor, torch.nn.Parameter):
        return "%s: not a plain tensor, values not read" % type(local).__name__
    if local.device.type == "cuda":
        return "cuda: not read (it would synchronise the device)"
    if local.device.type != "cpu":
        return "%s: values not readable here" % local.device.type
    if deadline.spent():
        return "time budget of %.0f s spent: not read" % deadline.seconds
    return None
