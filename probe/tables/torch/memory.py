"""``torch.memory``: memory per device: the CUDA caching allocator's statistics where CUDA is initialised,
and for the CPU what the process holds (RSS) and its live CPU tensors."""

from typing import Any, Dict, Iterator, Optional, Tuple

from probe.tables.spec import Column
from probe.tables.torch._common import Deadline, at_step_boundary, torch_or_raise
from probe.tables.torch.tensors import BUDGET_S, CHUNK, outside_backward, scan

__all__ = ["NAME", "DESCRIPTION", "COLUMNS", "EXAMPLE", "rows"]

NAME = "torch.memory"
DESCRIPTION = ("Memory per device. cuda:N rows: the caching allocator's statistics (torch.cuda.memory_stats), "
               "only when the program has initialised CUDA (probe never does). The cpu row: the process's "
               "resident memory and the bytes of its live CPU tensors.")
_CUDA = " (cuda rows; NULL on the cpu row)."
COLUMNS = (
    Column("device", "VARCHAR", "cpu, or cuda:N."),
    Column("source", "VARCHAR", "cuda_caching_allocator (torch.cuda.memory_stats) or process (/proc/self/status "
                                "and the live CPU tensors)."),
    Column("allocated_bytes", "BIGINT", "Bytes in tensors now: the allocator's allocated_bytes.all.current; on "
                                        "the cpu row, the storages of live CPU tensors (each counted once)."),
    Column("peak_allocated_bytes", "BIGINT", "Highest allocated_bytes since start or the last peak reset" + _CUDA),
    Column("reserved_bytes", "BIGINT", "Bytes the allocator holds from the driver (reserved_bytes.all.current)"
                                       + _CUDA),
    Column("peak_reserved_bytes", "BIGINT", "Highest reserved_bytes" + _CUDA),
    Column("inactive_split_bytes", "BIGINT", "Bytes in split blocks not in use: the allocator's fragmentation"
                                             + _CUDA),
    Column("fragmentation", "DOUBLE", "Share of reserved memory not allocated: 1 - allocated/reserved" + _CUDA),
    Column("num_allocs", "BIGINT", "Allocations served since start (allocation.all.allocated)" + _CUDA),
    Column("num_alloc_retries", "BIGINT", "cudaMalloc calls that failed and were retried after freeing the "
                                          "cache (a sign of memory pressure)" + _CUDA),
    Column("num_ooms", "BIGINT", "Out-of-memory errors raised by the allocator" + _CUDA),
    Column("rss_bytes", "BIGINT", "The process's resident memory (VmRSS; cpu row, NULL on cuda rows)."),
    Column("peak_rss_bytes", "BIGINT", "The process's highest resident memory (VmHWM; cpu row)."),
    Column("tensors", "BIGINT", "Live tensors on that device found by the collector (cpu row; the scan of "
                                "torch.tensors, with its bounds)."),
    Column("complete", "BOOLEAN", "False when the tensor scan stopped early (cpu row): tensors and "
                                  "allocated_bytes are then lower bounds."),
)
EXAMPLE = "SELECT device, allocated_bytes / 1e6 AS mb, peak_allocated_bytes / 1e6 AS peak_mb FROM torch.memory"


def rows() -> Iterator[Tuple[Any, ...]]:
    torch = torch_or_raise()
    yield _cpu_row(torch)
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        for index in range(cuda.device_count()):
            yield _cuda_row(cuda, index)


def _cpu_row(torch: Any) -> Tuple[Any, ...]:
    """Read right after an optimizer step when the job steps (see torch.tensors: tensors read while a
    step runs can crash the target), else where the job stands."""
    done, _ = at_step_boundary(lambda: _cpu_row_now(torch), BUDGET_S + 5.0)
    return done if done is not None else _cpu_row_now(torch)


def _cpu_row_now(torch: Any) -> Tuple[Any, ...]:
    tensors, complete = scan(torch)
    storages: Dict[int, int] = {}
    count = 0
    def measure(part: Any) -> bool:
        nonlocal count
        for tensor in part:
            try:
                if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.device.type != "cpu":
                    continue
                count += 1
                if tensor.layout == torch.strided:
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
            except Exception:
                continue
        return True

    deadline = Deadline(BUDGET_S)
    for start in range(0, len(tensors), CHUNK):
        if outside_backward(lambda part=tensors[start:start + CHUNK]: measure(part), deadline) is None:
            complete = False
            break
    del tensors
    status = _proc_status()
    return ("cpu", "process", sum(storages.values()), None, None, None, None, None, None, None, None,
            status.get("VmRSS"), status.get("VmHWM"), count, complete)


def _cuda_row(cuda: Any, index: int) -> Tuple[Any, ...]:
    stats = cuda.memory_stats(index)  # host-side counters of the allocator: no device synchronisation
    allocated = stats.get("allocated_bytes.all.current")
    reserved = stats.get("reserved_bytes.all.current")
    fragmentation: Optional[float] = None
    if allocated is not None and reserved:
        fragmentation = 1.0 - allocated / reserved
    return ("cuda:%d" % index, "cuda_caching_allocator", allocated, stats.get("allocated_bytes.all.peak"), reserved,
            stats.get("reserved_bytes.all.peak"), stats.get("inactive_split_bytes.all.current"), fragmentation,
            stats.get("allocation.all.allocated"), stats.get("num_alloc_retries"), stats.get("num_ooms"),
            None, None, None, None)


def _proc_status() -> Dict[str, int]:
    """VmRSS, VmHWM ... from /proc/self/status, in bytes (empty where there is no /proc)."""
    out: Dict[str, int] = {}
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                parts = value.split()
                if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
                    out[key] = int(parts[0]) * 1024
    except OSError:
        pass
    return out
