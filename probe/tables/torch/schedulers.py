"""The learning-rate schedulers that drive the target's optimizers, found by duck typing.

A scheduler is any object with an ``optimizer`` (something with ``param_groups``), an integer
``last_epoch`` and a ``step`` method: torch.optim.lr_scheduler's classes (the ``LambdaLR`` that
Hugging Face's Trainer makes among them) and look-alikes. A wrapper holding one in ``scheduler``
(accelerate's ``AcceleratedScheduler``, Lightning's ``LRSchedulerConfig``) is folded into it, as are
the children of ``SequentialLR`` and ``ChainedScheduler`` (``_schedulers``) into their parent. Nothing
is imported: torch's and DeepSpeed's classes are told apart by name, the frameworks' by their attributes.

Where from: what probe's discovery finds (through a trainer: ``trainer.lr_scheduler``), ``__main__``
and the main thread's frames (innermost first, the training thread's own too), two levels into what
they hold; then, for optimizers still without one, the garbage collector (``probe.tables.tracked``). A scheduler drives an optimizer when they share its ``param_groups`` list (so an
optimizer wrapper and what it wraps have the same schedulers).

Runs in the target: stdlib only, no torch import, and nothing of the target's code runs but the
``param_groups`` property of an optimizer wrapper.
"""

import gc
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

from probe.tables.torch import discovery
from probe.tables.tracked import tracked_of

__all__ = ["Driver", "find_schedulers", "drivers_of", "is_scheduler", "kind_of", "torch_class", "note_for",
           "step_count", "deepspeed_lists",
           "base_of", "class_text", "attrs_of", "param_groups_of"]

_MAX_VISITED = 4000  # objects looked at in __main__ and the frames, all levels together
_MAX_MEMBERS = 256  # attributes or items looked at in each of them
_DEPTH = 2  # levels below a global or a local: trainer.lr_scheduler, trainer.state.x

_TORCH_MODULE = "torch.optim.lr_scheduler"
# How each of torch's schedulers computes the next lr: from its base values (a change of a group's lr
# alone is undone at its next step), or from the group's current lr (a change sticks).
FROM_BASE = frozenset({"LambdaLR", "CosineAnnealingWarmRestarts", "CyclicLR", "OneCycleLR", "SequentialLR"})
FROM_LR = frozenset({"StepLR", "MultiStepLR", "ExponentialLR", "MultiplicativeLR", "LinearLR", "ConstantLR",
                     "PolynomialLR", "CosineAnnealingLR", "ReduceLROnPlateau"})


@dataclass
class Driver:
    """One scheduler and what was folded into it."""

    name: str  # its expression from __main__ or a frame (trainer.lr_scheduler), else its class name
    scheduler: Any
    via: List[str] = field(default_factory=list)  # wrappers folded in, as text

    @property
    def param_groups(self) -> Any:
        return param_groups_of(attrs_of(self.scheduler).get("optimizer"))


def find_schedulers(optimizers: Optional[List[Any]] = None) -> List[Driver]:
    """Every scheduler found, in the order above; the garbage collector is asked only when some of
    ``optimizers`` (all found ones when None is given) has none yet."""
    found: Dict[int, Tuple[Optional[str], Any]] = {}
    wrappers: Dict[int, List[Any]] = {}
    for name, obj in _discovered() + list(_named_objects()):
        _take(name, obj, found, wrappers)
    wanted = {id(param_groups_of(o)) for o in optimizers} if optimizers is not None else None
    have = {id(param_groups_of(attrs_of(s).get("optimizer"))) for _, s in found.values()}
    if wanted is None or not wanted <= have:
        for obj in _in_gc():
            _take(None, obj, found, wrappers)
    return _fold(found, wrappers)


def drivers_of(optimizer: Any, drivers: List[Driver]) -> List[Driver]:
    """The schedulers that drive ``optimizer`` (the same ``param_groups`` list)."""
    groups = param_groups_of(optimizer)
    return [d for d in drivers if groups is not None and d.param_groups is groups]


def is_scheduler(obj: Any) -> bool:
    """An ``optimizer`` with param_groups, a ``step`` method, and an integer ``last_epoch`` (DeepSpeed's:
    ``last_batch_iteration``) or a list of base values (``base_lrs``; timm's schedulers: ``base_values``)."""
    attrs = attrs_of(obj)
    if not attrs or isinstance(obj, type):
        return False
    counted = step_count(obj) is not None
    return ((counted or isinstance(attrs.get("base_lrs"), list) or isinstance(attrs.get("base_values"), list))
            and _has_step(type(obj)) and isinstance(param_groups_of(attrs.get("optimizer")), list))


def step_count(obj: Any) -> Optional[int]:
    """The scheduler's own step count: ``last_epoch`` (DeepSpeed's: ``last_batch_iteration``), else None."""
    attrs = attrs_of(obj)
    for key in ("last_epoch", "last_batch_iteration"):
        value = attrs.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def deepspeed_lists(obj: Any) -> List[str]:
    """The attributes holding the per-group values a DeepSpeed scheduler computes each lr from (lr =
    min + delta * gamma for WarmupLR and WarmupDecayLR; org_lrs * ratio for WarmupCosineLR; between min and
    max for OneCycle; min_lr * increase for LRRangeTest), the base value first; [] for another scheduler."""
    return list(_DEEPSPEED_LISTS.get(discovery.deepspeed_scheduler(obj) or "", ()))


_DEEPSPEED_LISTS = {"WarmupLR": ("max_lrs", "min_lrs", "delta_lrs"), "WarmupDecayLR": ("max_lrs", "min_lrs", "delta_lrs"),
                    "WarmupCosineLR": ("org_lrs",), "OneCycle": ("max_lrs", "min_lrs"), "LRRangeTest": ("min_lr",)}


def torch_class(obj: Any) -> Optional[str]:
    """The name of the first of torch's scheduler classes ``obj`` is (or derives from), else None."""
    for cls in type(obj).__mro__:
        if getattr(cls, "__module__", "") == _TORCH_MODULE and cls.__name__ not in ("LRScheduler", "_LRScheduler"):
            return cls.__name__
    return None


def kind_of(obj: Any) -> str:
    """How ``obj`` sets the next lr: ``base`` (from its base values: a group's lr set alone is undone),
    ``lr`` (from the group's current lr: it sticks), or ``unknown``."""
    name = torch_class(obj)
    children = attrs_of(obj).get("_schedulers")
    if name == "ChainedScheduler" and isinstance(children, (list, tuple)):
        return "base" if any(kind_of(c) != "lr" for c in children) else "lr"
    if name in FROM_BASE or "lr_lambdas" in attrs_of(obj) or "base_values" in attrs_of(obj) or deepspeed_lists(obj):
        return "base"
    if name in FROM_LR:
        return "lr"
    return "unknown"


def base_of(obj: Any, index: int) -> Any:
    """The scheduler's base value for group ``index`` (``base_lrs``, timm's ``base_values``; OneCycleLR:
    the group's max_lr), or None."""
    if torch_class(obj) == "OneCycleLR":
        groups = param_groups_of(attrs_of(obj).get("optimizer"))
        if isinstance(groups, list) and index < len(groups) and isinstance(groups[index], dict):
            return groups[index].get("max_lr")
    attrs = attrs_of(obj)
    bases = attrs.get("base_lrs", attrs.get("base_values"))
    for key in deepspeed_lists(obj)[:1]:  # DeepSpeed's: max_lrs, org_lrs or min_lr
        bases = attrs.get(key)
    if isinstance(bases, (list, tuple)) and index < len(bases):
        return bases[index]
    return None


def class_text(obj: Any) -> str:
    cls = type(obj)
    return "%s.%s" % (cls.__module__, cls.__qualname__)


def note_for(driver: Driver) -> str:
    """Why a change of a group's lr alone does (not) stick under this scheduler, in words."""
    obj = driver.scheduler
    name = torch_class(obj) or type(obj).__name__
    kind = kind_of(obj)
    if name == "OneCycleLR":
        text = ("OneCycleLR sets lr from the group's initial_lr, max_lr and min_lr at every step: lr set alone "
                "is undone at its next step")
    elif name == "CyclicLR":
        text = "CyclicLR sets lr between its base_lrs and max_lrs at every step: lr set alone is undone at its next step"
    elif name == "SequentialLR":
        text = ("SequentialLR's schedulers go on from the group's lr, and restart from their base_lrs at each "
                "milestone: lr set alone is undone there")
    elif name == "ReduceLROnPlateau":
        text = "ReduceLROnPlateau lowers the group's current lr when the metric stalls: a changed lr sticks"
    elif deepspeed_lists(obj):
        text = ("DeepSpeed's %s sets lr from its %s at every step: lr set alone is undone at its next step"
                % (name, _and(deepspeed_lists(obj))))
    elif kind == "base":
        text = "%s sets lr from its base_lrs at every step: lr set alone is undone at its next step" % name
    elif kind == "lr":
        text = "%s goes on from the group's current lr: a changed lr sticks" % name
    else:
        text = "%s is no scheduler of torch's: whether a changed lr sticks is not known" % name
    if kind != "lr":
        text += " (probe TARGET lr changes its base values and initial_lr too)"
    if driver.via:
        text += "; stepped through %s" % ", ".join(driver.via)
    return text


def _and(words: List[str]) -> str:
    return words[0] if len(words) == 1 else "%s and %s" % (", ".join(words[:-1]), words[-1])


# -- finding ----------------------------------------------------------------------------------------

def _take(name: Optional[str], obj: Any, found: Dict[int, Tuple[Optional[str], Any]], wrappers: Dict[int, List[Any]]) -> None:
    inner = attrs_of(obj).get("scheduler")
    if inner is not None and inner is not obj and not is_scheduler(obj) and is_scheduler(inner):
        wrappers.setdefault(id(inner), [])
        if not any(w is obj for w in wrappers[id(inner)]):
            wrappers[id(inner)].append(obj)
        if name is not None:
            name += ".scheduler"
        obj = inner
    elif not is_scheduler(obj):
        return
    if id(obj) not in found or (found[id(obj)][0] is None and name is not None):
        found[id(obj)] = (name, obj)


def _fold(found: Dict[int, Tuple[Optional[str], Any]], wrappers: Dict[int, List[Any]]) -> List[Driver]:
    children = set()
    for _, obj in found.values():
        inner = attrs_of(obj).get("_schedulers")
        if isinstance(inner, (list, tuple)):
            children.update(id(c) for c in inner)
    out: List[Driver] = []
    counts: Dict[str, int] = {}
    for key, (name, obj) in found.items():
        if key in children:
            continue
        if name is None:
            base = type(obj).__name__
            counts[base] = counts.get(base, 0) + 1
            name = base if counts[base] == 1 else "%s#%d" % (base, counts[base])
        out.append(Driver(name, obj, [_wrapper_text(w) for w in wrappers.get(key, [])]))
    return out


def _wrapper_text(wrapper: Any) -> str:
    attrs = attrs_of(wrapper)
    interval, frequency = attrs.get("interval"), attrs.get("frequency")
    if isinstance(interval, str) and isinstance(frequency, int):  # Lightning's config
        return "%s (every %d %s%s)" % (class_text(wrapper), frequency, interval, "" if frequency == 1 else "s")
    return class_text(wrapper)


def _discovered() -> List[Tuple[str, Any]]:
    """What probe's discovery names as schedulers (through a trainer: ``trainer.lr_scheduler``)."""
    find = getattr(discovery, "find_schedulers", None)
    torch = sys.modules.get("torch")
    if find is None or torch is None:
        return []
    try:
        return list(find(torch))
    except Exception:
        return []


def _named_objects() -> Iterator[Tuple[str, Any]]:
    """(expression, object) for what ``__main__`` and the main thread's frames hold, two levels deep."""
    visited = [0]
    seen: Dict[int, None] = {}
    main = sys.modules.get("__main__")
    roots: List[Tuple[str, Any]] = []
    if main is not None:
        roots += [(k, v) for k, v in list(vars(main).items()) if not k.startswith("__")]
    for local_names in _main_thread_locals():
        roots += [(k, v) for k, v in local_names if isinstance(k, str)]
    for name, value in roots:
        yield from _walk(name, value, 0, seen, visited)
        if visited[0] > _MAX_VISITED:
            return


def _walk(name: str, value: Any, depth: int, seen: Dict[int, None], visited: List[int]) -> Iterator[Tuple[str, Any]]:
    if id(value) in seen or visited[0] > _MAX_VISITED:
        return
    seen[id(value)] = None
    visited[0] += 1
    yield name, value
    if depth >= _DEPTH or is_scheduler(value):
        return
    try:
        members = list(discovery.members_of(value))
    except Exception:
        return
    for suffix, member in members:
        yield from _walk(name + suffix, member, depth + 1, seen, visited)


def _main_thread_locals() -> List[List[Tuple[Any, Any]]]:
    """The local variables of the main thread's function frames, innermost first (read as the agent's
    frame scopes read them: the collector off while the chain is followed)."""
    ident = threading.main_thread().ident
    enabled = gc.isenabled()
    if enabled:
        gc.disable()
    out = []
    try:
        frame = sys._getframe() if ident == threading.get_ident() else sys._current_frames().get(ident)
        while frame is not None:
            if frame.f_code.co_name != "<module>" and not frame.f_code.co_filename.startswith(_PACKAGE):
                try:
                    out.append(list(frame.f_locals.items())[:_MAX_MEMBERS])
                except Exception:
                    pass
            frame = frame.f_back
    finally:
        frame = None
        if enabled:
            gc.enable()
    return out


_PACKAGE = __file__.rsplit("/tables/", 1)[0]


def _in_gc() -> List[Any]:
    """Schedulers and scheduler wrappers the collector tracks (``probe.tables.tracked``): the objects of the
    classes that may be one, then each looked at."""
    kinds: Dict[type, bool] = {}

    def may_be_one(cls: type) -> bool:
        if cls not in kinds:
            kinds[cls] = _may_be_one(cls)
        return kinds[cls]

    return [obj for obj in tracked_of(may_be_one) if is_scheduler(obj) or is_scheduler(attrs_of(obj).get("scheduler"))]


def _may_be_one(cls: type) -> bool:
    """A class whose instances may be schedulers or wrappers of one: it has ``step``, or is a dataclass
    with a ``scheduler`` field (Lightning's config)."""
    if issubclass(cls, type):
        return False
    return _has_step(cls) or "scheduler" in (getattr(cls, "__dict__", {}).get("__dataclass_fields__") or {})


def _has_step(cls: type) -> bool:
    return any(callable(vars(c).get("step")) for c in getattr(cls, "__mro__", ()))


def attrs_of(obj: Any) -> Dict[str, Any]:
    """The instance's own attributes, read without running its class's ``__getattribute__``."""
    try:
        attrs = object.__getattribute__(obj, "__dict__")
    except Exception:
        return {}
    return attrs if isinstance(attrs, dict) else {}


def param_groups_of(optimizer: Any) -> Any:
    if optimizer is None:
        return None
    groups = attrs_of(optimizer).get("param_groups")
    if groups is None:
        try:  # a wrapper's property (accelerate's AcceleratedOptimizer: the wrapped one's list)
            groups = getattr(optimizer, "param_groups", None)
        except Exception:
            return None
    return groups if isinstance(groups, list) else None
