"""Module names for global hooks, which are handed the module object, not its name.

The first time a module runs outside any other traced forward it is a root: its whole tree is named at
once, the root by its class (``Net``), the others by their path below it (``encoder.layers.0.linear1``,
as ``named_modules()`` says). A module met inside a forward that its root's tree does not hold (made
on the fly) is named ``<parent>.<Class>``. Each entry also says whether the module filter matches, so a
filtered module costs one dict look-up. Entries are keyed by ``id`` and hold a weak reference whose
callback takes the entry out when its module is freed (before its id can be reused: an entry found by
a live module's id is that module's); the cache is bounded.

torch.compile: a compiled module's wrapper (``OptimizedModule``, which holds the user's module as
``_orig_mod``) is named as the module it wraps: a root wrapper by the wrapped class (``Net``, not
``OptimizedModule``), and ``_orig_mod`` is left out of paths (``encoder.0``, not ``_orig_mod.encoder.0``).
A torch.fx GraphModule that is no submodule of a named tree (the code a compiler generated, which some
backends run as a module inside the compiled module's call, or first, when a trace starts in the middle
of one) is not traced: its time is its caller's. Its own submodules are named and traced as usual.
"""

import fnmatch
import functools
import sys
import weakref
from typing import Any, Callable, Dict, Optional, Tuple

__all__ = ["ModuleNames", "Entry"]

Entry = Tuple[Any, str, int, bool, int]
"""(weak reference to the module, name, name id in the ring, whether it is traced, the module's id)."""

_MAX_ENTRIES = 200_000
_MAX_WALK = 100_000


class ModuleNames:
    def __init__(self, pattern: str, name_id: Callable[[str], int]) -> None:
        self._pattern = pattern
        self._match_all = pattern == "*"
        self._name_id = name_id
        self.entries: Dict[int, Entry] = {}

    def lookup(self, module: Any, outer: Optional[Any], parent: Optional[Entry]) -> Entry:
        """The entry of ``module`` (cached, else made): ``outer`` is the outermost module in forward on
        this thread (None: this is a root), ``parent`` the entry of the module that called it."""
        entry = self.entries.get(id(module))
        if entry is not None and entry[0]() is module:
            return entry
        if outer is None:
            self._name_tree(module)
        elif outer is not module:
            self._name_tree(outer)
        entry = self.entries.get(id(module))
        if entry is not None and entry[0]() is module:
            return entry
        base = parent[1] if parent is not None else ""
        return self._add(module, (base + "." if base else "") + type(module).__name__, not _generated(module))

    def _name_tree(self, root: Any) -> None:
        if len(self.entries) > _MAX_ENTRIES:
            self.entries.clear()
        name = type(_unwrapped(root)).__name__
        self._add(root, name, not _generated(root))
        for count, (path, child) in enumerate(root.named_modules()):
            if count >= _MAX_WALK:
                break
            if path:
                self._add(child, _user_path(path) or name)

    def _add(self, module: Any, name: str, traced: bool = True) -> Entry:
        traced = traced and (self._match_all or fnmatch.fnmatchcase(name, self._pattern))
        key = id(module)
        entry = (weakref.ref(module, functools.partial(_forget, self.entries, key)), name, self._name_id(name), traced,
                 key)
        self.entries[key] = entry
        return entry


def _forget(entries: Dict[int, Entry], key: int, reference: Any) -> None:
    """A named module was freed: its entry leaves (if it is still the one under its id). Runs wherever
    the module's last reference went; never raises."""
    try:
        entry = entries.get(key)
        if entry is not None and entry[0] is reference:
            del entries[key]
    except Exception:
        pass


_WRAPPED = "_orig_mod"  # the attribute under which torch.compile's OptimizedModule holds the user's module


def _unwrapped(module: Any) -> Any:
    """The module a compiled wrapper holds (through wrappers of wrappers), else ``module`` itself."""
    for _ in range(8):
        inner = getattr(module, "_modules", {}).get(_WRAPPED)
        if inner is None:
            break
        module = inner
    return module


def _user_path(path: str) -> str:
    """``path`` without the ``_orig_mod`` steps compiled wrappers add (``''`` for a root wrapper's own)."""
    if _WRAPPED not in path:
        return path
    return ".".join(part for part in path.split(".") if part != _WRAPPED)


def _generated(module: Any) -> bool:
    """A torch.fx GraphModule (asked only of modules no named tree holds: a compiler's code)."""
    fx = sys.modules.get("torch.fx")
    graph_module = getattr(fx, "GraphModule", None)
    return graph_module is not None and isinstance(module, graph_module)
