"""dist_diagnose.py with a short process-group timeout (``PG_TIMEOUT_S``), whose ranks leave torch's Flight
Recorder dump at ``$TORCH_FR_DUMP_TEMP_FILE<rank>`` as torch's NCCL watchdog does on a timeout.

torch 2.13 writes that file only from ProcessGroupNCCL's watchdog: a gloo group records into the same
recorder, but nothing dumps it when a collective times out. So this job writes torch's own dump bytes
(``_dump_fr_trace()``, the pickle the watchdog writes) to the same name: the rank whose collective timed
out as the error comes back, and a rank that torchrun then stops with SIGTERM from its handler.
"""

import os
import runpy
import signal
from datetime import timedelta

import torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace

HERE = os.path.dirname(os.path.abspath(__file__))


def dump() -> None:
    with open(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + os.environ["RANK"], "wb") as handle:
        handle.write(_dump_fr_trace())


def on_sigterm(signum: int, frame: object) -> None:
    dump()
    os._exit(128 + signum)


_init = dist.init_process_group


def init_with_short_timeout(*args: object, **kwargs: object) -> None:
    kwargs["timeout"] = timedelta(seconds=float(os.environ.get("PG_TIMEOUT_S", "10")))
    _init(*args, **kwargs)  # type: ignore[arg-type]


dist.init_process_group = init_with_short_timeout  # type: ignore[assignment]
signal.signal(signal.SIGTERM, on_sigterm)
try:
    runpy.run_path(os.path.join(HERE, "dist_diagnose.py"), run_name="__main__")
except Exception:
    dump()
    raise
