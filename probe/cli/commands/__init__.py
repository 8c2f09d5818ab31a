"""The commands, one module each, registered in one explicit list (see ``probe.cli.app``).

A command that ``probe.cli.fast`` runs without click (the ones people run in loops) declares its options
and arguments once, as plain data (``PARAMS``, see ``probe.cli.spec``), keeps its work in a function of
its own, ``run``, and makes its click command on first use: ``__getattr__ = made_on_first_use("NAME",
make)``, where ``make()`` gives the command the click options made from ``PARAMS``
(``probe.cli.options.with_params``) and returns it; it calls ``run``. The fast path reads the same
``PARAMS``. The module then imports no click until its command is asked for (help, completion, a command
line the fast path leaves to click)."""

import sys
from typing import Any, Callable


def made_on_first_use(name: str, make: Callable[[], Any]) -> Callable[[str], Any]:
    """A module's ``__getattr__`` that makes its click command ``name`` with ``make()`` when first asked for
    it, and keeps it in the module."""
    def module_getattr(attr: str) -> Any:
        if attr != name:
            raise AttributeError("module %r has no attribute %r" % (make.__module__, attr))
        command = make()
        setattr(sys.modules[make.__module__], name, command)
        return command
    return module_getattr
