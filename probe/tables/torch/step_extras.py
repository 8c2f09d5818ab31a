"""Step extras: what a rank's progress file carries beside its step count (issue 36), for the node
helper's metrics and alerts: the learning rate its optimizer holds, its CUDA memory, the default process
group's collective sequence number, and the time its training thread waited for data.

Why in the progress file: the node helper reads that file without the rank's GIL and without a word to
its agent, so a scrape costs the rank nothing. The rank pays at a step boundary, at most once every
``EVERY_S`` (the step counter compares one float a step to know when: ``probe.tables.torch.steps``), a
refresh of a few microseconds on the training thread. ``PROBE_STEP_EXTRAS=0`` leaves them out (the file
keeps its 64 bytes).

What a refresh reads, each only where the program made it so (probe imports no torch module, initialises
no CUDA, and reads no tensor: a CUDA tensor's value would wait for the device):

- the learning rate: the stepping optimizer's ``param_groups[0]["lr"]`` where it is a Python number (not a
  tensor);
- CUDA memory allocated and reserved by torch's caching allocator on the current device, and the device's
  total (read once a device), where ``torch.cuda.is_initialized()``;
- the default process group's sequence number (collectives and barriers issued, by this rank, in it) where
  ``torch.distributed`` is loaded and initialised;
- data wait: ``_BaseDataLoaderIter.__next__`` is wrapped, once the step counter has seen a step, at class
  level (every DataLoader's iterator); only calls on the thread that stepped at the last refresh are timed
  (a perf_counter pair), so a prefetching thread's waits are not counted as the training loop's. Per step: the time in
  them since the step before; in all: since the wrapper went in. Transparent: the wrapped call's result and
  every exception (StopIteration included) pass through untouched; a call inside another (a loader
  wrapping a loader) is timed once.

The section (``SECTION``, 128 bytes at offset 64 of the progress file; its own magic and version, so a
reader of the 64-byte head alone still reads the head as before) is written in place: first its tail
sequence number, then the values, then its head sequence number; a reader (``read_extras``) takes a
copy whose two numbers agree. Runs in the target: stdlib only, never raises into the training loop.
"""

import os
import struct
import sys
import threading
import time
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

__all__ = ["EVERY_S", "SECTION", "OFFSET", "MAGIC", "VERSION", "Extras", "wanted", "refresh", "read_extras", "LR",
           "CUDA", "COLLECTIVE", "DATA"]

EVERY_S = 1.0  # a refresh at a step boundary at most this often
OFFSET = 64  # after the step counter's head (steps.PROGRESS)
MAGIC = b"probextr"
VERSION = 1
LR, CUDA, COLLECTIVE, DATA = 1, 2, 4, 8  # what a refresh knew (its "known" bits)

# Little-endian: magic, version (u32), known (u32), head sequence number (u64: odd while written), when
# refreshed (f64, time.monotonic()), steps then (i64), lr (f64), CUDA allocated, reserved, device total,
# device index (i64 each), collective sequence number (i64), data wait of the last step and in all (f64),
# batches timed (i64), 8 bytes reserved, tail sequence number (u64).
SECTION = struct.Struct("<8sIIQdqdqqqqqddq8xQ")
_HEAD = struct.Struct("<Q")
_TAIL_AT = SECTION.size - 8


class Extras(NamedTuple):
    """What a progress file's extras say (``read_extras``); None where that refresh did not know it."""

    refreshed: float  # time.monotonic() of the refresh
    steps: int  # the step count it was made at
    lr: Optional[float]
    cuda_allocated: Optional[int]
    cuda_reserved: Optional[int]
    cuda_total: Optional[int]
    cuda_device: Optional[int]
    collective_seq: Optional[int]
    data_wait_last: Optional[float]  # seconds, the step before the refresh
    data_wait_total: Optional[float]
    batches: Optional[int]


def wanted() -> bool:
    return os.environ.get("PROBE_STEP_EXTRAS", "1").strip().lower() not in ("0", "false", "no", "off")


# -- data wait: DataLoader iterators' __next__, timed on the thread that steps ---------------------------

_stepper: Optional[int] = None  # the ident of the thread that stepped at the last refresh (None before one)
_inside = False  # the stepping thread is in a timed __next__ now (a nested one is not timed again)
_waited = 0.0  # seconds in timed __next__ calls, in all
_batches = 0
_since = 0.0  # of them, since the step that ``_mark`` counted
_mark = -1
_steps_seen: Callable[[], int] = lambda: 0  # the step counter's count (handed over by refresh)
_wrap_state: Dict[str, Any] = {"done": False, "original": None}
_get_ident = threading.get_ident
_perf = time.perf_counter


def _timed_next(self: Any) -> Any:
    """``_BaseDataLoaderIter.__next__``, timed where the thread that steps calls it."""
    global _inside, _waited, _batches, _since, _mark
    original = _wrap_state["original"]
    if _inside or _get_ident() != _stepper:
        return original(self)
    _inside = True
    start = _perf()
    try:
        return original(self)
    finally:
        took = _perf() - start
        _inside = False
        try:
            _waited += took
            _batches += 1
            steps = _steps_seen()
            if steps != _mark:  # the first batch since a step ended: a new step's wait begins
                _mark, _since = steps, took
            else:
                _since += took
        except BaseException:  # noqa: BLE001 -- never in the loader's way
            pass


def _wrap_loader() -> None:
    """Put ``_timed_next`` in place of ``_BaseDataLoaderIter.__next__`` once the program has loaded torch's
    DataLoader (never importing it); once a process."""
    if _wrap_state["done"]:
        return
    module = sys.modules.get("torch.utils.data.dataloader")
    base = getattr(module, "_BaseDataLoaderIter", None)
    if base is None:
        return
    _wrap_state["done"] = True
    original = base.__dict__.get("__next__")
    if original is None or getattr(original, "_probe_timed", False):
        return
    _wrap_state["original"] = original
    _timed_next.__doc__ = original.__doc__  # its own name stays: a stack shows probe's frame for what it is
    _timed_next.__wrapped__ = original  # type: ignore[attr-defined]
    _timed_next._probe_timed = True  # type: ignore[attr-defined]
    base.__next__ = _timed_next


# -- the refresh (training thread, at a step boundary) ------------------------------------------------

_totals: Dict[int, int] = {}  # CUDA device -> its total memory (read once)
RETRY_S = 60.0  # a read that raised (a backend without sequence numbers, an allocator without stats) rests so long
_resting = {"collective": 0.0, "cuda": 0.0}  # time.monotonic() until which it rests


def _lr(optimizer: Any) -> Optional[float]:
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return None
    value = groups[0].get("lr") if isinstance(groups[0], dict) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None  # a tensor (its value would wait for the device), or none


def _cuda() -> Optional[Tuple[int, int, int, int]]:
    """(allocated, reserved, device total, device) of the current device, where the program initialised
    CUDA; never initialises it."""
    cuda = sys.modules.get("torch.cuda")
    if cuda is None or _resting["cuda"] > time.monotonic() or not cuda.is_initialized():
        return None
    try:
        device = int(cuda.current_device())
        stats = getattr(sys.modules.get("torch._C"), "_cuda_memoryStats", None)
        if stats is not None:  # one call and two lookups, where memory_allocated and memory_reserved flatten it twice
            raw = stats(device)
            allocated, reserved = raw["allocated_bytes"]["all"]["current"], raw["reserved_bytes"]["all"]["current"]
        else:
            allocated, reserved = cuda.memory_allocated(device), cuda.memory_reserved(device)
        if device not in _totals:
            _totals[device] = int(cuda.get_device_properties(device).total_memory)
        return int(allocated), int(reserved), _totals[device], device
    except Exception:  # noqa: BLE001 -- an allocator without these stats: left out a while
        _resting["cuda"] = time.monotonic() + RETRY_S
        return None


def _collective() -> Optional[int]:
    dist = sys.modules.get("torch.distributed")
    if dist is None or _resting["collective"] > time.monotonic():
        return None
    try:
        if not dist.is_available() or not dist.is_initialized():
            return None
        c10d = sys.modules["torch.distributed.distributed_c10d"]
        return int(c10d._get_default_group()._get_sequence_number_for_group())
    except Exception:  # noqa: BLE001 -- a backend without sequence numbers (or none yet): left out a while
        _resting["collective"] = time.monotonic() + RETRY_S
        return None


_seq = [0]  # the section's sequence number: even when whole


def refresh(mapped: Any, optimizer: Any, steps: int, now: float, steps_seen: Callable[[], int]) -> None:
    """Write the extras of the step that just ended (``steps`` in all) into the progress file ``mapped``
    (at least ``OFFSET + SECTION.size`` bytes). ``steps_seen`` reads the step counter's count (the import
    runs from the counter to here only). Never raises."""
    global _stepper, _steps_seen
    try:
        _stepper, _steps_seen = _get_ident(), steps_seen  # the thread that steps now
        _wrap_loader()
        known = 0
        lr = _lr(optimizer)
        if lr is not None:
            known |= LR
        cuda = _cuda()
        if cuda is not None:
            known |= CUDA
        seq = _collective()
        if seq is not None:
            known |= COLLECTIVE
        last = 0.0
        if _wrap_state["original"] is not None:
            known |= DATA
            last = _since if _mark == steps - 1 else 0.0  # no batch since the step before: no wait
        allocated, reserved, total, device = cuda or (0, 0, 0, -1)
        number = _seq[0] + 2
        _HEAD.pack_into(mapped, OFFSET + _TAIL_AT, number - 1)  # the tail first: a copy in between disagrees
        SECTION.pack_into(mapped, OFFSET, MAGIC, VERSION, known, number - 1, now, steps, lr or 0.0, allocated,
                          reserved, total, device, seq or 0, last, _waited, _batches, number - 1)
        _HEAD.pack_into(mapped, OFFSET + _TAIL_AT, number)
        _HEAD.pack_into(mapped, OFFSET + 16, number)  # the head last
        _seq[0] = number
    except BaseException:  # noqa: BLE001 -- never into the training loop
        pass


# -- the reader (the node helper) ------------------------------------------------------------------------


def read_extras(path: str) -> Optional[Extras]:
    """The extras of the progress file at ``path``; None where it has none (an older agent, the extras off,
    no refresh yet) or they are not ones this reader knows (magic, version)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        for _ in range(3):
            raw = os.pread(fd, SECTION.size, OFFSET)
            if len(raw) < SECTION.size:
                return None
            fields = SECTION.unpack(raw)
            if fields[3] == fields[-1] and not fields[3] % 2:
                break
        else:
            return None  # written under every copy: the next read will tell
    except OSError:
        return None
    finally:
        os.close(fd)
    (magic, version, known, head, refreshed, steps, lr, allocated, reserved, total, device, seq, last, waited,
     batches, _tail) = fields
    if magic != MAGIC or version != VERSION or not head:
        return None
    cuda = bool(known & CUDA)
    data = bool(known & DATA)
    return Extras(refreshed, steps, lr if known & LR else None, allocated if cuda else None,
                  reserved if cuda else None, total if cuda else None, device if cuda else None,
                  seq if known & COLLECTIVE else None, last if data else None, waited if data else None,
                  batches if data else None)
