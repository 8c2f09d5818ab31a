"""``torch.anomalies``: where non-finite values (NaN, Inf) first appeared, per step, while a trace checks.

The check runs inside a torch trace started with ``--anomalies`` (``PROBE_TORCH_TRACE_ANOMALIES=1``);
see ``trace_anomaly`` for how it screens tensors without a device sync. The store keeps the first
500 anomalies of the process and the latest 500 after them.
"""

import datetime
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

from probe.errors import NotFound
from probe.tables.spec import Column
from probe.tables.torch._common import torch_or_raise

__all__ = ["NAME", "DESCRIPTION", "COLUMNS", "EXAMPLE", "rows", "AnomalyStore", "STORE"]

NAME = "torch.anomalies"
DESCRIPTION = ("Where NaN or Inf values first appeared: per step and stage, the first traced module whose output "
               "(forward) or input gradient (backward) held one, or the batch itself (stage 'input': the top-level "
               "module's inputs held one, and no module is blamed for that step); recorded while "
               "`probe T trace start --anomalies` runs.")
COLUMNS = (
    Column("step", "BIGINT", "The trace's step (see python.torch_trace) in which the values appeared."),
    Column("seq", "BIGINT", "The span's order within its step (joins python.torch_trace on step, seq, stage)."),
    Column("module", "VARCHAR", "The module whose output (or input gradient) held the values, named as in "
                                "python.torch_trace; for stage 'input', the top-level module the batch was given to."),
    Column("stage", "VARCHAR", "'forward': the module's output; 'backward': the gradient with respect to its input; "
                               "'input': the batch held the values (the top-level module's positional inputs, "
                               "screened before any module ran: the data, not a module, brought them)."),
    Column("kind", "VARCHAR", "'nan', 'inf', 'nan+inf', or 'non-finite' where the exact count was not taken (CUDA)."),
    Column("nan_count", "BIGINT", "Elements that are NaN; NULL on CUDA (counting would need a device sync)."),
    Column("inf_count", "BIGINT", "Elements that are +-Inf; NULL on CUDA."),
    Column("numel", "BIGINT", "Elements of the tensor checked; NULL on CUDA."),
    Column("shape", "VARCHAR", "Its shape, e.g. [64, 1024]; NULL on CUDA."),
    Column("dtype", "VARCHAR", "Its dtype; NULL on CUDA."),
    Column("device", "VARCHAR", "Where the tensor lives: cpu, cuda."),
    Column("loss", "DOUBLE", "The step's loss when known: the last scalar output of a top-level module call in that "
                             "step (an nn.Module criterion), or the 'loss' of a dict it returned (a Hugging Face "
                             "ModelOutput), on CPU; NULL otherwise."),
    Column("time_offset", "DOUBLE", "Seconds since the step began when the module ran."),
    Column("time", "TIMESTAMP", "Wall-clock time (UTC) when the module ran."),
    Column("first", "BOOLEAN", "True for the first anomaly this process recorded."),
    Column("rank", "INTEGER", "This process's rank (RANK, or torch.distributed), 0 if not distributed."),
    Column("world_size", "INTEGER", "Ranks in the job, 1 if not distributed."),
)
EXAMPLE = "SELECT step, module, stage, kind, loss FROM torch.anomalies ORDER BY step, seq LIMIT 1"

_KEEP_FIRST = 500
_KEEP_LAST = 500


class AnomalyStore:
    """The anomalies recorded in this process: bounded, appended from hooks, read by queries."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # held only for list operations: never across torch calls
        self._rows: List[List[Any]] = []
        self.enabled_once = False
        # what fills in the results the device has finished, before a read: the trace's, handed over by
        # probe.tables.torch.trace when it starts one (the trace imports this store, never the other way)
        self.refresh: Optional[Callable[[], None]] = None

    def add(self, step: int, seq: int, module: str, stage: str, nans: Optional[int], infs: Optional[int],
            numel: Optional[int], shape: Optional[List[int]], dtype: Optional[str], device: str, offset: float,
            wall: float) -> None:
        if nans is None or infs is None:
            kind = "non-finite"
        else:
            kind = "+".join(k for k, n in (("nan", nans), ("inf", infs)) if n) or "non-finite"
        shape_text = None if shape is None else "[%s]" % ", ".join(str(d) for d in shape)
        row = [step, seq, module, stage, kind, nans, infs, numel, shape_text,
               None if dtype is None else dtype.replace("torch.", ""), device, None, offset, wall]
        with self._lock:
            if len(self._rows) >= _KEEP_FIRST + _KEEP_LAST:
                del self._rows[_KEEP_FIRST]
            self._rows.append(row)

    def has(self, step: int, stage: str) -> bool:
        with self._lock:
            return any(r[0] == step and r[3] == stage for r in self._rows[-16:])

    def set_loss(self, step: int, loss: Optional[float]) -> None:
        if loss is None:
            return
        with self._lock:
            for row in self._rows[-4:]:
                if row[0] == step and row[11] is None:
                    row[11] = loss

    def snapshot(self) -> List[List[Any]]:
        with self._lock:
            return [list(r) for r in self._rows]

    def __len__(self) -> int:
        return len(self._rows)


STORE = AnomalyStore()


def rows() -> Dict[str, List[Any]]:
    torch = torch_or_raise()
    if not STORE.enabled_once:
        raise NotFound("the NaN/Inf check has not run in this process",
                       hint="switch it on with `probe TARGET trace start --anomalies` "
                            "(or PROBE_TORCH_TRACE=1 PROBE_TORCH_TRACE_ANOMALIES=1 at start)")
    refresh = STORE.refresh
    if refresh is not None:
        refresh()
    rank, world = rank_and_world(torch)
    data = STORE.snapshot()
    out: Dict[str, List[Any]] = {c.name: [] for c in COLUMNS}
    for i, row in enumerate(data):
        for name, value in zip([c.name for c in COLUMNS[:13]], row[:13]):
            out[name].append(value)
        out["time"].append(_utc(row[13]))
        out["first"].append(i == 0)
        out["rank"].append(rank)
        out["world_size"].append(world)
    return out


def rank_and_world(torch: Any) -> Tuple[int, int]:
    """This rank and the world size: torch.distributed when initialised (no collective), else what the launcher
    put in the environment (torchrun's RANK, Open MPI's, Slurm's: a rank of mpirun or srun that never set up
    torch.distributed is still its launcher's rank), else 0 of 1."""
    from probe import _rank

    try:
        dist = getattr(torch, "distributed", None)
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except Exception:
        pass
    known = _rank.at_start()
    return (known.rank if known.rank is not None else 0), (known.world_size if known.world_size is not None else 1)


def _utc(seconds: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).replace(tzinfo=None)
