"""The spans of a torch trace: a fixed-size ring of preallocated typed arrays, oldest spans dropped first.

Runs in the training step's hooks, so an append allocates nothing beyond the numbers it stores: a slot
comes from an ``itertools.count`` (atomic under the GIL, so hooks on several threads, e.g. autograd's
device threads, never share one), and its values go into ``array.array`` columns. The memory is fixed
at creation: about 100 bytes per span. A reader copies the columns without a lock; a slot rewritten
while it copied is left out (each slot carries the number of the span it holds, read before and after).
``arrays`` hands out those copies as they are, for a query to wrap as Arrow columns without a Python
object per value; ``snapshot`` makes lists of them.
"""

import itertools
from array import array
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["SpanRing", "STAGES", "FORWARD", "BACKWARD", "OPTIMIZER"]

FORWARD, BACKWARD, OPTIMIZER = 0, 1, 2
STAGES = ("forward", "backward", "optimizer")

_MAX_NAMES = 100_000

# column -> array typecode; "seqno" (the span's number since the ring was made) is written last.
_INT_COLUMNS = ("step", "seq", "module", "stage", "depth", "thread", "start_ns")
_FLOAT_COLUMNS = ("host", "duration", "total", "time_offset", "allocated", "max_allocated", "cached", "max_cached")


class SpanRing:
    """``size`` spans at most; ``add`` overwrites the oldest when full."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._next = itertools.count()
        zeros = bytes(8 * size)
        self._ints: Dict[str, "array[int]"] = {name: array("q", zeros) for name in _INT_COLUMNS}
        self._floats: Dict[str, "array[float]"] = {name: array("d", zeros) for name in _FLOAT_COLUMNS}
        self._seqno = array("q", [-1]) * size
        self._names: List[str] = []
        self._name_ids: Dict[str, int] = {}
        # Bound per column, so ``add`` does no dict look-up.
        (self._step, self._seq, self._module, self._stage, self._depth, self._thread,
         self._start) = (self._ints[n] for n in _INT_COLUMNS)
        (self._host, self._duration, self._total, self._offset, self._allocated, self._max_allocated, self._cached,
         self._max_cached) = (self._floats[n] for n in _FLOAT_COLUMNS)

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

    def add(self, step: int, seq: int, module: int, stage: int, depth: int, thread: int, start_ns: int,
            host_ns: int, duration: float, total: float, offset: float, memory: Tuple[float, float, float, float]) -> int:
        """Store one span; returns its number (used to fill in a device-measured duration later)."""
        number = next(self._next)
        k = number % self.size
        self._seqno[k] = -1
        self._step[k] = step
        self._seq[k] = seq
        self._module[k] = module
        self._stage[k] = stage
        self._depth[k] = depth
        self._thread[k] = thread
        self._start[k] = start_ns
        self._host[k] = host_ns / 1e9
        self._duration[k] = duration
        self._total[k] = total
        self._offset[k] = offset
        self._allocated[k], self._max_allocated[k], self._cached[k], self._max_cached[k] = memory
        self._seqno[k] = number
        return number

    def set_device_time(self, number: int, total: float, children: Optional[List[int]]) -> None:
        """Span ``number``'s device time (unless overwritten since): ``total``, and its own part without
        the ``children`` spans' device totals (children end, so resolve, before their parent)."""
        k = number % self.size
        if self._seqno[k] != number:
            return
        inner = 0.0
        for child in children or ():
            j = child % self.size
            if self._seqno[j] == child:
                inner += self._total[j]
        self._total[k] = total
        self._duration[k] = max(total - inner, 0.0)

    def written(self) -> int:
        """Spans added since the ring was made (held: at most ``size``)."""
        held = [n for n in self._seqno.tolist() if n >= 0]
        return max(held) + 1 if held else 0

    def held(self) -> int:
        return sum(1 for n in self._seqno.tolist() if n >= 0)

    def arrays(self) -> Tuple[Dict[str, "array[Any]"], List[str], int]:
        """Every complete span as a copy of each column (``array.array``: no Python object per value), the
        module names that the ``module`` ids index (``stage`` ids index ``STAGES``), and ``first``: oldest
        first, the spans are each column's ``[first:]`` followed by its ``[:first]``.

        The copies are memcpy's, taken without a lock; in the usual case (no slot rewritten while they
        were taken) that is all. Otherwise the complete slots are picked one by one (``first`` is 0).
        """
        before = self._seqno[:]
        columns: Dict[str, "array[Any]"] = {name: column[:] for name, column in self._ints.items()}
        columns.update((name, column[:]) for name, column in self._floats.items())
        after = self._seqno[:]
        names = list(self._names)  # after the columns: every id they hold indexes a name added before
        top = max(after) if after else -1
        held = min(top + 1, self.size)
        if before == after and (top < 0 or after[top % self.size] == top) and (
                held < self.size or after[(top + 1) % self.size] == top + 1 - self.size):
            if held == self.size:
                return columns, names, (top + 1) % self.size
            return {name: values[:held] for name, values in columns.items()}, names, 0
        keep = sorted((n, k) for k, (n, m) in enumerate(zip(before, after)) if n >= 0 and n == m)
        order = [k for _, k in keep]
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
