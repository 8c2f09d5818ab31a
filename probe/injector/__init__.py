"""The injector: start the probe agent inside an already-running Python process, by pid.

``inject(pid)`` diagnoses the target from /proc (no such process, not Python, too old, gdb missing,
ptrace refused and why, an agent already there), then has gdb, with only libpython's and libc's symbols
loaded, run one bootstrap statement in the target by the safest method the threads' states allow:

* ``pending_call`` (the usual one): ``Py_AddPendingCall(PyRun_SimpleString, code)``; the interpreter
  runs it on the main thread at its next check between bytecodes. gdb never waits in the target and
  detaches at once; the injector then waits for the agent's socket from outside.
* ``gil_ensure``, when the main thread is blocked in C (``Event.wait()``, a lock, a long sleep):
  ``PyGILState_Ensure`` + ``PyRun_SimpleString`` + ``PyGILState_Release`` on a thread parked in a wait
  that CPython entered with the GIL released, and only when no thread holds the GIL inside a C call.
* ``remote_exec`` on Python 3.14+ with a client of the same version (PEP 768; untested here).

It never runs code on a thread stopped inside bytecode, never kills gdb while a call it made is in
progress, and gives up within ``timeout`` with the reason and the next step (``InjectError.hint``).
Runs in the client's process; docs/agent.md says how a user starts the agent.
"""

import importlib
import sys
import types
from typing import Any

__all__ = ["inject", "InjectResult", "diagnose", "Problem", "candidates", "Candidate", "agent_answers"]

# Each name's module, imported on first use: a command that needs one small module of the package (``probe
# list`` asks who may write a directory) does not pay for gdb's driver and the rest (~18 ms).
_HOMES = {"Candidate": "candidates", "candidates": "candidates", "Problem": "diagnose", "diagnose": "diagnose",
          "InjectResult": "inject", "agent_answers": "inject", "inject": "inject"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError("module %r has no attribute %r" % (__name__, name))
    value = getattr(importlib.import_module("%s.%s" % (__name__, home)), name)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """Three functions share their module's name (``inject``, ``diagnose``, ``candidates``); importing the
    module would set the package's attribute to it. The attribute stays the function, as it was when this
    package imported them eagerly; the modules are in ``sys.modules``."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _HOMES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
