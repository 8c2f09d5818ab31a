"""A CPython 3.11 process's Python stacks read from its memory (``/proc/PID/mem``), without py-spy: the read
``probe PID backtrace`` makes of a process with no agent, in about a millisecond where running py-spy costs
about ten (its own start and its reading of the interpreter's symbols, on every call).

Imports only ``os``, ``sys`` and ``time`` (``struct`` where the symbol offsets are not kept yet): the
command's start-up is most of its time (``probe.cli.quick``).

What is read, and how it is trusted:

* ``_PyRuntime`` and ``Py_Version``, by the symbols of the mapped ``libpython3.*.so``, or of the executable
  for an interpreter that links libpython statically (Debian's ``/usr/bin/python3.11``, PIE or not): see
  ``probe.reader.elf_symbols``, which keeps their offsets per file in the user's own runtime directory and
  checks what it reads back as anything read from the target.
* The interpreter (only one; subinterpreters are left to py-spy), its thread states, their frames, code
  objects, strings and ``threading._active`` for the thread names, at the offsets of CPython 3.11 on x86-64
  (``Py_Version`` must say 3.11). Every object's type is checked by its type's name, every size bounded.
* A stack is one the thread was in only if it did not change during the read. Python's state changes only
  under the GIL, which must be free before and after the read, taken by no thread new to it meanwhile
  (its ``switch_number`` the same), and every thread that has a Python thread state asleep (state S or D)
  with the same context switch counts before and after the read (a thread that ran meanwhile went through
  the scheduler). Otherwise the read is tried again a few times within some 30 ms, then given up. Threads
  of C alone (a library's pool) may run meanwhile: they touch no Python frame.

Anything unexpected (another version, a permission refused, a thread not named by ``threading``, a
thread that keeps running) gives None, and the caller reads with py-spy as before; ``read`` says why, in
words for the user where no other reader can read the process either. Linux only.
"""

from __future__ import annotations

import os
import sys
import time

from probe.reader import elf_symbols
from probe.reader.elf_symbols import CACHE_NAME

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Dict, List, Optional, Tuple

    Thread = Tuple[int, int, str, bool, List[Tuple[str, str, int]]]

__all__ = ["read_threads", "read", "SOURCE", "CACHE_NAME"]

SOURCE = ("read from outside the live process by probe, none of its threads running during the read "
          "(every stack is one it was in)")
"""How the stacks were read, for ``Stacks.source`` (the note ``probe PID backtrace`` prints on stderr)."""
TRIES = 5
MAX_THREADS = 4096
MAX_DEPTH = 4096
MAX_TEXT = 1 << 16
MAX_ENTRIES = 1 << 20

# CPython 3.11, x86-64 (Include/internal/pycore_runtime.h, pycore_interp.h, cpython/pystate.h,
# pycore_frame.h, cpython/code.h, cpython/unicodeobject.h, pycore_dict.h, cpython/object.h).
_RT_INTERP_HEAD = 40
_RT_GIL_LOCKED = 376  # then the GIL's switch_number at 384: it counts takes by a thread other than the last
_IS_NEXT = 0
_IS_THREADS_HEAD = 16
_IS_MODULES = 888
_TS_NEXT = 8
_TS_INTERP = 16
_TS_CFRAME = 56
_TS_THREAD_ID = 152  # then native_thread_id at 160
_CFRAME_CURRENT = 8
_FRAME_CODE = 32  # then frame_obj, previous (48), prev_instr (56)
_CODE_FIRSTLINENO = 72
_CODE_FILENAME = 112
_CODE_QUALNAME = 128
_CODE_LINETABLE = 136
_CODE_CODE = 184
_BYTES_DATA = 32
_TYPE_NAME = 24
_TYPE_FLAGS = 168
_HEAPTYPE_CACHED_KEYS = 872
_MANAGED_DICT = 0x10
_MODULE_DICT = 16
_DICT_KEYS = 32  # then ma_values at 40


def _int(data: bytes, at: int = 0, size: int = 8, signed: bool = False) -> int:
    """The little-endian integer of ``size`` bytes at ``at``."""
    return int.from_bytes(data[at:at + size], "little", signed=signed)


class _Refused(Exception):
    """The reader cannot tell this process's stacks for certain: why, in words for the user."""


class _Unreadable(_Refused):
    """Something read is not what CPython 3.11 would have there: the read is given up."""

    def __str__(self) -> str:
        return "what it read is not CPython 3.11's layout (%s)" % self.args


class _Moved(Exception):
    """The process's Python state may have changed during the read: it is read again."""


def read_threads(pid: int, runtime_dir: Optional[str] = None) -> Optional[List[Thread]]:
    """Every thread of ``pid`` as (native id, Python ident, name, is main, frames innermost first as
    (function, file, line)), in the interpreter's order (py-spy's); None where this reader cannot tell them
    for certain (the caller reads with py-spy). ``runtime_dir``: where the symbol offsets are kept."""
    return read(pid, runtime_dir)[0]


def read(pid: int, runtime_dir: Optional[str] = None) -> Tuple[Optional[List[Thread]], str]:
    """``read_threads``'s answer, and where it is None, why (words that follow "probe's memory reader: ")."""
    if sys.byteorder != "little" or os.uname().machine != "x86_64":  # another ABI lays the GIL's mutexes out otherwise
        return None, "it reads CPython 3.11 on x86-64 alone, and this machine is %s" % os.uname().machine
    try:
        runtime, version = elf_symbols.locate(pid, runtime_dir)
        fd = os.open("/proc/%d/mem" % pid, os.O_RDONLY | os.O_CLOEXEC)
    except (elf_symbols.Refused, _Refused) as refused:
        return None, str(refused)
    except PermissionError as denied:
        return None, "not allowed to read its memory (ptrace access refused: %s)" % (denied.strerror or denied)
    except FileNotFoundError:
        return None, "the process, or its interpreter file, is gone"
    except (OSError, ValueError) as failed:
        return None, "its memory map could not be read (%s)" % (getattr(failed, "strerror", None) or failed)
    try:
        memory = _Memory(fd)
        number = memory.u32(version)
        if number >> 16 != 0x030B:  # Py_Version: 3.11.x
            return None, ("it runs Python %d.%d, and this reader reads CPython 3.11 alone" % (number >> 24, number >> 16 & 255)
                          if number >> 24 == 3 else "no Python version where its interpreter's Py_Version should be")
        for attempt in range(TRIES):
            if attempt:
                time.sleep(0.001 * 2 ** attempt)  # a thread woken meanwhile goes back to sleep
            before = _states(pid)
            try:
                threads = _threads(memory, runtime, pid)
            except _Moved:
                continue
            after = _states(pid)
            natives = [b"%d" % thread[0] for thread in threads]
            if any(before.get(native, b"?")[:1] not in b"SDR" for native in natives):
                return None, "a thread of it is stopped, traced or exiting"  # py-spy says what it is
            if all(before.get(native, b"R")[:1] in b"SD" and after.get(native) == before[native] for native in natives):
                return threads, ""
        return None, "a thread of it ran Python during each of its %d tries (it reads only a process at rest)" % TRIES
    except _Refused as refused:
        return None, str(refused)
    except PermissionError as denied:
        return None, "not allowed to read its memory (ptrace access refused: %s)" % (denied.strerror or denied)
    except (OSError, ValueError, IndexError, RecursionError) as failed:
        return None, "its memory could not be read as CPython 3.11's (%s)" % (getattr(failed, "strerror", None) or failed)
    finally:
        os.close(fd)


def _states(pid: int) -> Dict[bytes, bytes]:
    """Each thread's state letter and context switch counts (thread id -> both, as one string): a thread of
    the same string before and after the read, in state S or D, did not run in between (to run, the
    scheduler switches to it; to stop running, away from it, and counts that)."""
    out = {}
    for task in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/status" % (pid, task), "rb") as handle:
                status = handle.read()
        except FileNotFoundError:
            continue  # a thread that ended (one of Python's is told by its absence after the read)
        state = status[status.index(b"\nState:") + 7:].lstrip()[:1]
        out[task.encode()] = state + status[status.index(b"\nvoluntary_ctxt_switches:"):]
    return out


class _Memory:
    """Reads of the target's memory, each bounded and checked."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.type_names: Dict[int, bytes] = {}

    def read(self, address: int, size: int) -> bytes:
        if address <= 0 or size < 0 or size > MAX_TEXT * 4 + 64:
            raise _Unreadable("address %#x" % address)
        data = os.pread(self.fd, size, address)
        if len(data) != size:
            raise _Unreadable("short read at %#x" % address)
        return data

    def u64(self, address: int) -> int:
        return _int(self.read(address, 8))

    def u32(self, address: int) -> int:
        return _int(self.read(address, 4))

    def type_name(self, obj: int) -> bytes:
        """The ``tp_name`` of the object's type."""
        return self.named(self.u64(obj + 8))

    def named(self, kind: int) -> bytes:
        """The ``tp_name`` of type ``kind`` (kept: a type outlives the objects read of it)."""
        name = self.type_names.get(kind)
        if name is None:
            name = self.read(self.u64(kind + _TYPE_NAME), 32).split(b"\0", 1)[0]
            self.type_names[kind] = name
        return name

    def expect(self, obj: int, name: bytes) -> int:
        if self.type_name(obj) != name:
            raise _Unreadable("not a %s at %#x" % (name.decode(), obj))
        return obj

    def text(self, obj: int) -> str:
        """A str object's text (compact strings: what the interpreter makes), in one read where it is short."""
        try:
            head = self.read(obj, 48 + 64)
        except (OSError, _Unreadable):  # the object ends close to the end of its mapping
            head = self.read(obj, 48)
        kind_of, length, state = _int(head, 8), _int(head, 16, 8, True), _int(head, 32, 4)
        if self.named(kind_of) != b"str":
            raise _Unreadable("not a str at %#x" % obj)
        kind, compact, ascii = (state >> 2) & 7, (state >> 5) & 1, (state >> 6) & 1
        if not compact or not 0 <= length <= MAX_TEXT or kind not in (1, 2, 4):
            raise _Unreadable("a str the reader does not take")
        start, size = (48, length) if ascii else (72, length * kind)
        data = head[start:start + size] if start + size <= len(head) else self.read(obj + start, size)
        return data.decode("ascii") if ascii else data.decode({1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}[kind])

    def is_text(self, obj: int, text: str) -> bool:
        """Whether ``obj`` is the str ``text`` (ASCII), in one read."""
        head = self.read(obj, 48 + len(text))
        kind_of, length, state = _int(head, 8), _int(head, 16, 8, True), _int(head, 32, 4)
        return (length == len(text) and (state >> 5) & 3 == 3 and self.named(kind_of) == b"str"
                and head[48:] == text.encode("ascii"))

    def bytes_of(self, obj: int) -> bytes:
        """A bytes object's data, in one read where it is short."""
        try:
            head = self.read(obj, _BYTES_DATA + 128)
        except (OSError, _Unreadable):
            head = self.read(obj, _BYTES_DATA)
        kind_of, size = _int(head, 8), _int(head, 16, 8, True)
        if self.named(kind_of) != b"bytes" or not 0 <= size <= MAX_TEXT * 4:
            raise _Unreadable("not bytes at %#x" % obj)
        end = _BYTES_DATA + size
        return head[_BYTES_DATA:end] if end <= len(head) else self.read(obj + _BYTES_DATA, size)

    def integer(self, obj: int) -> int:
        self.expect(obj, b"int")
        size = _int(self.read(obj + 16, 8), signed=True)
        if not -4 <= size <= 4:
            raise _Unreadable("int too long")
        digits = memoryview(self.read(obj + 24, 4 * abs(size))).cast("I")
        value = sum(digit << (30 * i) for i, digit in enumerate(digits))
        return -value if size < 0 else value

    def items(self, obj: int) -> List[Tuple[int, int]]:
        """(key, value) object addresses of a dict (combined or split table)."""
        self.expect(obj, b"dict")
        keys, values = memoryview(self.read(obj + _DICT_KEYS, 16)).cast("Q")
        return self._entries(keys, values)

    def _entries(self, keys: int, values: int) -> List[Tuple[int, int]]:
        head = self.read(keys, 32)
        log2_size, log2_index, kind, entries = head[8], head[9], head[10], _int(head, 24, 8, True)
        if log2_size > 24 or not 0 <= entries <= min(MAX_ENTRIES, 1 << log2_size) or kind > 2:
            raise _Unreadable("dict keys")
        width = 24 if kind == 0 else 16
        raw = self.read(keys + 32 + (1 << log2_index), entries * width)
        if width == 24:
            words = memoryview(raw).cast("Q")
            pairs = list(zip(words[1::3], words[2::3]))
        else:
            words = memoryview(raw).cast("Q")
            pairs = list(zip(words[0::2], words[1::2]))
        if values:
            found = memoryview(self.read(values, 8 * entries)).cast("Q")
            pairs = [(k, v) for (k, _), v in zip(pairs, found)]
        return [(k, v) for k, v in pairs if k and v]

    def lookup(self, obj: int, name: str) -> Optional[int]:
        """The value of str key ``name`` in dict ``obj``."""
        for key, value in self.items(obj):
            if self.is_text(key, name):
                return value
        return None

    def attribute(self, obj: int, name: str) -> Optional[int]:
        """An instance attribute of ``obj`` (a class with a managed dict, as ``threading.Thread``'s are)."""
        kind = self.u64(obj + 8)
        if not self.u64(kind + _TYPE_FLAGS) & _MANAGED_DICT:
            raise _Unreadable("not a managed dict")
        materialized = self.u64(obj - 24)
        if materialized:
            return self.lookup(materialized, name)
        values = self.u64(obj - 32)
        keys = self.u64(kind + _HEAPTYPE_CACHED_KEYS)
        if not values or not keys:
            return None
        for key, value in self._entries(keys, values):
            if self.is_text(key, name):
                return value
        return None


def _threads(memory: _Memory, runtime: int, pid: int) -> List[Thread]:
    gil = memory.read(runtime + _RT_GIL_LOCKED, 16)
    if _int(gil, 0, 4) != 0:  # py-spy says which (and whether it stays in C)
        raise _Refused("a thread of it holds the GIL (it runs Python, or C that keeps the GIL)")
    threads = _thread_list(memory, runtime, pid)
    if memory.read(runtime + _RT_GIL_LOCKED, 16) != gil:
        raise _Moved("the GIL was taken during the read")  # by a thread new to it (its switch_number)
    return threads


def _thread_list(memory: _Memory, runtime: int, pid: int) -> List[Thread]:
    interp = memory.u64(runtime + _RT_INTERP_HEAD)
    if memory.u64(interp + _IS_NEXT):
        raise _Refused("it runs subinterpreters")
    names = _names(memory, interp)
    threads = []
    state = memory.u64(interp + _IS_THREADS_HEAD)
    while state:
        if len(threads) >= MAX_THREADS or memory.u64(state + _TS_INTERP) != interp:
            raise _Unreadable("thread list")
        ident, native = memoryview(memory.read(state + _TS_THREAD_ID, 16)).cast("Q")
        name = names.get(ident)
        if name is None:  # py-spy names it as it does
            raise _Refused("a thread of it runs Python without a name in threading (started by C)")
        threads.append((native, ident, name, native == pid, _frames(memory, state)))
        state = memory.u64(state + _TS_NEXT)
    return threads


def _names(memory: _Memory, interp: int) -> Dict[int, str]:
    """Python ident -> name of every thread in ``threading._active``."""
    threading = memory.lookup(memory.expect(memory.u64(interp + _IS_MODULES), b"dict"), "threading")
    if threading is None:
        return {}
    active = memory.lookup(memory.u64(memory.expect(threading, b"module") + _MODULE_DICT), "_active")
    if active is None:
        return {}
    names = {}
    for key, thread in memory.items(active):
        name = memory.attribute(thread, "_name")
        if name is not None:
            names[memory.integer(key)] = memory.text(name)
    return names


def _frames(memory: _Memory, state: int) -> List[Tuple[str, str, int]]:
    frames = []
    cframe = memory.u64(state + _TS_CFRAME)
    frame = memory.u64(cframe + _CFRAME_CURRENT) if cframe else 0
    codes: Dict[Tuple[int, int], Tuple[str, str, int]] = {}
    while frame:
        if len(frames) >= MAX_DEPTH:
            raise _Unreadable("too deep")
        code, _, previous, prev_instr = memoryview(memory.read(frame + _FRAME_CODE, 32)).cast("Q")
        known = codes.get((code, prev_instr))
        if known is None:
            head = memory.read(code, _CODE_LINETABLE + 8)
            if memory.named(_int(head, 8)) != b"code":
                raise _Unreadable("not a code object at %#x" % code)
            first = _int(head, _CODE_FIRSTLINENO, 4, True)
            name = memory.text(_int(head, _CODE_QUALNAME))
            filename = memory.text(_int(head, _CODE_FILENAME))
            table = memory.bytes_of(_int(head, _CODE_LINETABLE))
            offset = prev_instr - (code + _CODE_CODE)
            line = _line(table, first, (offset // 2) * 2)
            if line < 0:
                raise _Unreadable("no line")
            known = codes[(code, prev_instr)] = (name, filename, line)
        frames.append(known)
        frame = previous
    return frames


def _line(table: bytes, first: int, address: int) -> int:
    """``PyCode_Addr2Line``: the line of the code unit at byte offset ``address`` by the 3.11 location table
    (-1: none)."""
    if address < 0:
        return first
    line, start, at = first, 0, 0
    while at < len(table):
        head = table[at]
        at += 1
        code, end = (head >> 3) & 15, start + ((head & 7) + 1) * 2
        if code == 14:  # long form: line delta, end line, column, end column
            delta, at = _svarint(table, at)
            for _ in range(3):
                at = _varint(table, at)[1]
        elif code == 13:  # no column
            delta, at = _svarint(table, at)
        elif code in (10, 11, 12):  # one line, two column bytes
            delta, at = code - 10, at + 2
        elif code == 15:  # no location
            delta = 0
        else:  # short form: one byte of columns
            delta, at = 0, at + 1
        line += delta
        if start <= address < end:
            return -1 if code == 15 else line
        start = end
    return -1


def _varint(table: bytes, at: int) -> Tuple[int, int]:
    byte = table[at]
    value, shift = byte & 63, 0
    while byte & 64:
        at += 1
        shift += 6
        byte = table[at]
        value |= (byte & 63) << shift
    return value, at + 1


def _svarint(table: bytes, at: int) -> Tuple[int, int]:
    value, at = _varint(table, at)
    return (-(value >> 1) if value & 1 else value >> 1), at
