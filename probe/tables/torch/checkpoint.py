"""Save the target's models, optimizers, LR schedulers, trainer progress and RNG states, atomically, from inside it.

What is saved is what :mod:`probe.tables.torch.discovery` finds (or what ``--model``/``--optimizer``
name, as expressions in ``__main__``, in the frame ``--frame`` names, or else where the program's
own frames define them): the user's module, never a DDP / FSDP / compile wrapper (state dict keys
without ``module.``), each optimizer once (an ``AcceleratedOptimizer`` is saved as the optimizer
inside), the schedulers that drive those optimizers, and a Hugging Face, Lightning or accelerate
trainer's progress (global step, epoch).

Three formats:

* ``probe`` (the default): one file, loadable with ``torch.load(path)`` (``weights_only`` included)::

    {"format": "probe.checkpoint/1", "models": {name: state_dict}, "optimizers": {name: state_dict},
     "schedulers": {name: state_dict}, "trainer": {"name", "kind", "global_step", "epoch", "max_steps",
     "state"?} or None, "dtensors": {"models/NAME/KEY": {"placements", "global_shape", "mesh"}}, "step",
     "step_source", "rng": {"torch", "cuda"?, "numpy"?, "python"?}, "meta": {rank, world_size, pid, host,
     time, torch}}

* ``hf``: a directory that ``transformers.Trainer.train(resume_from_checkpoint=DIR)`` resumes from:
  ``pytorch_model.bin`` (the model's state dict), ``config.json`` (where the model has a config),
  ``optimizer.pt``, ``scheduler.pt``, ``trainer_state.json`` and ``rng_state.pth`` (``rng_state_RANK.pth``
  under several ranks), with the names transformers 4 and 5 read;
* ``lightning``: the dict Lightning's own ``Trainer.save_checkpoint`` writes (built by the trainer's
  checkpoint connector, without its barrier), which ``Trainer.fit(ckpt_path=PATH)`` resumes from.

Every file is written as ``.NAME.probe-PID-XXXX.tmp`` beside it, flushed and fsynced, then renamed
over ``NAME`` and the directory fsynced: a crash at any moment leaves either the old file or the new
one, never a truncated one. Leftover temporary files of dead processes are removed by the next
checkpoint into that directory.

When it is taken: in two moves on the training thread. Right after an optimizer step (torch's global
post-step hook) the RNG states are read; the rest is read and written right before the next step
begins (a global pre-step hook of ours, installed then from that same thread), when the loop has
stepped its scheduler and counted the step: model, optimizer, scheduler and step count are of one
step, as the framework's own checkpoint at that step would hold them. The loop waits meanwhile.
Where the next step does not begin within :data:`NEXT_STEP_WAIT_S` (the last step, an evaluation),
the agent writes it from its own thread and the next step, should it begin, waits for the save. A job
that makes no step within seconds (hung) is saved concurrently, its state not changing; so is one
asked with ``--concurrent``, where a step that runs during the save may show in some tensors.

What it never does: issue a collective (a DTensor is saved as this rank's local shard, its placements
recorded), run ``state_dict`` hooks in the probe and hf formats (FSDP2's would reshard the model under
the training thread), or bring torch or a framework in (the target must have imported them).
"""

import hashlib
import json
import os
import socket
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from probe.errors import BadRequest, Busy, NotFound
from probe.tables.torch._common import is_dtensor, torch_or_raise
from probe.tables.torch.discovery import found, resolve_expression, unwrap_module, unwrap_optimizer
from probe.tables.torch.checkpoint_deepspeed import engine_parts
from probe.tables.torch.checkpoint_hf import constant_schedule, hf_rng, hf_trainer_state
from probe.tables.torch.checkpoint_timing import NEXT_STEP_WAIT_S, BetweenSteps, at_next_step, in_worker
from probe.tables.torch.trainer import accelerate_step

__all__ = ["save", "expand_path", "DEFAULT_TIMEOUT_S", "FORMAT", "FORMATS", "NEXT_STEP_WAIT_S"]

DEFAULT_TIMEOUT_S = 300.0
FORMAT = "probe.checkpoint/1"
FORMATS = ("probe", "hf", "lightning")
_STEP_NAMES = ("global_step", "step", "iteration", "iter_num")
_busy = threading.Lock()


class _Cancelled(Exception):
    """The request gave up (its time limit passed): stop writing, remove the temporary file."""


def save(path: str, models: Optional[Sequence[str]] = None, optimizers: Optional[Sequence[str]] = None,
         timeout: float = DEFAULT_TIMEOUT_S, between_steps: Optional[BetweenSteps] = None, scope: Any = None,
         fmt: str = "probe", overwrite: bool = False, save_id: str = "") -> Dict[str, Any]:
    """Write the checkpoint; what it holds, its path, size and sha256, and how it was taken. One at a time.

    ``between_steps`` (the agent's placement of work right after the next optimizer step) has it
    taken between two steps (see the module's doc); it answers (None, why) when no step came soon (a
    hung job, no optimizer): the checkpoint is then written concurrently, as it is without
    ``between_steps``. ``taken`` says which. ``scope``: the frame (``probe.agent.frames.Scope``) whose
    names ``models``/``optimizers`` use. ``fmt``: one of :data:`FORMATS`. ``overwrite``: replace a
    checkpoint at ``path`` (never anything else; see ``probe.tables.torch.checkpoint_files``); ``save_id``:
    the same for every rank of one save (hf's directory is theirs whichever rank made it).
    """
    torch_or_raise()
    if fmt not in FORMATS:
        raise BadRequest("the format is one of %s, not %r" % (", ".join(FORMATS), fmt))
    if not _busy.acquire(blocking=False):
        raise Busy("a checkpoint is being written in this process already", hint="wait for it to finish")
    try:
        from probe.tables.torch.checkpoint_files import check_target

        # A path refused is refused now, not after the wait for the next step (2 s in an idle job); _save
        # checks again, as the path may change meanwhile.
        check_target(expand_path(path), overwrite, directory=fmt == "hf")

        def work(cancel: threading.Event, rng: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
            return _save(path, models, optimizers, scope, fmt, cancel, rng, overwrite, save_id)

        taken = "concurrently with the training loop (as asked)"
        if between_steps is not None:
            done, why = at_next_step(between_steps, work, _rng_states, timeout)
            if done is not None:
                return done
            taken = "concurrently with the training loop: %s" % why
        return dict(in_worker(work, timeout), taken=taken)
    finally:
        _busy.release()


# -- what is saved -----------------------------------------------------------------------------------

class _Plan:
    """The objects to save, with their names."""

    def __init__(self) -> None:
        self.models: List[Tuple[str, Any]] = []
        self.optimizers: List[Tuple[str, Any]] = []
        self.schedulers: List[Tuple[str, Any]] = []
        self.trainer: Optional[Tuple[str, str, Any]] = None
        self.engines: List[Tuple[str, Any]] = []  # DeepSpeed's: see probe.tables.torch.checkpoint_deepspeed


def _plan(torch: Any, model_exprs: Optional[Sequence[str]], optimizer_exprs: Optional[Sequence[str]],
          scope: Any) -> _Plan:
    everything = found(torch)
    plan = _Plan()
    plan.trainer = everything.trainers[0] if everything.trainers else None
    plan.engines = everything.engines
    plan.models = _named(torch.nn.Module, model_exprs, everything.models, scope, "model", unwrap_module)
    if not plan.models:
        raise NotFound("no model found in the target (none watched, none in __main__ or one level into it, none in "
                       "the main thread's frames, none in the garbage collector)", hint="name it: --model EXPR "
                       "(e.g. trainer.model; --frame THREAD:FUNC for a function's local), or call "
                       "probe.watch(model, optimizer) in the training script")
    optim = sys.modules.get("torch.optim")
    if optim is not None:
        plan.optimizers = _named(optim.Optimizer, optimizer_exprs, everything.optimizers, scope, "optimizer",
                                 unwrap_optimizer)
    saved = {id(o) for _, o in plan.optimizers}
    plan.schedulers = [(n, s) for n, s in everything.schedulers
                       if id(unwrap_optimizer(getattr(s, "optimizer", None))) in saved]
    return plan


def _named(kind: type, exprs: Optional[Sequence[str]], found_: List[Tuple[str, Any]], scope: Any, what: str,
           unwrap: Callable[[Any], Any]) -> List[Tuple[str, Any]]:
    """The objects named by expressions (each must be a ``kind``; wrappers unwrapped), else those found."""
    if not exprs:
        return list(found_)
    out = []
    for expr in exprs:
        try:
            value = resolve_expression(expr, scope)
        except Exception as exc:
            raise BadRequest("--%s %s: %s: %s" % (what, expr, type(exc).__name__, exc)) from None
        if not isinstance(value, kind):
            raise BadRequest("--%s %s is a %s, not a %s.%s" % (what, expr, type(value).__name__, kind.__module__,
                                                                kind.__qualname__))
        out.append((expr, unwrap(value)))
    return out


def _save(path: str, model_exprs: Optional[Sequence[str]], optimizer_exprs: Optional[Sequence[str]], scope: Any,
          fmt: str, cancel: threading.Event, rng: Optional[Dict[str, Any]] = None,
          overwrite: bool = False, save_id: str = "") -> Dict[str, Any]:
    from probe.tables.torch.checkpoint_files import check_target

    torch = torch_or_raise()
    started = time.monotonic()
    target = expand_path(path)
    check_target(target, overwrite, directory=fmt == "hf")  # before anything is built: a clear refusal at once
    plan = _plan(torch, model_exprs, optimizer_exprs, scope)
    rng = rng if rng is not None else _rng_states(torch)
    progress = _progress(plan.trainer)
    step, step_source = _step(torch, plan.optimizers, progress)
    deepspeed = engine_parts(torch, plan.engines, plan.optimizers, fmt) if plan.engines else None
    if deepspeed and deepspeed["step"] is not None:
        step, step_source = deepspeed["step"], "%s.global_steps" % plan.engines[0][0]
    if fmt == "hf":
        size, digest, files = _write_hf(torch, plan, target, rng, progress, step, cancel, overwrite, save_id)
    elif fmt == "lightning":
        size, digest = _write_lightning(torch, plan, target, cancel, overwrite)
        files = [os.path.basename(target)]
    else:
        size, digest = _write_probe(torch, plan, target, rng, progress, step, step_source, cancel, overwrite,
                                    deepspeed)
        files = [os.path.basename(target)]
    return {"path": target, "format": fmt, "files": files, "bytes": size, "sha256": digest,
            "seconds": round(time.monotonic() - started, 3),
            "models": [{"name": n, "tensors": len(_module_state(m)),
                        "parameters": sum(int(p.numel()) for p in m.parameters())} for n, m in plan.models],
            "optimizers": [{"name": n, "class": type(o).__name__, "param_groups": len(o.param_groups)}
                           for n, o in plan.optimizers],
            "schedulers": [{"name": n, "class": type(s).__name__} for n, s in plan.schedulers],
            "trainer": None if plan.trainer is None else {"name": plan.trainer[0], "kind": plan.trainer[1],
                                                          "global_step": progress.get("global_step"),
                                                          "epoch": progress.get("epoch")},
            "step": step, "step_source": step_source, "rng": sorted(k for k in rng if k != "numpy_state"),
            "dtensors": _count_dtensors(plan), "rank": _rank()}


def _count_dtensors(plan: _Plan) -> int:
    return sum(1 for _, m in plan.models for p in m.parameters() if is_dtensor(p))


def _write_probe(torch: Any, plan: _Plan, target: str, rng: Dict[str, Any], progress: Dict[str, Any],
                 step: Optional[int], step_source: Optional[str], cancel: threading.Event,
                 overwrite: bool = False, deepspeed: Optional[Dict[str, Any]] = None) -> Tuple[int, str]:
    dtensors: Dict[str, Any] = {}
    zero = (deepspeed or {}).get("optimizers") or {}
    state: Dict[str, Any] = {"format": FORMAT, "models": {}, "optimizers": {}, "schedulers": {}, "dtensors": dtensors}
    with torch.no_grad():
        for name, model in plan.models:
            state["models"][name] = _local(_module_state(model), "models/%s" % name, dtensors)
        for name, optimizer in plan.optimizers:
            state["optimizers"][name] = zero[name] if name in zero else \
                _local(optimizer.state_dict(), "optimizers/%s" % name, dtensors)
    if deepspeed:
        state["deepspeed"] = deepspeed["deepspeed"]
    for name, scheduler in plan.schedulers:
        state["schedulers"][name] = _plain(scheduler.state_dict())
    state["trainer"] = None if plan.trainer is None else dict(progress, name=plan.trainer[0], kind=plan.trainer[1])
    state["step"], state["step_source"] = step, step_source
    state["rng"] = {k: v for k, v in rng.items() if k != "numpy_state"}
    state["meta"] = _meta(torch)
    return _write_atomically(torch, state, target, cancel, overwrite)


def _plain(value: Any) -> Any:
    """A state dict with what ``torch.load(weights_only=True)`` cannot read (functions, objects) as None."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if type(value).__module__.startswith("torch") and hasattr(value, "dtype"):
        return value  # a tensor
    return None


def _single(what: str, items: List[Tuple[str, Any]], fmt: str) -> Optional[Tuple[str, Any]]:
    if len(items) > 1:
        raise BadRequest("--format %s saves one %s, and %d were found: %s" % (
            fmt, what, len(items), ", ".join(n for n, _ in items)), hint="name the one to save: --%s EXPR" % what)
    return items[0] if items else None


def _write_hf(torch: Any, plan: _Plan, target: str, rng: Dict[str, Any], progress: Dict[str, Any],
              step: Optional[int], cancel: threading.Event, overwrite: bool = False,
              save_id: str = "") -> Tuple[int, str, List[str]]:
    """The directory ``Trainer.train(resume_from_checkpoint=DIR)`` reads (transformers' own file names)."""
    from probe.tables.torch.checkpoint_files import make_directory

    model = _single("model", plan.models, "hf")
    optimizer = _single("optimizer", plan.optimizers, "hf")
    scheduler = _single("scheduler", plan.schedulers, "hf")
    if optimizer is None:
        raise BadRequest("--format hf needs an optimizer (transformers resumes its state with the scheduler's); "
                         "none was found", hint="name the optimizer with --optimizer EXPR, or save in probe's format")
    if any(is_dtensor(p) for p in model[1].parameters()):
        raise BadRequest("--format hf holds whole tensors, and this model is sharded (DTensor)",
                         hint="save in probe's format, which keeps each rank's shard")
    overwrite = make_directory(target, overwrite, save_id)  # the files of this save's directory are its own
    files: Dict[str, Any] = {}
    with torch.no_grad():
        files["pytorch_model.bin"] = _module_state(model[1])
        files["optimizer.pt"] = optimizer[1].state_dict()
    # transformers loads optimizer.pt only beside a scheduler.pt: a job with no scheduler (a constant lr) gets the
    # state of a constant schedule at each group's lr now, so the optimizer's state resumes too.
    files["scheduler.pt"] = (scheduler[1].state_dict() if scheduler is not None
                             else constant_schedule(torch, optimizer[1], step))
    world = _meta(torch)["world_size"] or 1
    files["rng_state_%d.pth" % _rank() if world > 1 else "rng_state.pth"] = hf_rng(torch, rng)
    total, hashes = 0, hashlib.sha256()
    for name, value in files.items():
        size, digest = _write_atomically(torch, value, os.path.join(target, name), cancel, overwrite)
        total += size
        hashes.update(digest.encode())
    texts = {"trainer_state.json": hf_trainer_state(torch, progress, step)}
    config = getattr(model[1], "config", None)
    if config is not None and callable(getattr(config, "to_json_string", None)):
        texts["config.json"] = config.to_json_string()
    for name, text in texts.items():
        size, digest = _write_text_atomically(text, os.path.join(target, name), cancel, overwrite)
        total += size
        hashes.update(digest.encode())
    return total, hashes.hexdigest(), sorted(list(files) + list(texts))


# Lightning strategies whose checkpoint is built from this process's own state, with no collective: the
# optimizer state of each rank is whole (DDP replicates it). FSDP's and DeepSpeed's gather it.
_LIGHTNING_LOCAL_STRATEGIES = ("SingleDeviceStrategy", "DDPStrategy", "DataParallelStrategy")


def _write_lightning(torch: Any, plan: _Plan, target: str, cancel: threading.Event,
                     overwrite: bool = False) -> Tuple[int, str]:
    if plan.trainer is None or plan.trainer[1] != "lightning":
        raise BadRequest("--format lightning needs a Lightning Trainer, and none was found in the target",
                         hint="save in probe's format (the default)")
    strategy = type(getattr(plan.trainer[2], "strategy", None)).__name__
    if strategy not in _LIGHTNING_LOCAL_STRATEGIES:
        raise BadRequest("--format lightning under Lightning's %s: its checkpoint gathers the optimizer's shards with a "
                         "collective, and probe never issues one on the job's behalf" % strategy,
                         hint="save in probe's format (the default): every rank writes its own part")
    connector = getattr(plan.trainer[2], "_checkpoint_connector", None)
    dump = getattr(connector, "dump_checkpoint", None)
    if dump is None:
        raise BadRequest("this Lightning Trainer has no checkpoint connector probe knows (dump_checkpoint)")
    return _write_atomically(torch, dump(weights_only=False), target, cancel, overwrite)


# -- trainer progress --------------------------------------------------------------------------------

def _progress(trainer: Optional[Tuple[str, str, Any]]) -> Dict[str, Any]:
    """global_step, epoch, max_steps of the trainer found, and (transformers) its whole TrainerState."""
    if trainer is None:
        return {}
    _, kind, obj = trainer
    out: Dict[str, Any] = {}
    try:
        if kind == "transformers":
            state = getattr(obj, "state", None)
            out = {"global_step": getattr(state, "global_step", None), "epoch": getattr(state, "epoch", None),
                   "max_steps": getattr(state, "max_steps", None)}
            whole = _hf_state_dict(obj, state)
            if whole is not None:
                out["state"] = whole
        elif kind == "lightning":
            out = {"global_step": obj.global_step, "epoch": obj.current_epoch, "max_steps": obj.max_steps}
        elif kind == "accelerate":  # Accelerator.step counts micro-batches, not steps: see accelerate_step
            global_step, source = accelerate_step(obj)
            out = {"global_step": global_step, "epoch": None, "max_steps": None, "step_source": source}
    except Exception:
        pass
    return {k: (v if isinstance(v, (int, float, str, dict)) or v is None else None) for k, v in out.items()}


def _hf_state_dict(trainer: Any, state: Any) -> Optional[Dict[str, Any]]:
    """The TrainerState as transformers writes it to trainer_state.json, stateful callbacks brought up to date."""
    import dataclasses

    if state is None or not dataclasses.is_dataclass(state):
        return None
    whole = json.loads(json.dumps(dataclasses.asdict(state), default=lambda v: None))
    callbacks = list(getattr(getattr(trainer, "callback_handler", None), "callbacks", []) or [])
    control = getattr(trainer, "control", None)
    stateful = whole.get("stateful_callbacks")
    if isinstance(stateful, dict):
        for callback in callbacks + ([control] if control is not None else []):
            if type(callback).__name__ in stateful and callable(getattr(callback, "state", None)):
                try:
                    stateful[type(callback).__name__] = json.loads(json.dumps(callback.state(), default=lambda v: None))
                except Exception:
                    pass
    return whole


# -- files -------------------------------------------------------------------------------------------

def expand_path(path: str) -> str:
    """``{rank}`` -> this process's rank (torch.distributed's, else $RANK, else 0); absolute, ``~`` expanded."""
    if not isinstance(path, str) or not path.strip():
        raise BadRequest("give the checkpoint's path")
    return os.path.abspath(os.path.expanduser(path.replace("{rank}", str(_rank()))))


def _rank() -> int:
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _module_state(model: Any) -> Dict[str, Any]:
    """``model.state_dict()`` without its hooks: each module's own ``_save_to_state_dict`` (parameters,
    persistent buffers, extra state), detached. FSDP2's pre-hook would reshard the model in place
    while the training thread may be using it."""
    from collections import OrderedDict

    out: Dict[str, Any] = OrderedDict()
    for prefix, module in model.named_modules(remove_duplicate=False):
        module._save_to_state_dict(out, prefix + "." if prefix else "", False)
    return out


def _local(value: Any, where: str, dtensors: Dict[str, Any]) -> Any:
    """``value`` with every DTensor replaced by its local shard (a detached tensor), recorded in ``dtensors``."""
    if is_dtensor(value):
        mesh = value.device_mesh
        dtensors[where] = {"placements": str(tuple(value.placements)), "global_shape": list(value.shape),
                           "local_shape": list(value._local_tensor.shape), "mesh": str(mesh.mesh.tolist()),
                           "mesh_dim_names": list(mesh.mesh_dim_names or ())}
        return value._local_tensor.detach()
    if isinstance(value, dict):
        items = [(k, _local(v, "%s/%s" % (where, k), dtensors)) for k, v in value.items()]
        return dict(items) if type(value) is not dict and not hasattr(value, "move_to_end") else type(value)(items)
    if isinstance(value, list):
        return [_local(v, "%s/%d" % (where, i), dtensors) for i, v in enumerate(value)]
    return value


def _step(torch: Any, optimizers: List[Tuple[str, Any]],
          progress: Dict[str, Any]) -> Tuple[Optional[int], Optional[str]]:
    """The training step: the trainer's global step, else an int global of ``__main__`` (global_step,
    step, ...), else the optimizers' own."""
    if isinstance(progress.get("global_step"), int):
        return progress["global_step"], progress.get("step_source") or "trainer global_step"
    main = vars(sys.modules["__main__"])
    for name in _STEP_NAMES:
        value = main.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value, "__main__.%s" % name
    best = None
    for name, optimizer in optimizers:
        for entry in list(optimizer.state.values()):
            value = entry.get("step") if isinstance(entry, dict) else None
            if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.numel() == 1:
                value = float(value)
            if isinstance(value, (int, float)):
                best = (int(value), "%s.state[*]['step']" % name) if best is None or value > best[0] else best
    return best if best is not None else (None, None)


def _rng_states(torch: Any) -> Dict[str, Any]:
    """Generator states of torch (CPU; CUDA where initialised), numpy and random, where loaded. numpy's
    is kept twice: as plain values (``numpy``, for probe's format) and as its own tuple (``numpy_state``,
    for transformers'); the latter never goes into probe's file."""
    out: Dict[str, Any] = {"torch": torch.get_rng_state()}
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        out["cuda"] = cuda.get_rng_state_all()  # the generators' seeds and offsets, held on the host
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state = numpy.random.get_state()
        kind, keys, pos, has_gauss, cached = state
        out["numpy"] = {"bit_generator": str(kind), "keys": torch.tensor(keys.tolist(), dtype=torch.int64),
                        "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
        out["numpy_state"] = state
    random = sys.modules.get("random")
    if random is not None:
        out["python"] = random.getstate()
    return out


def _meta(torch: Any) -> Dict[str, Any]:
    dist = sys.modules.get("torch.distributed")
    world = None
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            world = int(dist.get_world_size())
    except Exception:
        pass
    return {"rank": _rank(), "world_size": world, "pid": os.getpid(), "host": socket.gethostname(),
            "time": time.time(), "torch": str(torch.__version__)}


class _HashingWriter:
    """The file object torch.save writes to: straight to the descriptor, hashing and counting as it goes."""

    def __init__(self, fd: int, cancel: threading.Event) -> None:
        self._fd = fd
        self._cancel = cancel
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        if self._cancel.is_set():
            raise _Cancelled()
        view = memoryview(data).cast("B")
        self.sha.update(view)
        done = 0
        while done < len(view):
            done += os.write(self._fd, view[done:])
        self.size += done
        return done

    def flush(self) -> None:
        pass


def _write_atomically(torch: Any, state: Dict[str, Any], target: str, cancel: threading.Event,
                      overwrite: bool = False) -> Tuple[int, str]:
    """``state`` saved with ``torch.save`` to ``target``: (bytes, sha256)."""
    return _write_file_atomically(lambda writer: torch.save(state, writer), target, cancel, overwrite)


def _write_text_atomically(text: str, target: str, cancel: threading.Event, overwrite: bool = False) -> Tuple[int, str]:
    """A small text file (JSON), written as the state files are."""
    data = text.encode("utf-8")
    return _write_file_atomically(lambda writer: writer.write(data), target, cancel, overwrite)


def _write_file_atomically(write: Callable[["_HashingWriter"], Any], target: str, cancel: threading.Event,
                           overwrite: bool = False) -> Tuple[int, str]:
    """``write(writer)`` into a temporary file beside ``target``, fsynced, then named ``target``
    (``probe.tables.torch.checkpoint_files``: no link followed, nothing replaced unless ``overwrite``):
    a reader sees the old file or the whole new one, never a part. (bytes, sha256 of them)."""
    from probe.tables.torch.checkpoint_files import write_file_atomically

    def into(fd: int) -> "_HashingWriter":
        writer = _HashingWriter(fd, cancel)
        write(writer)
        return writer

    writer = write_file_atomically(into, target, overwrite)
    return writer.size, writer.sha.hexdigest()
