"""What a training framework logged last, read where the framework keeps it in memory: the loss, the learning
rate, the grad norm and the step they belong to (``torch.trainer``'s columns of those names).

Why a module of its own: the node helper reads these every ``PROBE_METRICS_EVERY`` seconds from each rank
(``probe.host.framework``), so the read is a few dict and attribute look-ups, never a walk over parameters,
never a device sync (a CUDA tensor is not read: NULL), never the user's code beyond a property, and it
never raises into the agent: whatever fails is a NULL.

Where each value is looked for, first found wins:

- Hugging Face ``Trainer``: the newest of the last 16 entries of ``state.log_history`` that has a ``loss``
  (its ``step`` is the step); ``learning_rate`` and ``grad_norm`` from that entry, else from the newest of
  those 16 that has them.
- Lightning ``Trainer``: ``callback_metrics`` then ``logged_metrics`` (the dicts those properties return,
  which Lightning refreshes at each batch's end, read as they are: the properties would compute the
  metrics again from the step's results, on this thread, and update the dicts), by key (``LOSS_KEYS``, ``LR_KEYS``,
  ``GRAD_NORM_KEYS``, then any key that names one: ``*loss*`` not of validation, ``lr-*`` / ``*/lr`` /
  ``*learning_rate*``, ``*grad_norm*`` / ``grad_<p>_norm_total``); the lr, where no key holds it, from a
  ``LearningRateMonitor`` callback's ``lrs`` (it sends its values to the loggers, not to the metrics, and
  keeps each one in that dict). The step is ``global_step`` when read.
- accelerate's ``Accelerator``: its trackers hand every value to their backend (TensorBoard's writer,
  MLflow, W&B...) and keep none in memory that probe reads, so no loss or grad norm comes from it.
- The lr of any of the three, where nothing logged one: the first parameter group's ``lr`` of its first
  optimizer, now (``lr_from`` says so).
"""

from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from probe.tables.torch._common import number

__all__ = ["Logged", "read", "LOSS_KEYS", "LR_KEYS", "GRAD_NORM_KEYS"]

HISTORY = 16  # HF log_history entries looked at, newest first: an evaluation's entries have no loss
KEYS_LOOKED = 64  # keys of a Lightning metrics dict looked at for a name
LOSS_KEYS = ("loss", "train_loss", "train/loss", "training_loss")
LR_KEYS = ("lr", "learning_rate", "train/lr", "train_lr", "train/learning_rate")
GRAD_NORM_KEYS = ("grad_norm", "train/grad_norm", "grad_norm_total", "grad_2.0_norm_total")


class Logged(NamedTuple):
    loss: Optional[float] = None
    loss_from: Optional[str] = None
    lr: Optional[float] = None
    lr_from: Optional[str] = None
    grad_norm: Optional[float] = None
    grad_norm_from: Optional[str] = None
    step: Optional[int] = None


def get_path(obj: Any, *path: str) -> Any:
    """``obj.a.b``, or None where any step fails (a property that raises, an attribute not set yet)."""
    for attribute in path:
        try:
            obj = getattr(obj, attribute)
        except Exception:
            return None
        if obj is None:
            return None
    return obj


def plain_float(value: Any) -> Optional[float]:
    """A number (not a bool) as a float; None for anything else (a tensor is not read: it may sync a device)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _int(value: Any) -> Optional[int]:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value \
        and abs(value) != float("inf") else None


def read(torch: Any, name: str, kind: str, trainer: Any) -> Logged:
    """The framework's last logged values and where each was read; NULLs where not kept. Never raises."""
    try:
        if kind == "transformers":
            found = _hf(name, trainer)
        elif kind == "lightning":
            found = _lightning(torch, name, trainer)
        else:
            found = Logged()
        if found.lr is None:
            lr, where = _optimizer_lr(torch, name, kind, trainer)
            found = found._replace(lr=lr, lr_from=where)
        return found
    except Exception:
        return Logged()


def _hf(name: str, trainer: Any) -> Logged:
    history = get_path(trainer, "state", "log_history")
    if not isinstance(history, list):
        return Logged()
    entries = [e for e in history[-HISTORY:] if isinstance(e, dict)]
    newest: Dict[str, Tuple[int, Dict[str, Any]]] = {}
    for back, entry in enumerate(reversed(entries), 1):
        for key in ("loss", "learning_rate", "grad_norm"):
            if key not in newest and plain_float(entry.get(key)) is not None:
                newest[key] = (back, entry)
    out: Dict[str, Any] = {}
    where = "%s.state.log_history[-%d][%r] at step %s"
    if "loss" in newest:
        back, entry = newest["loss"]
        out.update(loss=float(entry["loss"]), loss_from=where % (name, back, "loss", entry.get("step")),
                   step=_int(entry.get("step")))
        for key in ("learning_rate", "grad_norm"):
            if plain_float(entry.get(key)) is not None:
                newest[key] = (back, entry)
    for key, column in (("learning_rate", "lr"), ("grad_norm", "grad_norm")):
        if key in newest:
            back, entry = newest[key]
            out[column] = float(entry[key])
            out[column + "_from"] = where % (name, back, key, entry.get("step"))
    return Logged(**out)


def _keys(metrics: Dict[Any, Any], exact: Tuple[str, ...], named: Any) -> List[Any]:
    keys = list(metrics)[:KEYS_LOOKED]
    return [k for k in exact if k in metrics] + sorted(
        k for k in keys if isinstance(k, str) and k not in exact and named(k))


def _is_loss(key: str) -> bool:
    return "loss" in key and not key.startswith("val")


def _is_lr(key: str) -> bool:
    return key.startswith(("lr-", "lr/")) or key.endswith(("/lr", "_lr")) or "learning_rate" in key


def _is_grad_norm(key: str) -> bool:
    return "grad_norm" in key or (key.startswith("grad_") and key.endswith("_norm_total"))


def _lightning(torch: Any, name: str, trainer: Any) -> Logged:
    step = _int(get_path(trainer, "global_step"))
    out: Dict[str, Any] = {"step": step}
    for attribute in ("callback_metrics", "logged_metrics"):
        if all(column + "_from" in out for column in ("loss", "lr", "grad_norm")):
            break
        metrics = get_path(trainer, "_logger_connector", "_" + attribute)  # what the property returns, as is
        if not isinstance(metrics, dict):
            metrics = get_path(trainer, attribute)  # a Lightning that keeps them elsewhere: the property
        if not isinstance(metrics, dict):
            continue
        for column, exact, named in (("loss", LOSS_KEYS, _is_loss), ("lr", LR_KEYS, _is_lr),
                                     ("grad_norm", GRAD_NORM_KEYS, _is_grad_norm)):
            if column + "_from" in out:
                continue
            for key in _keys(metrics, exact, named)[:4]:
                value = number(torch, metrics.get(key))
                if value is not None or column == "loss":  # a loss on CUDA: named, NULL (as before)
                    out[column], out[column + "_from"] = value, "%s.%s[%r] at global step %s" % (
                        name, attribute, key, step)
                    break
    if "lr_from" not in out:
        out["lr"], out["lr_from"] = _monitor_lr(name, trainer, step)
    return Logged(**out)


def _monitor_lr(name: str, trainer: Any, step: Optional[int]) -> Tuple[Optional[float], Optional[str]]:
    """The last lr a ``LearningRateMonitor`` callback recorded (its ``lrs``: name -> every value, in order)."""
    callbacks = get_path(trainer, "callbacks")
    for index, callback in enumerate(list(callbacks or [])[:32]):
        if type(callback).__name__ != "LearningRateMonitor":
            continue
        lrs = getattr(callback, "lrs", None)
        if not isinstance(lrs, dict):
            continue
        for key in list(lrs)[:KEYS_LOOKED]:
            values = lrs.get(key)
            if isinstance(values, list) and values and plain_float(values[-1]) is not None:
                return float(values[-1]), "%s.callbacks[%d].lrs[%r][-1] (LearningRateMonitor) at global step %s" % (
                    name, index, key, step)
    return None, None


def _optimizer_lr(torch: Any, name: str, kind: str, trainer: Any) -> Tuple[Optional[float], Optional[str]]:
    """The first parameter group's lr of the trainer's first optimizer, as it is now."""
    if kind == "transformers":
        path, optimizer = "optimizer", get_path(trainer, "optimizer")
    else:
        attribute = "optimizers" if kind == "lightning" else "_optimizers"
        listed = get_path(trainer, attribute)
        if not isinstance(listed, (list, tuple)) or not listed:
            return None, None
        path, optimizer = "%s[0]" % attribute, listed[0]
    inner = getattr(optimizer, "optimizer", None)  # accelerate's and Lightning's wrappers
    groups = get_path(inner if inner is not None else optimizer, "param_groups")
    if not isinstance(groups, list) or not groups or not isinstance(groups[0], dict):
        return None, None
    value = number(torch, groups[0].get("lr"))
    if value is None:
        return None, None
    return value, "%s.%s.param_groups[0]['lr'] now (nothing logged one)" % (name, path)
