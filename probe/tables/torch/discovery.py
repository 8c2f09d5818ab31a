"""Finding the models (root ``torch.nn.Module``\\s), optimizers, LR schedulers and trainers of the target.

Sources, in order of trust:

1. registered: ``probe.watch(model, optimizer, name=obj, ...)`` in the training script (weak
   references: watching keeps nothing alive, and imports no torch);
2. the ``__main__`` namespace, and one level into what it holds (``trainer.model``, ``models[0]``,
   ``nets["gen"]``);
3. the local variables of the main thread's frames of the program's own code (a ``trainer`` built
   inside ``main()``, as Hugging Face's example scripts do; library frames and ``self`` are passed
   over, their objects are reached through the trainer). An object several frames hold is named by
   the outermost of them, the frame that lives longest, so names do not change as the stack moves;
   ``--model EXPR`` is resolved in the innermost frame that defines its first name;
4. the garbage collector, only when 1 to 3 found nothing of that kind (``probe.tables.tracked``).

Training frameworks are recognised by the names of their classes, never by importing them: a
Hugging Face ``transformers.Trainer`` (and subclasses), a Lightning ``Trainer`` or ``LightningModule``
(whose trainer it reaches), an ``accelerate.Accelerator``. Each yields its model, optimizers and
schedulers under their attribute paths (``trainer.model``, ``trainer.optimizer``,
``trainer.lr_scheduler``). Wrappers are folded into what they wrap: a DDP / DataParallel / FSDP /
DeepSpeed / ``torch.compile`` / Lightning / Fabric module wrapper into the user's module, an
``AcceleratedOptimizer`` or ``LightningOptimizer`` into the optimizer inside, an
``AcceleratedScheduler`` into its scheduler; each object is listed once, under the name of its most
trusted source. Modules without parameters and buffers (activation instances, metrics) are skipped,
and only roots are kept. Names: the name given to ``watch``, else the expression that reaches the
object, else (garbage collector) its class name, numbered where several share one.
"""

import gc
import os
import sys
import sysconfig
import threading
import weakref
from typing import Any, Dict, Iterable, List, Optional, Tuple

from probe.tables.tracked import tracked_of

__all__ = ["watch", "user_frame_scopes", "unwatch", "find_models", "find_optimizers", "find_schedulers", "find_trainers", "found", "trainer_objects",
           "main_expression", "resolve_expression", "trainer_kind", "unwrap_module", "unwrap_optimizer",
           "deepspeed_engine", "deepspeed_scheduler", "Found"]

_MAX_MEMBERS = 256  # attributes or items looked at in each object of __main__ or of a frame
_MAX_FRAMES = 200

_lock = threading.Lock()
_watched: List[Tuple[str, "weakref.ReferenceType[Any]"]] = []
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Module wrappers: class name -> the attribute holding the wrapped module (matched on the class and its bases).
_MODULE_WRAPPERS = {
    "DistributedDataParallel": "module", "DataParallel": "module", "FullyShardedDataParallel": "module",
    "DeepSpeedEngine": "module", "OptimizedModule": "_orig_mod", "_FabricModule": "_original_module",
    "_LightningModuleWrapperBase": "_forward_module", "LightningDistributedModule": "_forward_module",
}
_OPTIMIZER_WRAPPERS = ("optimizer", "_optimizer")  # AcceleratedOptimizer.optimizer, LightningOptimizer._optimizer
# DeepSpeed's schedulers (deepspeed.runtime.lr_schedules): not torch's classes, told apart by name and package.
DEEPSPEED_SCHEDULERS = ("WarmupDecayLR", "WarmupLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


def watch(*objects: Any, **named: Any) -> None:
    """Tell probe which models and optimizers this program trains: ``probe.watch(model, optimizer)``.

    Keyword arguments name them (``probe.watch(gen=g, disc=d)``); otherwise the name is the global of
    ``__main__`` that holds the object, or its class. Only weak references are kept.
    """
    items = [(_global_name(obj) or type(obj).__name__, obj) for obj in objects] + list(named.items())
    with _lock:
        alive = [(n, r) for n, r in _watched if r() is not None]
        for name, obj in items:
            if not any(r() is obj for _, r in alive):
                alive.append((name, weakref.ref(obj)))
        _watched[:] = alive


def unwatch(*objects: Any) -> None:
    """Forget objects given to :func:`watch` (all of them when none is given)."""
    with _lock:
        _watched[:] = [(n, r) for n, r in _watched if objects and r() is not None
                       and not any(r() is obj for obj in objects)]


class Found:
    """What one search found: (name, object) lists of each kind, and trainers as (name, kind, object)."""

    def __init__(self) -> None:
        self.models: List[Tuple[str, Any]] = []
        self.optimizers: List[Tuple[str, Any]] = []
        self.schedulers: List[Tuple[str, Any]] = []
        self.trainers: List[Tuple[str, str, Any]] = []
        self.engines: List[Tuple[str, Any]] = []  # DeepSpeed engines, which hold the three above


def find_models(torch: Any) -> List[Tuple[str, Any]]:
    """(name, module) for every root model found (unwrapped, with parameters or buffers), in the order of trust."""
    return found(torch).models


def find_optimizers(torch: Any) -> List[Tuple[str, Any]]:
    """(name, optimizer) for every ``torch.optim.Optimizer`` found (wrappers folded into what they wrap)."""
    return found(torch).optimizers


def find_schedulers(torch: Any) -> List[Tuple[str, Any]]:
    """(name, scheduler) for every LR scheduler found (``torch.optim.lr_scheduler.LRScheduler``)."""
    return found(torch).schedulers


def trainer_objects(name: str, kind: str, trainer: Any, torch: Any) -> Found:
    """What one trainer holds (its models, optimizers, schedulers), named by attribute path below ``name``."""
    out = Found()
    _add_trainer(name, kind, trainer, _Kinds(torch), out)
    return out


def find_trainers() -> List[Tuple[str, str, Any]]:
    """(name, kind, trainer) for every training framework object found: kind is ``transformers``,
    ``lightning`` or ``accelerate``."""
    return found(sys.modules.get("torch")).trainers


def found(torch: Any) -> Found:
    """Everything of every kind, in one pass over the sources."""
    out = Found()
    kinds = _Kinds(torch)
    candidates = list(_registered()) + list(_in_main()) + list(_in_frames())
    _classify(candidates, kinds, out)
    if kinds.module is not None and (not out.models or (kinds.optimizer is not None and not out.optimizers)):
        gc_found = Found()
        _classify(_in_gc(kinds), kinds, gc_found, gc_names=True)
        if not out.models:
            out.models = gc_found.models
        if not out.optimizers:
            out.optimizers = gc_found.optimizers
        if not out.schedulers:
            out.schedulers = gc_found.schedulers
        if not out.trainers:
            out.trainers = gc_found.trainers
        if not out.engines:
            out.engines = gc_found.engines
    out.models = _roots(_unique(out.models))
    out.optimizers = _unique(out.optimizers)
    out.schedulers = _unique(out.schedulers)
    return out


def main_expression(expression: str) -> Any:
    """The value of ``expression`` in ``__main__`` (``--model trainer.net``): this runs the user's code."""
    return eval(expression, vars(sys.modules["__main__"]))  # noqa: S307 - the point: name an object by code


def resolve_expression(expression: str, scope: Any = None) -> Any:
    """The value of ``expression`` in ``scope`` (a frame's Scope) when given, else in ``__main__``, else
    in the first frame of the program's own code on the main thread (innermost first) that defines
    its first name: ``trainer.model`` where ``trainer`` is a local of ``main()``. Runs the user's code."""
    if scope is not None:
        return eval(expression, scope.globals, scope.locals)  # noqa: S307
    try:
        return main_expression(expression)
    except NameError as missing:
        for globals_, locals_ in user_frame_scopes():
            try:
                return eval(expression, globals_, locals_)  # noqa: S307
            except NameError:
                continue
        raise missing


# -- recognising objects -----------------------------------------------------------------------------

class _Kinds:
    def __init__(self, torch: Any) -> None:
        self.module = getattr(getattr(torch, "nn", None), "Module", None) if torch is not None else None
        optim = sys.modules.get("torch.optim")
        self.optimizer = getattr(optim, "Optimizer", None)
        schedulers = sys.modules.get("torch.optim.lr_scheduler")
        self.scheduler = getattr(schedulers, "LRScheduler", None) or getattr(schedulers, "_LRScheduler", None)

    def of(self, value: Any) -> Optional[str]:
        return self.of_class(type(value))  # type(), not isinstance: no __class__ of proxies runs

    def of_class(self, cls: type) -> Optional[str]:
        """The kind every instance of ``cls`` is, or None: decided by the class alone."""
        if self.module is not None and issubclass(cls, self.module):
            return "model"
        if self.optimizer is not None and issubclass(cls, self.optimizer):
            return "optimizer"
        if self.scheduler is not None and issubclass(cls, self.scheduler):
            return "scheduler"
        if _class_named(cls, "AcceleratedScheduler", "accelerate") or deepspeed_scheduler_class(cls) is not None:
            return "scheduler"
        if trainer_class_kind(cls) is not None:
            return "trainer"
        if _class_named(cls, "LightningOptimizer", "lightning", "pytorch_lightning"):
            return "optimizer"
        return None


def _class_named(cls: type, name: str, *packages: str) -> bool:
    """Whether ``cls`` or one of its bases is ``name`` from one of ``packages`` (by name: nothing imported)."""
    try:
        mro = cls.__mro__
    except Exception:
        return False
    for base in mro:
        if base.__name__ == name and (not packages or str(base.__module__).split(".")[0] in packages):
            return True
    return False


def deepspeed_scheduler(value: Any) -> Optional[str]:
    """The name of the DeepSpeed scheduler class ``value`` is (or derives from), else None (by name, from
    ``deepspeed`` only where the target imported it)."""
    return deepspeed_scheduler_class(type(value))


def deepspeed_scheduler_class(cls: type) -> Optional[str]:
    if "deepspeed" not in sys.modules:
        return None
    try:
        mro = cls.__mro__
    except Exception:
        return None
    for base in mro:  # one walk of the bases: this runs on every object the collector holds
        if base.__name__ in DEEPSPEED_SCHEDULERS and str(base.__module__).split(".")[0] == "deepspeed":
            return base.__name__
    return None


def deepspeed_engine(value: Any) -> bool:
    """Whether ``value`` is a ``DeepSpeedEngine`` (by name: nothing imported)."""
    return "deepspeed" in sys.modules and _class_named(type(value), "DeepSpeedEngine", "deepspeed")


def trainer_kind(value: Any) -> Optional[str]:
    """``transformers``, ``lightning`` or ``accelerate`` for a trainer of that framework, else None."""
    return trainer_class_kind(type(value))


def trainer_class_kind(cls: type) -> Optional[str]:
    if "transformers" in sys.modules and _class_named(cls, "Trainer", "transformers"):
        return "transformers"
    if ("lightning" in sys.modules or "pytorch_lightning" in sys.modules) and \
            _class_named(cls, "Trainer", "lightning", "pytorch_lightning"):
        return "lightning"
    if "accelerate" in sys.modules and _class_named(cls, "Accelerator", "accelerate"):
        return "accelerate"
    return None


def unwrap_module(module: Any, kinds: Optional[Any] = None) -> Any:
    """The module a DDP / FSDP / DeepSpeed / compile / Lightning / Fabric wrapper holds (through several)."""
    for _ in range(8):
        inner = None
        for base in type(module).__mro__:
            attribute = _MODULE_WRAPPERS.get(base.__name__)
            if attribute is not None:
                inner = _attribute(module, attribute)
                break
        if inner is None or inner is module or not hasattr(inner, "named_parameters"):
            return module
        module = inner
    return module


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer inside an ``AcceleratedOptimizer`` / ``LightningOptimizer`` (through several)."""
    for _ in range(8):
        inner = None
        for attribute in _OPTIMIZER_WRAPPERS:
            candidate = _attribute(optimizer, attribute)
            if candidate is not None and candidate is not optimizer and hasattr(candidate, "param_groups") \
                    and hasattr(candidate, "state_dict"):
                inner = candidate
                break
        if inner is None:
            return optimizer
        optimizer = inner
    return optimizer


def _unwrap_scheduler(scheduler: Any) -> Any:
    if _class_named(type(scheduler), "AcceleratedScheduler", "accelerate"):
        inner = _attribute(scheduler, "scheduler")
        if inner is not None:
            return inner
    return scheduler


def _attribute(value: Any, name: str) -> Any:
    """An instance attribute read from ``__dict__`` (no property, no ``__getattr__`` runs), or None."""
    try:
        attributes = object.__getattribute__(value, "__dict__")
    except Exception:
        return None
    if isinstance(attributes, dict):
        found = attributes.get(name)
        if found is not None:
            return found
        modules = attributes.get("_modules")  # a submodule lives in Module._modules
        if isinstance(modules, dict):
            return modules.get(name)
    return None


def _has_state(module: Any) -> bool:
    """Whether a module holds any parameter or buffer (its own or a submodule's)."""
    try:
        for _ in module.parameters():
            return True
        for _ in module.buffers():
            return True
    except Exception:
        return False
    return False


# -- classifying what the sources gave ---------------------------------------------------------------

def _classify(candidates: Iterable[Tuple[str, Any]], kinds: _Kinds, out: Found, gc_names: bool = False) -> None:
    """Sort candidates into ``out`` by kind; a trainer or a LightningModule adds what it holds."""
    seen_trainers: Dict[int, None] = {}
    reached: List[Tuple[str, Any]] = []  # Lightning trainers reached through their module: named so when no
    for name, value in candidates:       # source holds them under a name of their own
        kind = kinds.of(value)
        if kind == "model":
            module = unwrap_module(value)
            if _has_state(module):
                out.models.append((name, module))
            if deepspeed_engine(value):
                _add_engine_parts(name, value, kinds, out)
            lightning_trainer = _lightning_trainer_of(module)
            if lightning_trainer is not None:
                reached.append((name + ".trainer", lightning_trainer))
        elif kind == "optimizer":
            out.optimizers.append((name, unwrap_optimizer(value)))
        elif kind == "scheduler":
            out.schedulers.append((name, _unwrap_scheduler(value)))
        elif kind == "trainer" and id(value) not in seen_trainers:
            seen_trainers[id(value)] = None
            _add_trainer(name, trainer_kind(value) or "", value, kinds, out)
    for name, trainer in reached:
        if id(trainer) not in seen_trainers:
            seen_trainers[id(trainer)] = None
            _add_trainer(name, "lightning", trainer, kinds, out)


def _add_engine_parts(name: str, engine: Any, kinds: _Kinds, out: Found) -> None:
    """A DeepSpeed engine's optimizer (ZeRO's wrapper or the basic one: the torch optimizer it steps) and
    its scheduler, named as the engine holds them (``engine.optimizer``, ``engine.lr_scheduler``)."""
    if not any(e is engine for _, e in out.engines):
        out.engines.append((name, engine))
    optimizer = _attribute(engine, "optimizer")
    if optimizer is not None and (kinds.of(optimizer) == "optimizer" or _attribute(optimizer, "optimizer") is not None):
        inner = unwrap_optimizer(optimizer)
        if kinds.of(inner) == "optimizer":
            out.optimizers.append((name + ".optimizer", inner))
    scheduler = _attribute(engine, "lr_scheduler")
    if scheduler is not None and kinds.of(scheduler) == "scheduler":
        out.schedulers.append((name + ".lr_scheduler", _unwrap_scheduler(scheduler)))


def _lightning_trainer_of(module: Any) -> Any:
    if "lightning" not in sys.modules and "pytorch_lightning" not in sys.modules:
        return None
    if not _class_named(type(module), "LightningModule", "lightning", "pytorch_lightning"):
        return None
    trainer = _attribute(module, "_trainer")
    return trainer if trainer is not None and trainer_kind(trainer) == "lightning" else None


def _add_trainer(name: str, kind: str, trainer: Any, kinds: _Kinds, out: Found) -> None:
    out.trainers.append((name, kind, trainer))
    models: List[Tuple[str, Any]] = []
    optimizers: List[Tuple[str, Any]] = []
    schedulers: List[Tuple[str, Any]] = []
    try:
        if kind == "transformers":
            models = [(name + ".model", _attribute(trainer, "model")),
                      (name + ".model_wrapped", _attribute(trainer, "model_wrapped"))]
            optimizers = [(name + ".optimizer", _attribute(trainer, "optimizer"))]
            schedulers = [(name + ".lr_scheduler", _attribute(trainer, "lr_scheduler"))]
        elif kind == "lightning":
            strategy = getattr(trainer, "strategy", None)  # a property of Lightning's Trainer
            module = _attribute(strategy, "_lightning_module") if strategy is not None else None
            models = [(name + ".lightning_module", module), (name + ".model", _attribute(strategy, "_model"))]
            for index, optimizer in enumerate(list(_attribute(strategy, "_optimizers") or [])):
                optimizers.append(("%s.optimizers[%d]" % (name, index), optimizer))
            for index, config in enumerate(list(_attribute(strategy, "lr_scheduler_configs") or [])):
                schedulers.append(("%s.lr_scheduler_configs[%d].scheduler" % (name, index),
                                   getattr(config, "scheduler", None)))
        elif kind == "accelerate":
            for attribute, into in (("_models", models), ("_optimizers", optimizers), ("_schedulers", schedulers)):
                for index, value in enumerate(list(_attribute(trainer, attribute) or [])):
                    into.append(("%s.%s[%d]" % (name, attribute, index), value))
    except Exception:
        return  # a trainer in an unexpected shape: what it holds is found by the other sources
    for entry_name, value in models:
        if value is not None and kinds.of(value) == "model":
            module = unwrap_module(value)
            if _has_state(module):
                out.models.append((entry_name, module))
    for entry_name, value in optimizers:
        if value is not None and kinds.of(value) == "optimizer":
            out.optimizers.append((entry_name, unwrap_optimizer(value)))
    for entry_name, value in schedulers:
        if value is not None and kinds.of(value) == "scheduler":
            out.schedulers.append((entry_name, _unwrap_scheduler(value)))


# -- the sources -------------------------------------------------------------------------------------

def _registered() -> Iterable[Tuple[str, Any]]:
    with _lock:
        refs = list(_watched)
    for name, ref in refs:
        obj = ref()
        if obj is not None:
            yield name, obj


def _in_main() -> Iterable[Tuple[str, Any]]:
    main = sys.modules.get("__main__")
    if main is None:
        return
    yield from _in_namespace(dict(vars(main)))


def _in_namespace(namespace: Dict[str, Any]) -> Iterable[Tuple[str, Any]]:
    """Each name's value, then (for a value that is not itself a torch object) one level into it."""
    for name, value in list(namespace.items())[:4096]:
        if not isinstance(name, str) or name.startswith("__") or name in ("self", "cls"):
            continue
        if isinstance(value, type) or type(value).__name__ == "module":
            continue
        yield name, value
        if trainer_kind(value) is not None or hasattr(type(value), "named_parameters") \
                or hasattr(type(value), "param_groups"):
            continue  # a trainer's objects are found through it, under its attribute paths; a model is a whole
        try:
            members = list(members_of(value))
        except Exception:
            continue  # an object whose attributes cannot be read plainly (a proxy): not ours to force
        for suffix, member in members:
            yield name + suffix, member


def members_of(value: Any) -> Iterable[Tuple[str, Any]]:
    """One level into an object: its instance attributes, or a container's items."""
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value[:_MAX_MEMBERS]):
            yield "[%d]" % i, item
    elif isinstance(value, dict):
        for key, item in list(value.items())[:_MAX_MEMBERS]:
            if isinstance(key, (str, int)):
                yield "[%r]" % (key,), item
    elif not isinstance(value, type) and not str(type(value).__module__).startswith(("builtins", "torch")):
        try:  # the instance's own attributes, without running its class's __getattribute__ or __getattr__
            attributes = object.__getattribute__(value, "__dict__")
        except Exception:
            attributes = None
        if isinstance(attributes, dict):
            for key, item in list(attributes.items())[:_MAX_MEMBERS]:
                if isinstance(key, str) and not key.startswith("__"):
                    yield "." + key, item


def _library_prefixes() -> Tuple[str, ...]:
    paths = {_PACKAGE + os.sep}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        try:
            path = sysconfig.get_paths().get(key)
        except Exception:
            path = None
        if path:
            paths.add(os.path.realpath(path) + os.sep)
            paths.add(path + os.sep)
    for path in sys.path:
        if path and ("site-packages" in path or "dist-packages" in path):
            paths.add(path.rstrip(os.sep) + os.sep)
    return tuple(paths)


def _is_user_code(filename: str, libraries: Tuple[str, ...]) -> bool:
    if not filename or filename.startswith("<"):
        return False
    return not filename.startswith(libraries) and "site-packages" not in filename and "dist-packages" not in filename


def user_frame_scopes() -> List[Tuple[Dict[str, Any], Dict[str, Any]]]:
    """(globals, locals) of the main thread's frames of the program's own code, innermost first; a
    module's top level (whose locals are its globals, ``__main__``'s already asked) is left out.

    Read as ``python.backtrace`` reads frames: the collector off, nothing but attribute reads while
    the chain is followed; only the namespaces are kept, never the frames."""
    main = threading.main_thread()
    if main.ident is None:
        return []
    libraries = _library_prefixes()
    out: List[Tuple[Dict[str, Any], Dict[str, Any]]] = []
    enabled = gc.isenabled()
    if enabled:
        gc.disable()
    try:
        frame: Any
        if main.ident == threading.get_ident():
            frame = sys._getframe(1)  # on the training thread itself (a save between steps): our frames are probe's
        else:
            current = sys._current_frames()
            frame = current.get(main.ident)
            current.clear()
        depth = 0
        while frame is not None and depth < _MAX_FRAMES:
            code = frame.f_code
            if _is_user_code(code.co_filename, libraries):
                globals_, locals_ = frame.f_globals, frame.f_locals
                if locals_ is not globals_:
                    out.append((globals_, dict(locals_)))
            frame = frame.f_back
            depth += 1
        frame = None
    finally:
        if enabled:
            gc.enable()
    return out


def _in_frames() -> Iterable[Tuple[str, Any]]:
    """Outermost first, so that an object held by several frames (``model`` in ``main()``, ``module`` in a
    callback it calls) is named by the frame that lives longest: the name stays while the stack moves."""
    for _, locals_ in reversed(user_frame_scopes()):
        yield from _in_namespace(locals_)


def _in_gc(kinds: _Kinds) -> List[Tuple[str, Any]]:
    """Every object of a kind we look for that the collector tracks (``probe.tables.tracked``: the program
    never runs while we hold its every object); trainers first, so that what they hold is named through them."""
    trainers: List[Tuple[str, Any]] = []
    rest: List[Tuple[str, Any]] = []
    for obj in tracked_of(lambda cls: kinds.of_class(cls) is not None):
        (trainers if kinds.of(obj) == "trainer" else rest).append((type(obj).__name__, obj))
    return trainers + rest


# -- names and roots ---------------------------------------------------------------------------------

def _unique(found: List[Tuple[str, Any]]) -> List[Tuple[str, Any]]:
    """The first name of each object (the most trusted source), and a distinct name for each."""
    seen: Dict[int, str] = {}
    names: Dict[str, int] = {}
    out = []
    for name, obj in found:
        if id(obj) in seen:
            continue
        if name in names:
            names[name] += 1
            name = "%s#%d" % (name, names[name])
        else:
            names[name] = 1
        seen[id(obj)] = name
        out.append((name, obj))
    return out


def _roots(found: List[Tuple[str, Any]]) -> List[Tuple[str, Any]]:
    """Drop every module that is a submodule of another found one."""
    inner: Dict[int, None] = {}
    for _, module in found:
        if id(module) in inner:
            continue  # its subtree was walked already, from its parent
        for sub in module.modules():
            if sub is not module:
                inner[id(sub)] = None
    return [(name, module) for name, module in found if id(module) not in inner]


def _global_name(obj: Any) -> Optional[str]:
    main = sys.modules.get("__main__")
    if main is None:
        return None
    for name, value in list(vars(main).items()):
        if value is obj and not name.startswith("_"):
            return name
    return None
