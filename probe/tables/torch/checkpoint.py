"""Save the target's models, optimizers, step and RNG states to one file, atomically, from inside it.

The file is written as ``.NAME.probe-PID-XXXX.tmp`` in the destination's directory, flushed and fsynced,
then renamed over ``NAME`` and the directory fsynced: a crash at any moment leaves either the old file
or the new one at ``NAME``, never a truncated one. Leftover temporary files of dead processes are
removed by the next checkpoint into that directory.

What it never does: issue a collective (a DTensor is saved as this rank's local shard, its placements
recorded), run ``state_dict`` hooks (FSDP2's would reshard the model under the training thread), or
bring torch in (the target must have imported it). By default the agent has it written right after the next optimizer
step, on the training thread (the loop waits): every tensor is of the same step. A job that makes no
step within seconds (hung) is saved concurrently, its state not changing; so is one asked with
``--concurrent``, where a step that runs during the save may show in some tensors.

File layout (loadable with ``torch.load(path)``, ``weights_only`` included)::

    {"format": "probe.checkpoint/1", "models": {name: state_dict}, "optimizers": {name: state_dict},
     "dtensors": {"models/NAME/KEY": {"placements", "global_shape", "mesh"}}, "step", "step_source",
     "rng": {"torch", "cuda"?, "numpy"?, "python"?}, "meta": {rank, world_size, pid, host, time, torch}}
"""

import glob
import hashlib
import os
import re
import secrets
import socket
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from probe.errors import BadRequest, Busy, NotFound, ProbeError, Timeout
from probe.tables.torch._common import is_dtensor, torch_or_raise
from probe.tables.torch.discovery import find_models, find_optimizers, main_expression
from probe._threads import daemon_thread

#: Runs ``work(cancel)`` right after the next optimizer step: (its result, "") or (None, why it did not).
BetweenSteps = Callable[[Callable[[threading.Event], Dict[str, Any]], float], Tuple[Optional[Dict[str, Any]], str]]

__all__ = ["save", "expand_path", "DEFAULT_TIMEOUT_S", "FORMAT"]

DEFAULT_TIMEOUT_S = 300.0
FORMAT = "probe.checkpoint/1"
_STEP_NAMES = ("global_step", "step", "iteration", "iter_num")
_busy = threading.Lock()


class _Cancelled(Exception):
    """The request gave up (its time limit passed): stop writing, remove the temporary file."""


def save(path: str, models: Optional[Sequence[str]] = None, optimizers: Optional[Sequence[str]] = None,
         timeout: float = DEFAULT_TIMEOUT_S, between_steps: Optional[BetweenSteps] = None) -> Dict[str, Any]:
    """Write the checkpoint; what it holds, its path, size and sha256, and how it was taken. One at a time.

    ``between_steps`` (the agent's placement of a snippet right after the next optimizer step) writes
    it on the training thread between two steps, so no tensor is from another step than the others;
    the loop waits meanwhile. It answers (None, why) when no step came soon (a hung job, no optimizer):
    the checkpoint is then written concurrently, as it is without ``between_steps``. ``taken`` says which.
    """
    torch_or_raise()
    if not _busy.acquire(blocking=False):
        raise Busy("a checkpoint is being written in this process already", hint="wait for it to finish")
    try:
        work = lambda cancel: _save(path, models, optimizers, cancel)  # noqa: E731
        taken = "concurrently with the training loop (as asked)"
        if between_steps is not None:
            try:
                done, why = between_steps(work, timeout)
            except Timeout:
                raise Timeout("the checkpoint did not finish within %.0f s; it was stopped and its temporary file "
                              "removed" % timeout, hint="give it longer with --checkpoint-timeout") from None
            if done is not None:
                return dict(done, taken="between optimizer steps (the training loop waited while it was written)")
            taken = "concurrently with the training loop: %s" % why
        return dict(_in_worker(work, timeout), taken=taken)
    finally:
        _busy.release()


def _in_worker(work: Any, timeout: float) -> Dict[str, Any]:
    """Run ``work`` on its own thread; past ``timeout`` tell it to stop and answer ``Timeout``."""
    cancel = threading.Event()
    result: Dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = work(cancel)
        except BaseException as exc:  # reported to the request below; never into the target
            result["error"] = exc

    worker = daemon_thread(run, "probe-checkpoint")
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        cancel.set()  # checked at every write: a writing save stops within one write() call
        worker.join(2.0)
        raise Timeout("the checkpoint did not finish within %.0f s; it was stopped and its temporary file "
                      "removed%s" % (timeout, "" if not worker.is_alive() else " (it is still inside a call that "
                                     "cannot be stopped; the file it was writing is removed when it returns)"),
                      hint="give it longer with --checkpoint-timeout")
    error = result.get("error")
    if isinstance(error, ProbeError):
        raise error
    if isinstance(error, OSError):
        raise BadRequest("cannot write the checkpoint: %s" % error) from None
    if error is not None:
        raise error
    return result["value"]


def _save(path: str, model_exprs: Optional[Sequence[str]], optimizer_exprs: Optional[Sequence[str]],
          cancel: threading.Event) -> Dict[str, Any]:
    torch = torch_or_raise()
    started = time.monotonic()
    target = expand_path(path)
    directory = os.path.dirname(target)
    if not os.path.isdir(directory):
        raise BadRequest("the directory %s does not exist (in the target's file system)" % directory)
    models = _named(torch.nn.Module, model_exprs, find_models, torch, "model")
    if not models:
        raise NotFound("no model found in the target (none watched, none in __main__ or one level into it, none "
                       "in the garbage collector)", hint="name it: --model EXPR (e.g. trainer.model), or call "
                       "probe.watch(model, optimizer) in the training script")
    optim = sys.modules.get("torch.optim")
    optimizers = _named(optim.Optimizer, optimizer_exprs, find_optimizers, torch, "optimizer") if optim else []
    dtensors: Dict[str, Any] = {}
    state: Dict[str, Any] = {"format": FORMAT, "models": {}, "optimizers": {}, "dtensors": dtensors}
    with torch.no_grad():
        for name, model in models:
            state["models"][name] = _local(_module_state(model), "models/%s" % name, dtensors)
        for name, optimizer in optimizers:
            state["optimizers"][name] = _local(optimizer.state_dict(), "optimizers/%s" % name, dtensors)
    state["step"], state["step_source"] = _step(torch, optimizers)
    state["rng"] = _rng_states(torch)
    state["meta"] = _meta(torch)
    size, digest = _write_atomically(torch, state, target, cancel)
    return {"path": target, "bytes": size, "sha256": digest, "seconds": round(time.monotonic() - started, 3),
            "models": [{"name": n, "tensors": len(state["models"][n]),
                        "parameters": sum(int(p.numel()) for p in m.parameters())} for n, m in models],
            "optimizers": [{"name": n, "class": type(o).__name__, "param_groups": len(o.param_groups)}
                           for n, o in optimizers],
            "step": state["step"], "step_source": state["step_source"], "rng": sorted(state["rng"]),
            "dtensors": len(dtensors), "rank": state["meta"]["rank"]}


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


def _named(kind: type, exprs: Optional[Sequence[str]], find: Any, torch: Any, what: str) -> List[Tuple[str, Any]]:
    """The objects named by expressions in ``__main__`` (each must be a ``kind``), else those found."""
    if not exprs:
        return list(find(torch))
    out = []
    for expr in exprs:
        try:
            value = main_expression(expr)
        except Exception as exc:
            raise BadRequest("--%s %s: %s: %s" % (what, expr, type(exc).__name__, exc)) from None
        if not isinstance(value, kind):
            raise BadRequest("--%s %s is a %s, not a %s.%s" % (what, expr, type(value).__name__, kind.__module__,
                                                                kind.__qualname__))
        out.append((expr, value))
    return out


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


def _step(torch: Any, optimizers: List[Tuple[str, Any]]) -> Tuple[Optional[int], Optional[str]]:
    """The training step: an int global of ``__main__`` (global_step, step, ...), else the optimizers' own."""
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
    """Generator states of torch (CPU; CUDA where initialised), numpy and random, where loaded."""
    out: Dict[str, Any] = {"torch": torch.get_rng_state()}
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        out["cuda"] = cuda.get_rng_state_all()  # the generators' seeds and offsets, held on the host
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        out["numpy"] = {"bit_generator": str(kind), "keys": torch.tensor(keys.tolist(), dtype=torch.int64),
                        "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
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


def _write_atomically(torch: Any, state: Dict[str, Any], target: str, cancel: threading.Event) -> Tuple[int, str]:
    directory, name = os.path.split(target)
    _remove_leftovers(directory, name)
    tmp = os.path.join(directory, ".%s.probe-%d-%s.tmp" % (name, os.getpid(), secrets.token_hex(4)))
    # Owner-only, whatever the umask: a checkpoint holds the weights, and probe writes it on the user's behalf.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        writer = _HashingWriter(fd, cancel)
        torch.save(state, writer)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink(tmp)
        raise
    os.close(fd)
    try:
        os.replace(tmp, target)
    except BaseException:
        _unlink(tmp)
        raise
    _fsync_dir(directory)
    return writer.size, writer.sha.hexdigest()


def _remove_leftovers(directory: str, name: str) -> None:
    """Temporary files of earlier checkpoints to ``name`` whose process is gone (it crashed mid-write)."""
    pattern = re.compile(r"^\.%s\.probe-(\d+)-[0-9a-f]{8}\.tmp$" % re.escape(name))
    for path in glob.glob(os.path.join(glob.escape(directory), ".%s.probe-*.tmp" % glob.escape(name))):
        match = pattern.match(os.path.basename(path))
        if match and not os.path.exists("/proc/%s" % match.group(1)):
            _unlink(path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
