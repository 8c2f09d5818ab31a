"""``PROBE_TORCH_TRACE=1``: trace from the first step, without ever importing torch ourselves.

At agent start, if the program has imported torch already, the trace starts at once. Otherwise one
finder goes at the front of ``sys.meta_path``: asked for any module other than ``torch`` it answers
"not mine" after one string comparison; asked for ``torch``, it lets the other finders find it and
wraps the loader so that, right after ``torch/__init__`` has run, the trace starts (before the program
has built a model). Then it takes itself out of ``sys.meta_path``; the module keeps its own loader.
"""

import os
import sys
from typing import Any, Optional

__all__ = ["arm_from_environment", "wanted"]

_FALSE = {"0", "false", "no", "off", ""}


def wanted(environ: Optional[Any] = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get("PROBE_TORCH_TRACE", "").strip().lower() not in _FALSE


def arm_from_environment() -> None:
    """Start the trace now if torch is loaded, else when the program imports it. Never raises."""
    try:
        if not wanted():
            return
        torch = sys.modules.get("torch")
        if torch is not None and hasattr(torch, "optim"):
            _start()
        elif not any(isinstance(f, _TorchFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, _TorchFinder())
    except BaseException as exc:
        _report(exc)


def _start() -> None:
    try:
        from probe.tables.torch import trace
        from probe.tables.torch.trace_options import TraceOptions

        trace.start(TraceOptions.from_env())
    except BaseException as exc:
        _report(exc)


class _TorchFinder:
    """A meta path finder that only watches for ``import torch``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "torch":
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None

    def invalidate_caches(self) -> None:
        pass


class _Loader:
    """Runs torch's own loader, then starts the trace; everything else goes to the real loader."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: Any) -> Any:
        create = getattr(self._inner, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: Any) -> None:
        try:
            self._inner.exec_module(module)
        finally:
            try:  # the module keeps torch's own loader, as if we had never been there
                module.__loader__ = self._inner
                if getattr(module, "__spec__", None) is not None:
                    module.__spec__.loader = self._inner
            except BaseException:
                pass
        _start()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _report(exc: BaseException) -> None:
    try:
        sys.stderr.write("probe: could not start the torch trace in process %d: %s: %s\n"
                         % (os.getpid(), type(exc).__name__, exc))
        sys.stderr.flush()
    except BaseException:
        pass
