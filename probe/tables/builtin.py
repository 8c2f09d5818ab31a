"""The tables probe ships, registered through the public ``register_table`` like any user's table."""

from probe.tables import process_env, process_info, python_backtrace, python_locals, python_modules, python_threads
from probe.tables.registry import register_table

__all__ = ["BUILTIN_MODULES", "register_all"]

BUILTIN_MODULES = (python_backtrace, python_threads, python_locals, python_modules, process_info, process_env)


def register_all() -> None:
    for module in BUILTIN_MODULES:
        register_table(module.NAME, module.COLUMNS, module.rows, module.DESCRIPTION, example=module.EXAMPLE)
