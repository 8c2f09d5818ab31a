"""``torch.trainer``: each training framework object found (a Hugging Face ``Trainer``, a Lightning
``Trainer``, an ``accelerate.Accelerator``) and where it stands: step, epoch, limits, gradient
accumulation, precision, callbacks, the last logged loss, learning rate and grad norm (``probe.tables.torch.logged``
says where each is looked for). Read by attribute, never importing the framework."""

from typing import Any, Iterator, List, Optional, Tuple

from probe.tables.spec import Column
from probe.tables.torch import logged, steps
from probe.tables.torch._common import torch_or_raise
from probe.tables.torch.discovery import found, trainer_objects

__all__ = ["NAME", "DESCRIPTION", "COLUMNS", "EXAMPLE", "rows", "accelerate_step", "logged_loss"]

NAME = "torch.trainer"
DESCRIPTION = ("Each training framework object found (Hugging Face Trainer, Lightning Trainer, accelerate "
               "Accelerator; wherever it lives, a local of main() included): global step, epoch, limits, gradient "
               "accumulation, precision, callbacks, the names of the model, optimizers and schedulers it drives, and "
               "the loss, learning rate and grad norm it logged last.")
COLUMNS = (
    Column("trainer", "VARCHAR", "The expression that reaches it (trainer, model.trainer), or its class name when "
                                 "only the garbage collector found it."),
    Column("kind", "VARCHAR", "transformers, lightning or accelerate."),
    Column("class", "VARCHAR", "Its class, e.g. transformers.trainer.Trainer."),
    Column("global_step", "BIGINT", "Optimizer steps taken (HF state.global_step, Lightning global_step; "
                                    "accelerate, which keeps none: its optimizers' own step count, else the steps "
                                    "probe's step counter saw; NULL where neither is known)."),
    Column("epoch", "DOUBLE", "Current epoch (HF: fractional, as its logs show it; Lightning: current_epoch)."),
    Column("max_steps", "BIGINT", "The step limit (HF state.max_steps, Lightning max_steps; -1 or NULL: none)."),
    Column("max_epochs", "DOUBLE", "The epoch limit (HF num_train_epochs, Lightning max_epochs)."),
    Column("grad_accumulation", "INTEGER", "Batches accumulated per optimizer step."),
    Column("precision", "VARCHAR", "As the framework names it: Lightning's precision (32-true, bf16-mixed), HF's and "
                                   "accelerate's mixed_precision (no, fp16, bf16)."),
    Column("world_size", "INTEGER", "Processes in the job, as the framework counts them."),
    Column("callbacks", "VARCHAR", "Its callbacks' class names, joined by ', '."),
    Column("model", "VARCHAR", "The model it trains, by its name in torch.parameters (unwrapped)."),
    Column("optimizers", "VARCHAR", "Its optimizers, by their names in torch.optimizers (wrappers folded)."),
    Column("schedulers", "VARCHAR", "Its LR schedulers, by name."),
    Column("loss", "DOUBLE", "The last training loss the framework logged, NaN and Inf as they are (HF: the newest "
                             "of the last 16 entries of state.log_history with a loss; Lightning: callback_metrics' "
                             "loss, train_loss or another key naming a loss; a CUDA tensor is not read: NULL; "
                             "accelerate keeps none)."),
    Column("loss_from", "VARCHAR", "Where that loss was read, with its step where the framework says it."),
    Column("lr", "DOUBLE", "The learning rate the framework logged last (HF: log_history's learning_rate; Lightning: "
                           "a logged lr, lr-<optimizer> or learning_rate key, else a LearningRateMonitor's last "
                           "value); where none was logged (accelerate's trackers keep no values), the first "
                           "parameter group's lr of its first optimizer now."),
    Column("lr_from", "VARCHAR", "Where that lr was read, with its step."),
    Column("grad_norm", "DOUBLE", "The gradient norm the framework logged last (HF: log_history's grad_norm; "
                                  "Lightning: a logged grad_norm or grad_<p>_norm_total key); NULL where none was "
                                  "logged (accelerate keeps none; probe never computes one here)."),
    Column("grad_norm_from", "VARCHAR", "Where that grad norm was read, with its step."),
    Column("logged_step", "BIGINT", "The step the logged loss belongs to (HF: its log entry's step; Lightning: "
                                    "global_step when read); NULL where no loss was logged."),
)
EXAMPLE = "SELECT trainer, global_step, epoch, max_steps, grad_accumulation FROM torch.trainer"


def rows() -> Iterator[Tuple[Any, ...]]:
    torch = torch_or_raise()
    everything = found(torch)
    names = {id(o): n for n, o in everything.models + everything.optimizers + everything.schedulers}
    for name, kind, trainer in everything.trainers:
        held = trainer_objects(name, kind, trainer, torch)
        values = _read(kind, trainer)
        cls = type(trainer)
        yield ((name, kind, "%s.%s" % (cls.__module__, cls.__qualname__)) + values
               + (_names(held.models[:1], names), _names(held.optimizers, names), _names(held.schedulers, names))
               + _logged(torch, name, kind, trainer))


def _names(items: List[Tuple[str, Any]], names: dict) -> Optional[str]:
    out = list(dict.fromkeys(names.get(id(o), n) for n, o in items))
    return ", ".join(out) or None


def _int(value: Any) -> Optional[int]:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _text(value: Any) -> Optional[str]:
    return None if value is None else str(value)


def _callbacks(items: Any) -> Optional[str]:
    try:
        return ", ".join(type(c).__name__ for c in list(items or [])) or None
    except Exception:
        return None


def _read(kind: str, trainer: Any) -> Tuple[Any, ...]:
    """global_step, epoch, max_steps, max_epochs, grad_accumulation, precision, world_size, callbacks."""
    if kind == "transformers":
        return (_int(logged.get_path(trainer, "state", "global_step")), logged.plain_float(logged.get_path(trainer, "state", "epoch")),
                _int(logged.get_path(trainer, "state", "max_steps")) or _int(logged.get_path(trainer, "args", "max_steps")),
                logged.plain_float(logged.get_path(trainer, "args", "num_train_epochs")),
                _int(logged.get_path(trainer, "args", "gradient_accumulation_steps")),
                _text(logged.get_path(trainer, "accelerator", "mixed_precision")), _int(logged.get_path(trainer, "args", "world_size")),
                _callbacks(logged.get_path(trainer, "callback_handler", "callbacks")))
    if kind == "lightning":
        return (_int(logged.get_path(trainer, "global_step")), logged.plain_float(logged.get_path(trainer, "current_epoch")),
                _int(logged.get_path(trainer, "max_steps")), logged.plain_float(logged.get_path(trainer, "max_epochs")),
                _int(logged.get_path(trainer, "accumulate_grad_batches")), _text(logged.get_path(trainer, "precision")),
                _int(logged.get_path(trainer, "world_size")), _callbacks(logged.get_path(trainer, "callbacks")))
    return (accelerate_step(trainer)[0], None, None, None, _int(logged.get_path(trainer, "gradient_accumulation_steps")),
            _text(logged.get_path(trainer, "mixed_precision")), _int(logged.get_path(trainer, "num_processes")), None)


def _logged(torch: Any, name: str, kind: str, trainer: Any) -> Tuple[Any, ...]:
    """loss, loss_from, lr, lr_from, grad_norm, grad_norm_from, logged_step."""
    found = logged.read(torch, name, kind, trainer)
    return (found.loss, found.loss_from, found.lr, found.lr_from, found.grad_norm, found.grad_norm_from,
            found.step if found.loss_from else None)


def logged_loss(torch: Any, name: str, kind: str, trainer: Any) -> Tuple[Optional[float], Optional[str]]:
    """The framework's last logged training loss and where it was read (see the ``loss`` column)."""
    found = logged.read(torch, name, kind, trainer)
    return found.loss, found.loss_from


_STATE_ENTRIES = 8  # parameters' state entries looked at for a step count: every entry of one step holds the same


def accelerate_step(accelerator: Any) -> Tuple[Optional[int], Optional[str]]:
    """The optimizer steps an ``accelerate.Accelerator``'s job has taken, and where that was read.

    accelerate keeps no global step: ``Accelerator.step`` counts micro-batches towards the next gradient sync
    and goes back to 0 at each dataloader's end, so it reads 0 at step 400, and a checkpoint that took it
    would resume at 0. The optimizers it prepared know: Adam-like optimizers keep a per-parameter ``step``
    (counted only when the step really ran). Else the steps probe's own step counter saw (all of them when
    the agent was there from the start). (None, None) where neither is known: never a made-up 0.
    """
    wrappers = list(logged.get_path(accelerator, "_optimizers") or [])
    best: Tuple[Optional[int], Optional[str]] = (None, None)
    for index, wrapper in enumerate(wrappers):
        optimizer = getattr(wrapper, "optimizer", wrapper)
        try:
            entries = list(getattr(optimizer, "state", {}).values())[:_STATE_ENTRIES]
        except Exception:
            entries = []
        for entry in entries:
            value = entry.get("step") if isinstance(entry, dict) else None
            try:
                if hasattr(value, "numel") and value.numel() == 1 and value.device.type == "cpu":
                    value = float(value)
            except Exception:
                value = None
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if best[0] is None or int(value) > best[0]:
                    best = (int(value), "accelerator._optimizers[%d] state step (%s)" % (index, type(optimizer).__name__))
    if best[0] is not None:
        return best
    for index, wrapper in enumerate(wrappers):
        seen = steps.steps_seen(getattr(wrapper, "optimizer", wrapper))
        if seen:
            return seen, "steps of accelerator._optimizers[%d] counted by probe since its agent started" % index
    return None, None
