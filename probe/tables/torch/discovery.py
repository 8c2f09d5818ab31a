"""Finding the models (root ``torch.nn.Module``\\s) and optimizers of the target.

Sources, in order of trust:

1. registered: ``probe.watch(model, optimizer, name=obj, ...)`` in the training script (weak
   references: watching keeps nothing alive, and imports no torch);
2. the ``__main__`` namespace, and one level into what it holds (``trainer.model``, ``models[0]``,
   ``nets["gen"]``);
3. the garbage collector, only when 1 and 2 found nothing of that kind, bounded in time.

A source later in the list is asked only when the earlier ones found no model (or no optimizer). Only
roots are kept: a module that is a submodule of another found one is dropped. Names: the name given
to ``watch``, else the expression that reaches the object from ``__main__``, else ``ClassName@0xADDR``.
"""

import gc
import sys
import threading
import weakref
from typing import Any, Dict, Iterable, List, Optional, Tuple

from probe.tables.torch._common import Deadline

__all__ = ["watch", "unwatch", "find_models", "find_optimizers", "main_expression", "GC_BUDGET_S"]

GC_BUDGET_S = 2.0
_MAX_MEMBERS = 256  # attributes or items looked at in each object of __main__

_lock = threading.Lock()
_watched: List[Tuple[str, "weakref.ReferenceType[Any]"]] = []


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


def find_models(torch: Any) -> List[Tuple[str, Any]]:
    """(name, module) for every root model found, in the order of trust above."""
    return _find(torch.nn.Module, roots=True)


def find_optimizers(torch: Any) -> List[Tuple[str, Any]]:
    """(name, optimizer) for every ``torch.optim.Optimizer`` found, in the order of trust above."""
    optim = sys.modules.get("torch.optim")
    if optim is None:
        return []
    return _find(optim.Optimizer, roots=False)


def main_expression(expression: str) -> Any:
    """The value of ``expression`` in ``__main__`` (``--model trainer.net``): this runs the user's code."""
    return eval(expression, vars(sys.modules["__main__"]))  # noqa: S307 - the point: name an object by code


def _find(kind: type, roots: bool) -> List[Tuple[str, Any]]:
    found = _unique(list(_registered(kind)) + list(_in_main(kind)))
    if not found:
        found = _unique(_in_gc(kind))
    return _roots(found) if roots else found


def _registered(kind: type) -> Iterable[Tuple[str, Any]]:
    with _lock:
        refs = list(_watched)
    for name, ref in refs:
        obj = ref()
        if obj is not None and isinstance(obj, kind):
            yield name, obj


def _in_main(kind: type) -> Iterable[Tuple[str, Any]]:
    main = sys.modules.get("__main__")
    if main is None:
        return
    for name, value in list(vars(main).items()):
        if name.startswith("__"):
            continue
        if isinstance(value, kind):
            yield name, value
            continue
        try:
            members = list(_members(value))
        except Exception:
            continue  # an object whose attributes cannot be read plainly (a proxy): not ours to force
        for suffix, member in members:
            if isinstance(member, kind):
                yield name + suffix, member


def _members(value: Any) -> Iterable[Tuple[str, Any]]:
    """One level into an object of ``__main__``: its instance attributes, or a container's items."""
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value[:_MAX_MEMBERS]):
            yield "[%d]" % i, item
    elif isinstance(value, dict):
        for key, item in list(value.items())[:_MAX_MEMBERS]:
            if isinstance(key, (str, int)):
                yield "[%r]" % (key,), item
    elif not isinstance(value, type) and not type(value).__module__.startswith(("builtins", "torch")):
        attributes = getattr(value, "__dict__", None)
        if isinstance(attributes, dict):
            for key, item in list(attributes.items())[:_MAX_MEMBERS]:
                if isinstance(key, str):
                    yield "." + key, item


def _in_gc(kind: type) -> List[Tuple[str, Any]]:
    """Every object of ``kind`` the collector tracks, within :data:`GC_BUDGET_S` (then what was seen)."""
    deadline = Deadline(GC_BUDGET_S)
    out: List[Tuple[str, Any]] = []
    objects = gc.get_objects()
    try:
        for i, obj in enumerate(objects):
            if i % 4096 == 0 and deadline.spent():
                break
            if issubclass(type(obj), kind):  # type(), not isinstance: no __class__ of proxies runs
                out.append(("%s@%#x" % (type(obj).__name__, id(obj)), obj))
    finally:
        del objects  # a list of every object in the process: let it go at once
    return out


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
