"""What ``probe T checkpoint -F hf`` writes beside the tensors so that transformers' ``Trainer`` resumes from it:
its RNG file, its ``trainer_state.json``, and a scheduler state where the job has no scheduler.

transformers reads these with its own expectations: it loads ``optimizer.pt`` only beside a ``scheduler.pt``, and
its resume checks ``train_batch_size`` and the logging/eval/save intervals of ``trainer_state.json`` (a missing
one ends the resume in a TypeError). A job trained by a hand-written loop has none of them, so they are made here
from what the job does have. Runs in the target; never imports transformers.
"""

import json
import sys
from typing import Any, Dict, Iterator, Optional

from probe.tables.torch.discovery import user_frame_scopes

__all__ = ["constant_schedule", "hf_rng", "hf_trainer_state"]

# TrainerState's fields with its defaults (transformers 4.x-5.x), for a job that has no TrainerState of its own.
_STATE_DEFAULTS: Dict[str, Any] = {
    "epoch": 0, "global_step": 0, "max_steps": 0, "logging_steps": 500, "eval_steps": 500, "save_steps": 500,
    "train_batch_size": None, "num_train_epochs": 0, "num_input_tokens_seen": 0, "total_flos": 0,
    "log_history": [], "best_metric": None, "best_global_step": None, "best_model_checkpoint": None,
    "is_local_process_zero": True, "is_world_process_zero": True, "is_hyper_param_search": False,
    "trial_name": None, "trial_params": None, "stateful_callbacks": {},
}


def constant_schedule(torch: Any, optimizer: Any, step: Optional[int]) -> Dict[str, Any]:
    """The state_dict of ``LambdaLR(lambda step: 1.0)`` over ``optimizer``'s groups at their lr now, ``step`` steps
    in: built on a stand-in optimizer, so the job's own is not touched (a scheduler sets initial_lr on it)."""
    lrs = [float(group["lr"]) for group in optimizer.param_groups]
    stand_in = torch.optim.SGD([{"params": [torch.zeros(1)], "lr": lr} for lr in lrs])
    schedule = torch.optim.lr_scheduler.LambdaLR(stand_in, lambda _: 1.0)
    schedule.last_epoch = step or 0
    schedule._step_count = (step or 0) + 1
    return schedule.state_dict()


def hf_rng(torch: Any, rng: Dict[str, Any]) -> Dict[str, Any]:
    """The RNG states under transformers' keys (numpy's as numpy's own tuple, as transformers saves it)."""
    out: Dict[str, Any] = {"cpu": rng["torch"]}
    if "python" in rng:
        out["python"] = rng["python"]
    if "numpy_state" in rng:
        out["numpy"] = rng["numpy_state"]
    if "cuda" in rng:
        out["cuda"] = rng["cuda"]
    return out


def hf_trainer_state(torch: Any, progress: Dict[str, Any], step: Optional[int]) -> str:
    """The Trainer's own state where the job runs one; else TrainerState's defaults at ``step``, with the batch
    size of the job's one DataLoader (left null where there is not exactly one: the resume then says so)."""
    state = progress.get("state")
    if not isinstance(state, dict):
        state = dict(_STATE_DEFAULTS, global_step=step or 0, epoch=progress.get("epoch") or 0,
                     max_steps=progress.get("max_steps") or 0, train_batch_size=_batch_size(torch))
    return json.dumps(state, indent=2, sort_keys=True) + "\n"


def _batch_size(torch: Any) -> Optional[int]:
    """The batch size of the DataLoaders in ``__main__`` and the main thread's own frames, where they agree."""
    loader = getattr(getattr(torch, "utils", None), "data", None)
    kind = getattr(loader, "DataLoader", None)
    if kind is None:
        return None
    sizes = {value.batch_size for value in _namespace_values() if isinstance(value, kind)
             and isinstance(getattr(value, "batch_size", None), int)}
    return sizes.pop() if len(sizes) == 1 else None


def _namespace_values() -> Iterator[Any]:
    main = sys.modules.get("__main__")
    if main is not None:
        yield from list(vars(main).values())
    for _, locals_ in user_frame_scopes():
        yield from list(locals_.values())
