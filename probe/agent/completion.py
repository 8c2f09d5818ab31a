"""Tab completion for ``probe T repl``: names and attributes as the target's namespace has them.

``rlcompleter`` reads every matching attribute to tell methods from values, which runs each property
of the object; this lists names with ``dir()`` only. Following the dotted path the user typed runs that
path's own ``__getattr__`` (as evaluating it would), so the route bounds the whole call in time.
Runs in the target; stdlib only, 3.9+.
"""

import builtins
import keyword
from typing import Any, Dict, List, Optional

from probe.agent.frames import Scope
from probe._threads import daemon_thread

__all__ = ["complete", "complete_bounded"]

MAX_MATCHES = 500


def complete(text: str, scope: Scope) -> List[str]:
    """Every completion of ``text`` (``mod``, ``model.lay``): full replacements, sorted."""
    names: Dict[str, Any] = {}
    names.update(vars(builtins))
    names.update(scope.globals)
    if scope.locals is not None:
        names.update(dict(scope.locals.items()))
    if "." not in text:
        found = set(n for n in names if n.startswith(text)) | set(k for k in keyword.kwlist if k.startswith(text))
        return sorted(found, key=_order)[:MAX_MATCHES]
    path, _, prefix = text.rpartition(".")
    parts = path.split(".")
    if not all(p.isidentifier() for p in parts) or parts[0] not in names:
        return []
    obj = names[parts[0]]
    for part in parts[1:]:
        obj = getattr(obj, part)
    try:
        attributes = dir(obj)
    except Exception:
        return []
    hide_private = not prefix.startswith("_")
    found = set(a for a in attributes if isinstance(a, str) and a.startswith(prefix)
                and not (hide_private and a.startswith("_")))
    return ["%s.%s" % (path, a) for a in sorted(found, key=_order)[:MAX_MATCHES]]


def _order(name: str) -> Any:
    return (name.startswith("_"), name)


def complete_bounded(text: str, scope_fn: Any, limit: float = 2.0) -> Optional[List[str]]:
    """``complete`` on its own thread; None when it took longer than ``limit`` (or failed)."""
    out: Dict[str, Any] = {}

    def work() -> None:
        try:
            out["matches"] = complete(text, scope_fn())
        except BaseException:
            out["matches"] = []

    worker = daemon_thread(work, "probe-complete")
    worker.start()
    worker.join(limit)
    return out.get("matches")
