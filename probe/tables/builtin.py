"""The tables probe ships: the registry registers each (``probe.tables.registry``) through the public
``register_table``, like any user's table, the first time a table is looked up.

Imports run one way: the registry reads this list, and nothing listed here imports the registry or the
``probe.tables`` package's front (each module is imported by its own name).
"""

import probe.tables.process_env as process_env
import probe.tables.process_info as process_info
import probe.tables.probe_audit as probe_audit
import probe.tables.python_backtrace as python_backtrace
import probe.tables.python_locals as python_locals
import probe.tables.python_locks as python_locks
import probe.tables.python_modules as python_modules
import probe.tables.python_paths as python_paths
import probe.tables.python_threads as python_threads
import probe.tables.python_workers as python_workers
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
from probe.tables.torch import profile as torch_profile

__all__ = ["BUILTIN_MODULES"]

#: torch.* tables: registered always, answering with TorchNotLoaded until the target imports torch.
TORCH_MODULES = (torch_parameters, torch_optimizers, torch_tensors, torch_memory, torch_distributed,
                 torch_flight_recorder, torch_trainer, torch_steps)
#: python.torch_trace and torch.anomalies: rows only while (or after) a trace runs (`probe T trace start`);
#: torch.profile: rows once a profile has been captured (`probe T profile`).
TRACE_MODULES = (torch_trace, torch_anomalies, torch_profile)
BUILTIN_MODULES = (python_backtrace, python_threads, python_locals, python_modules, python_workers, python_paths,
                   python_locks, process_info, process_env) + TORCH_MODULES + TRACE_MODULES + (probe_audit,)

