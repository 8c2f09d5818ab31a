"""The spans of a torch trace: a fixed-size ring of preallocated records, oldest spans dropped first.

Runs in the training step's hooks, so an append allocates nothing and touches little memory: a slot comes
from an ``itertools.count`` (atomic under the GIL, so hooks on several threads, e.g. autograd's device
threads, never share one), and the span's 16 numbers go into the slot's 128-byte record of one
``bytearray`` with one ``Struct.pack_into`` call: one C call that holds the GIL throughout, so a reader
never sees half a record, and two cache lines where a column per value touched sixteen arrays (the
hooks run right after the step's matmuls have flushed the caches: each line missed costs). The memory
is fixed at creation: 128 bytes per span. A reader copies the whole buffer in one C call (the GIL held:
a consistent copy) and cuts it into columns with strided copies; ``arrays`` hands out those columns as
``array.array`` copies, for a query to wrap as Arrow columns without a Python object per value;
``snapshot`` makes lists of them.
"""

import itertools
import struct
from array import array
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["SpanRing", "STAGES", "FORWARD", "BACKWARD", "OPTIMIZER", "RECORD_BYTES"]

FORWARD, BACKWARD, OPTIMIZER = 0, 1, 2
STAGES = ("forward", "backward", "optimizer")

_MAX_NAMES = 100_000

# A record: "number" (the span's number since the ring was made, plus one: 0 is an empty slot), then the
# integer columns, then the float columns, 8 bytes each.
_INT_COLUMNS = ("step", "seq", "module", "stage", "depth", "thread", "start_ns")
_FLOAT_COLUMNS = ("host", "duration", "total", "time_offset", "allocated", "max_allocated", "cached", "max_cached")
_FIELDS = 1 + len(_INT_COLUMNS) + len(_FLOAT_COLUMNS)
_RECORD = struct.Struct("=%dq%dd" % (1 + len(_INT_COLUMNS), len(_FLOAT_COLUMNS)))
_BYTES = RECORD_BYTES = _RECORD.size  # 128
_TOTAL = 8 * (1 + _INT_COLUMNS.index("start_ns") + 1 + _FLOAT_COLUMNS.index("total"))  # offset of "total"
_DEVICE_TIMES = struct.Struct("=2d")  # duration, total: where a device time is filled in later
_NUMBER = struct.Struct("=q")
_FLOAT = struct.Struct("=d")


class SpanRing:
    """``size`` spans at most; ``add`` overwrites the oldest when full."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._next = itertools.count()
        self._buffer = bytearray(_BYTES * size)
        # Written through once, so every page is resident from the start: a bytearray(n) is calloc'd, and
        # its pages would fault in one by one under the hooks (a fault every 32 spans, 10-50 us each here).
        zeros = bytes(min(len(self._buffer), 1 << 20))
        for at in range(0, len(self._buffer), len(zeros)):
            self._buffer[at:at + len(zeros)] = zeros[:len(self._buffer) - at]
        self._pack = _RECORD.pack_into
        self._names: List[str] = []
        self._name_ids: Dict[str, int] = {}

    def name_id(self, name: str) -> int:
        """A small number for a module name (names are stored once, not per span)."""
        found = self._name_ids.get(name)
        if found is not None:
            return found
        if len(self._names) >= _MAX_NAMES:
            name = "<other>"
            found = self._name_ids.get(name)
            if found is not None:
                return found
        self._names.append(name)
        self._name_ids[name] = len(self._names) - 1
        return len(self._names) - 1

    def writer(self) -> Tuple[Any, Any, bytearray, int]:
        """What ``add`` uses, for a hook that writes records itself (one Python call less a span): the
        counter of span numbers, ``pack_into`` of a record, the buffer and the ring's size. A record:
        ``pack(buffer, number % size * RECORD_BYTES, number + 1, step, seq, module, stage, depth, thread,
        start_ns, host, duration, total, time_offset, allocated, max_allocated, cached, max_cached)``."""
        return self._next, self._pack, self._buffer, self.size

    def add(self, step: int, seq: int, module: int, stage: int, depth: int, thread: int, start_ns: int,
            host_ns: int, duration: float, total: float, offset: float, memory: Tuple[float, float, float, float]) -> int:
        """Store one span; returns its number (used to fill in a device-measured duration later)."""
        number = next(self._next)
        self._pack(self._buffer, number % self.size * _BYTES, number + 1, step, seq, module, stage, depth, thread,
                   start_ns, host_ns / 1e9, duration, total, offset, memory[0], memory[1], memory[2], memory[3])
        return number

    def set_device_time(self, number: int, total: float, children: Optional[List[int]]) -> None:
        """Span ``number``'s device time (unless overwritten since): ``total``, and its own part without
        the ``children`` spans' device totals (children end, so resolve, before their parent)."""
        buffer = self._buffer
        at = number % self.size * _BYTES
        if _NUMBER.unpack_from(buffer, at)[0] != number + 1:
            return
        inner = 0.0
        for child in children or ():
            j = child % self.size * _BYTES
            if _NUMBER.unpack_from(buffer, j)[0] == child + 1:
                inner += _FLOAT.unpack_from(buffer, j + _TOTAL)[0]
        _DEVICE_TIMES.pack_into(buffer, at + _TOTAL - 8, max(total - inner, 0.0), total)

    def _numbers(self, copy: Any) -> "array[int]":
        numbers = array("q")
        numbers.frombytes(memoryview(copy).cast("q")[0::_FIELDS].tobytes())
        return numbers

    def written(self) -> int:
        """Spans added since the ring was made (held: at most ``size``)."""
        return max(self._numbers(self._buffer), default=0)

    def held(self) -> int:
        return self.size - self._numbers(self._buffer).count(0)

    def arrays(self) -> Tuple[Dict[str, "array[Any]"], List[str], int]:
        """Every complete span as a copy of each column (``array.array``: no Python object per value), the
        module names that the ``module`` ids index (``stage`` ids index ``STAGES``), and ``first``: oldest
        first, the spans are each column's ``[first:]`` followed by its ``[:first]``.

        One copy of the buffer (a memcpy with the GIL held: no record half written), then a strided copy
        per column. In the usual case the slots hold consecutive spans; where a hook on another thread had
        taken its number but not yet written its record, the spans held are picked one by one (``first``
        is 0).
        """
        copy = bytes(self._buffer)
        names = list(self._names)  # after the copy: every id it holds indexes a name added before
        ints, floats = memoryview(copy).cast("q"), memoryview(copy).cast("d")
        columns: Dict[str, "array[Any]"] = {}
        for i, name in enumerate(_INT_COLUMNS, 1):
            columns[name] = array("q")
            columns[name].frombytes(ints[i::_FIELDS].tobytes())
        for i, name in enumerate(_FLOAT_COLUMNS, 1 + len(_INT_COLUMNS)):
            columns[name] = array("d")
            columns[name].frombytes(floats[i::_FIELDS].tobytes())
        numbers = self._numbers(copy).tolist()
        top = max(numbers, default=0)  # the newest span's number + 1 (0: none)
        held = min(top, self.size)
        first = top % self.size if held == self.size else 0
        if numbers[first:] + numbers[:first] == list(range(top - held + 1, top + 1)) + [0] * (self.size - held):
            if held == self.size:
                return columns, names, first
            return {name: values[:held] for name, values in columns.items()}, names, 0
        order = [k for _, k in sorted((n, k) for k, n in enumerate(numbers) if n > 0)]
        return {name: array(values.typecode, [values[k] for k in order]) for name, values in columns.items()}, names, 0

    def snapshot(self) -> Dict[str, list]:
        """Every complete span, oldest first, as one list per column (``module`` and ``stage`` as text)."""
        columns, names, first = self.arrays()
        out: Dict[str, list] = {}
        for name, values in columns.items():
            listed = values.tolist()
            out[name] = listed[first:] + listed[:first] if first else listed
        out["module"] = [names[i] for i in out["module"]]
        out["stage"] = [STAGES[i] for i in out["stage"]]
        return out
