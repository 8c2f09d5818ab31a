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
    Column("version", "VARCHAR", "The module's __version__, where it has a string one."),
    Column("is_package", "BOOLEAN", "True when the module is a package (has __path__)."),
)
EXAMPLE = "SELECT name, version FROM python.modules WHERE version IS NOT NULL ORDER BY name"


def rows() -> Iterator[Tuple[Any, ...]]:
    for name, module in list(sys.modules.items()):
        if module is None:
            continue
        try:
            file = getattr(module, "__file__", None)
            version = getattr(module, "__version__", None)
            is_package = hasattr(module, "__path__")
        except Exception:  # a module with a hostile __getattr__ must not break the table
            file, version, is_package = None, None, False
        yield (name, file if isinstance(file, str) else None,
               version if isinstance(version, str) else None, bool(is_package))
