"""The tables probe ships, registered through the public ``register_table`` like any user's table."""

from probe.tables import (process_env, process_info, python_backtrace, python_locals, python_locks, python_modules,
                          python_paths, python_threads, python_workers)
from probe.agent import audit as probe_audit
from probe.tables.registry import register_table
from probe.tables.torch import distributed as torch_distributed
from probe.tables.torch import flight_recorder as torch_flight_recorder
from probe.tables.torch import memory as torch_memory
from probe.tables.torch import optimizers as torch_optimizers
from probe.tables.torch import parameters as torch_parameters
from probe.tables.torch import steps as torch_steps
from probe.tables.torch import tensors as torch_tensors
from probe.tables.torch import anomalies as torch_anomalies  # noqa: I001
from probe.tables.torch import trainer as torch_trainer
from probe.tables.torch import trace as torch_trace

__all__ = ["BUILTIN_MODULES", "register_all"]

#: torch.* tables: registered always, answering with TorchNotLoaded until the target imports torch.
TORCH_MODULES = (torch_parameters, torch_optimizers, torch_tensors, torch_memory, torch_distributed,
                 torch_flight_recorder, torch_trainer, torch_steps)
#: python.torch_trace and torch.anomalies: rows only while (or after) a trace runs (`probe T trace start`).
TRACE_MODULES = (torch_trace, torch_anomalies)
BUILTIN_MODULES = (python_backtrace, python_threads, python_locals, python_modules, python_workers, python_paths,
                   python_locks, process_info, process_env) + TORCH_MODULES + TRACE_MODULES + (probe_audit,)


def register_all() -> None:
    for module in BUILTIN_MODULES:
        register_table(module.NAME, module.COLUMNS, module.rows, module.DESCRIPTION, example=module.EXAMPLE)
