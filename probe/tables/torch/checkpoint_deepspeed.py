"""A checkpoint of a job that runs under DeepSpeed, from DeepSpeed's own objects.

ZeRO keeps the optimizer's state over a flat partition of the parameters (the torch optimizer inside
steps that, not the module's parameters), so that optimizer's own ``state_dict`` cannot be loaded into
anything but ZeRO. What is saved instead, for each ``DeepSpeedEngine`` found:

* the optimizer: ZeRO's own ``engine.optimizer.state_dict()`` (this rank's partition, as DeepSpeed's
  ``save_checkpoint`` writes it into ``zero_pp_rank_N_*_optim_states.pt``; loaded back with
  ``engine.optimizer.load_state_dict`` in a job of the same world size), objects that
  ``torch.load(weights_only=True)`` cannot read made plain (an enum its value, a dataclass a dict, the
  loss scaler its ``cur_scale``);
* the scheduler: DeepSpeed's (``engine.lr_scheduler``), already found by discovery;
* the step: ``engine.global_steps``, with ``global_samples``, the ZeRO stage and the world size.

``engine.save_checkpoint`` itself is not called: it is collective (``dist.barrier`` and an
``all_reduce`` of the tag on every rank), and a rank reached between two of its own steps may meet the
others inside a step's collectives: called from one rank, or from each rank at a different step, it
would hang or mismatch the job. ZeRO stage 3 is refused: its parameters are partitioned and gathering
them is collective too. Runs in the target; DeepSpeed is never imported (its objects are read).
"""

import dataclasses
import enum
from typing import Any, Dict, List, Optional, Tuple

from probe.errors import BadRequest

__all__ = ["engine_parts", "plain"]


def engine_parts(torch: Any, engines: List[Tuple[str, Any]], optimizers: List[Tuple[str, Any]],
                 fmt: str = "probe") -> Dict[str, Any]:
    """For the engines whose torch optimizer is among ``optimizers``: ``{"optimizers": {name: ZeRO's
    state_dict}, "step": int or None, "deepspeed": {name: facts}}``; empty dicts where none is. The hf
    and lightning formats (``fmt``) are refused: they have no place for ZeRO's partition."""
    if fmt != "probe":
        raise BadRequest("the %s format cannot hold a DeepSpeed job's optimizer (ZeRO's partition of it)" % fmt,
                         hint="save in probe's format (the default), or call engine.save_checkpoint in the program")
    out: Dict[str, Any] = {"optimizers": {}, "step": None, "deepspeed": {}}
    names = {id(o): n for n, o in optimizers}
    for name, engine in engines:
        wrapper = _own(engine, "optimizer")
        inner = _own(wrapper, "optimizer") if wrapper is not None else None
        stage = _stage(engine)
        if stage is not None and stage >= 3:
            raise BadRequest("%s runs ZeRO stage 3: its parameters are partitioned over the ranks, and gathering "
                             "them (as DeepSpeed's save_checkpoint does) is a collective that probe does not start "
                             "from one rank" % name,
                             hint="call %s.save_checkpoint(DIR) on every rank in the program" % name)
        facts = {"zero_stage": stage, "global_steps": _int(_own(engine, "global_steps")),
                 "global_samples": _int(_own(engine, "global_samples")),
                 "world_size": _int(_own(engine, "world_size")), "optimizer": None}
        key = names.get(id(inner)) if inner is not None else None
        if key is not None and wrapper is not inner and callable(getattr(type(wrapper), "state_dict", None)):
            with torch.no_grad():
                out["optimizers"][key] = plain(torch, wrapper.state_dict())
            facts["optimizer"] = "%s.%s" % (type(wrapper).__module__, type(wrapper).__qualname__)
        if out["step"] is None:
            out["step"] = facts["global_steps"]
        out["deepspeed"][name] = facts
    return out


def plain(torch: Any, value: Any, depth: int = 0) -> Any:
    """``value`` with what ``torch.load(weights_only=True)`` cannot read made plain (see the module's doc)."""
    if depth > 12:
        return None
    if value is None or isinstance(value, (bool, int, float, str, bytes)) and not isinstance(value, enum.Enum):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: plain(torch, v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(torch, v, depth + 1) for v in value]
    if isinstance(value, torch.Size):
        return list(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(torch, getattr(value, f.name, None), depth + 1) for f in dataclasses.fields(value)}
    scale = _own(value, "cur_scale")  # a loss scaler
    return scale if isinstance(scale, (int, float)) else None


def _stage(engine: Any) -> Optional[int]:
    try:
        return int(engine.zero_optimization_stage())
    except Exception:
        return None


def _own(value: Any, name: str) -> Any:
    try:
        return object.__getattribute__(value, "__dict__").get(name)
    except Exception:
        return None


def _int(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
