"""``torch.optimizers``: each optimizer found and each of its param groups, read live (an eval's change
to ``lr`` shows in the next query)."""

import json
from typing import Any, Dict, Iterator, List, Optional, Tuple

from probe.tables.spec import Column
from probe.tables.torch import schedulers
from probe.tables.torch._common import at_step_boundary, number, plain_cpu, torch_or_raise
from probe.tables.torch.discovery import find_models, find_optimizers

__all__ = ["NAME", "DESCRIPTION", "COLUMNS", "EXAMPLE", "rows"]

NAME = "torch.optimizers"
DESCRIPTION = ("Each optimizer found (probe.watch, __main__, the main thread's frames, then the garbage collector) "
               "and each of its param groups: class, learning rate and the other hyperparameters, as they are now.")
_HYPER = " NULL when the group has none (or it is a CUDA tensor: reading it would synchronise the device)."
COLUMNS = (
    Column("optimizer", "VARCHAR", "Its watch() name, the expression that reaches it (optimizer, trainer.optimizer), "
                                     "or its class when only the garbage collector found it."),
    Column("class", "VARCHAR", "The optimizer's class, e.g. torch.optim.adam.Adam."),
    Column("group_index", "INTEGER", "Index of the param group in optimizer.param_groups."),
    Column("lr", "DOUBLE", "Learning rate." + _HYPER),
    Column("weight_decay", "DOUBLE", "Weight decay." + _HYPER),
    Column("momentum", "DOUBLE", "Momentum (SGD, RMSprop)." + _HYPER),
    Column("betas", "VARCHAR", "Adam-style betas as text, e.g. (0.9, 0.999); NULL when the group has none."),
    Column("beta1", "DOUBLE", "First of the betas." + _HYPER),
    Column("beta2", "DOUBLE", "Second of the betas." + _HYPER),
    Column("eps", "DOUBLE", "Epsilon." + _HYPER),
    Column("params", "INTEGER", "Number of parameter tensors in the group."),
    Column("numel", "BIGINT", "Number of elements of those tensors (local shards for DTensors)."),
    Column("step", "BIGINT", "The optimizer's step count where its state keeps one (Adam's per-parameter "
                             "'step'; the largest in the group); NULL otherwise."),
    Column("params_of", "VARCHAR", "The model (see torch.parameters) whose parameters the group holds, where "
                                   "found; several are joined by ', '."),
    Column("options", "VARCHAR", "Every other hyperparameter of the group, as JSON."),
    Column("scheduler", "VARCHAR", "The LR scheduler that drives the optimizer (torch.optim.lr_scheduler's, "
                                   "or one like them; accelerate's and Lightning's wrappers folded in): its "
                                   "expression (trainer.lr_scheduler) or class name; several are joined by ', '; "
                                   "NULL when none is found."),
    Column("scheduler_class", "VARCHAR", "Its class, e.g. torch.optim.lr_scheduler.LambdaLR."),
    Column("scheduler_base_lr", "DOUBLE", "The scheduler's base value for this group (base_lrs; OneCycleLR: "
                                          "max_lr), from which schedules such as LambdaLR compute each lr."),
    Column("scheduler_step", "BIGINT", "The scheduler's step count (last_epoch; DeepSpeed's: last_batch_iteration)."),
    Column("initial_lr", "DOUBLE", "The group's initial_lr, which a scheduler set from the first lr." + _HYPER),
    Column("lr_note", "VARCHAR", "Whether a changed lr sticks under this scheduler, and why (LambdaLR sets lr "
                                 "from its base_lrs at every step: use probe TARGET lr); how it is stepped."),
)
EXAMPLE = "SELECT group_index, lr, weight_decay FROM torch.optimizers"

_SHOWN = {"params", "lr", "weight_decay", "momentum", "betas", "eps", "initial_lr"}


def rows() -> List[Tuple[Any, ...]]:
    """Read on the training thread right after an optimizer step, every group of one step (read alongside
    the loop, one read held groups of steps 516 and 515); a job that makes no step within 2 s is read
    where it stands."""
    torch = torch_or_raise()
    done, _ = at_step_boundary(lambda: list(_rows_now(torch)), 5.0)
    return done if done is not None else list(_rows_now(torch))


def _rows_now(torch: Any) -> Iterator[Tuple[Any, ...]]:
    owners = _owners(torch)
    optimizers = find_optimizers(torch)
    drivers = schedulers.find_schedulers([o for _, o in optimizers])
    for name, optimizer in optimizers:
        driving = schedulers.drivers_of(optimizer, drivers)
        cls = "%s.%s" % (type(optimizer).__module__, type(optimizer).__qualname__)
        state = optimizer.state
        for index, group in enumerate(list(optimizer.param_groups)):
            params = list(group.get("params", ()))
            betas = group.get("betas")
            beta1, beta2 = _pair(torch, betas)
            models = sorted({owners[id(p)] for p in params if id(p) in owners})
            yield (name, cls, index, number(torch, group.get("lr")), number(torch, group.get("weight_decay")),
                   number(torch, group.get("momentum")), _text(betas), beta1, beta2, number(torch, group.get("eps")),
                   len(params), sum(_numel(p) for p in params), step_of_params(torch, state, params),
                   ", ".join(models) or None, _options(group)) + _scheduled(torch, driving, index, group)


def _scheduled(torch: Any, driving: List[Any], index: int, group: Dict[str, Any]) -> Tuple[Any, ...]:
    """scheduler, scheduler_class, scheduler_base_lr, scheduler_step, initial_lr, lr_note."""
    initial = number(torch, group.get("initial_lr"))
    if not driving:
        return None, None, None, None, initial, None
    first = driving[0].scheduler
    return (", ".join(d.name for d in driving), ", ".join(schedulers.class_text(d.scheduler) for d in driving),
            number(torch, schedulers.base_of(first, index)), schedulers.step_count(first),
            initial, "; ".join(schedulers.note_for(d) for d in driving))


def _owners(torch: Any) -> Dict[int, str]:
    out: Dict[int, str] = {}
    for model_name, model in find_models(torch):
        for param in model.parameters():
            out.setdefault(id(param), model_name)
    return out


def _pair(torch: Any, betas: Any) -> Tuple[Optional[float], Optional[float]]:
    if isinstance(betas, (tuple, list)) and len(betas) == 2:
        return number(torch, betas[0]), number(torch, betas[1])
    return None, None


def _text(value: Any) -> Optional[str]:
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        return "(%s)" % ", ".join(_scalar_text(v) for v in value)
    return _scalar_text(value)


def _scalar_text(value: Any) -> str:
    return repr(value) if isinstance(value, (int, float)) else "<%s>" % type(value).__name__


def _numel(param: Any) -> int:
    try:
        return int(getattr(param, "_local_tensor", param).numel())
    except Exception:
        return 0


def step_of_params(torch: Any, state: Any, params: Any) -> Optional[int]:
    """The highest step count (Adam's state 'step') among ``params``' state, where the optimizer keeps one."""
    best: Optional[int] = None
    for param in params:
        entry = state.get(param) if hasattr(state, "get") else None
        value = entry.get("step") if isinstance(entry, dict) else None
        if isinstance(value, torch.Tensor):
            value = float(value) if plain_cpu(torch, value) and value.numel() == 1 else None
        if isinstance(value, (int, float)):
            best = int(value) if best is None else max(best, int(value))
    return best


def _options(group: Dict[str, Any]) -> str:
    rest = {k: v for k, v in group.items() if k not in _SHOWN}
    return json.dumps(rest, default=lambda v: "<%s>" % type(v).__name__, sort_keys=True)
