"""probe: ask a live Python process questions in SQL, and run Python in it.

``probe.start()`` runs the agent in this process; ``probe.register_table(...)`` adds a table to it;
``probe.connect(target)`` and ``probe.attach(pid)`` give a client of an agent elsewhere;
``probe.watch(model, optimizer)`` names what the torch tables and the checkpoint look at. Names are
imported on first use so that ``import probe`` inside a target costs next to nothing.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is for the checker alone: importing it costs every command some 4 ms
    from typing import Any

__version__ = "0.1.0"
# The distribution's name on the package index: `probe` there is another project (and so are torchprobe and
# pyprobe). The command and the import stay `probe`.
DISTRIBUTION = "rankprobe"

__all__ = ["__version__", "start", "stop", "register_table", "Column", "connect", "attach", "ProbeError", "watch",
           "connect_all"]

_LAZY = {
    "start": ("probe.agent", "start"),
    "stop": ("probe.agent", "stop"),
    "register_table": ("probe.tables", "register_table"),
    "Column": ("probe.tables", "Column"),
    "connect": ("probe.client", "connect"),
    "attach": ("probe.client", "attach"),
    "connect_all": ("probe.client.cluster", "connect_all"),
    "ProbeError": ("probe.errors", "ProbeError"),
    "watch": ("probe.tables.torch.discovery", "watch"),
}

_SOURCE_KINDS = ("probe.snapshot.target",)  # snapshot:PATH, for probe.connect and probe.connect_all


def __getattr__(name: str) -> Any:
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError("module 'probe' has no attribute %r" % name) from None
    import importlib

    if module_name.startswith("probe.client"):  # the source kinds defined above the client register themselves
        for kind_module in _SOURCE_KINDS:  # with it as they are imported (probe.client.sources)
            importlib.import_module(kind_module)
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value
