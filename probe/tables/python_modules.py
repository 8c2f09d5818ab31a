"""``python.modules``: the modules this process has imported."""

import sys
from typing import Any, Iterator, Tuple

from probe.tables.spec import Column

__all__ = ["NAME", "DESCRIPTION", "COLUMNS", "EXAMPLE", "rows"]

NAME = "python.modules"
DESCRIPTION = "Every module in sys.modules, with its file and version where the module declares one."
COLUMNS = (
    Column("name", "VARCHAR", "Module name as imported (e.g. 'torch.nn')."),
    Column("file", "VARCHAR", "File the module was loaded from; NULL for built-in modules."),
    Column("version", "VARCHAR", "The module's __version__, where its namespace holds a string one."),
    Column("is_package", "BOOLEAN", "True when the module is a package (has __path__)."),
)
EXAMPLE = "SELECT name, version FROM python.modules WHERE version IS NOT NULL ORDER BY name"


def rows() -> Iterator[Tuple[Any, ...]]:
    """Each module's values as its own namespace holds them: never through ``getattr``, which calls a
    module-level ``__getattr__`` (PEP 562) for a missing name, and such hooks import submodules lazily
    or warn of deprecation (click's ``__version__``) in the target. A version given only that way
    reads NULL."""
    for name, module in list(sys.modules.items()):
        if module is None:
            continue
        try:
            namespace = object.__getattribute__(module, "__dict__")
            if type(namespace) is not dict:
                raise TypeError("not a module's namespace")
            file = namespace.get("__file__")
            version = namespace.get("__version__")
            is_package = "__path__" in namespace
        except Exception:  # not a module (sys.modules may hold anything): no values read from it
            file, version, is_package = None, None, False
        yield (name, file if isinstance(file, str) else None,
               version if isinstance(version, str) else None, bool(is_package))
