"""torch's own Flight Recorder dump files, read without trusting them: the loader that
``probe.snapshot.torch_dump`` (``snapshot:PATH`` of a directory of dumps) and ``probe.diagnose.fr_copy``
(the dump of a rank that cannot answer) share.

What torch 2.13 writes: ``FlightRecorder::dump`` pickles one dict a process (``version``, ``pg_config``,
``pg_status``, ``entries``, ``comm_lib_version``) to ``$TORCH_FR_DUMP_TEMP_FILE<rank>`` (default
``${XDG_CACHE_HOME:-~/.cache}/torch/comm_lib_trace_rank_<rank>``); ProcessGroupNCCL's watchdog does so on a
collective's timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``), in C++, without the GIL. gloo dumps nothing by
itself; a job may write the same bytes with ``torch._C._distributed_c10d._dump_fr_trace()``.

Reading is safe for a file from anywhere: the pickle may hold plain containers and scalars only (dict,
list, tuple, set, str, bytes, int, float, bool, None). Any class, global, reduce, persistent id or
extension code is refused before a byte is unpickled, with an error that says so. JSON (the recorder's
``dump_json``) is read as well.
"""

import io
import json
import os
import pickle
import pickletools
import stat
from typing import Any, Dict, Optional, Tuple

from probe.errors import UsageError

__all__ = ["MAX_DUMP_BYTES", "MAX_ENTRIES", "REASON", "load_dump", "rank_dump"]

MAX_DUMP_BYTES = 256 * 1024 * 1024
"""A dump bigger than this is refused (2000 entries with their stacks take a few MB)."""
MAX_ENTRIES = 100_000
"""Entries read from one dump at most, the newest (a pickle can repeat one entry cheaply)."""
MAX_OPCODES = 3_000_000
"""Pickle opcodes read at most: each costs a step of Python to check (a 2000-entry dump with stacks has
well under 1M), so that a file made of tiny opcodes is refused in a few seconds, not read for minutes."""

REASON = "torch Flight Recorder dump"

_PLAIN_OPCODES = frozenset((
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP",
    "NONE", "NEWTRUE", "NEWFALSE", "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4",
    "FLOAT", "BINFLOAT", "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "SHORT_BINUNICODE",
    "BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8",
    "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS", "EMPTY_LIST", "LIST", "APPEND", "APPENDS",
    "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_SET", "ADDITEMS", "FROZENSET",
    "PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET", "MEMOIZE",
))
_LONGS = frozenset(("LONG", "LONG1", "LONG4"))  # INT's text past 4300 digits is Python's own ValueError
"""Opcodes that build plain values only. Left out: GLOBAL, STACK_GLOBAL, INST, OBJ, NEWOBJ(_EX), REDUCE,
BUILD, PERSID, BINPERSID, EXT1/2/4, NEXT_BUFFER, READONLY_BUFFER: each imports or calls something."""


class _PlainUnpickler(pickle.Unpickler):
    """Refuses every class and persistent id (the opcodes were checked already: a second lock)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError("it names %s.%s" % (module, name))

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent id")


def load_dump(path: str) -> Dict[str, Any]:
    """One dump file as the dict torch pickled (or wrote as JSON); UsageError, saying why, for a file that
    is not one, holds anything but plain values, or is too big."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_DUMP_BYTES + 1)
    except FileNotFoundError:
        raise UsageError("no Flight Recorder dump at %s" % path) from None
    except OSError as exc:
        raise UsageError("cannot read the Flight Recorder dump %s: %s" % (path, exc.strerror or exc)) from None
    if len(data) > MAX_DUMP_BYTES:
        raise UsageError("%s is too big for a Flight Recorder dump (over %d MB)" % (path, MAX_DUMP_BYTES >> 20))
    if data[:1] in (b"{", b" ", b"\n"):
        try:
            raw = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise UsageError("%s is not a Flight Recorder dump: not JSON (%s)" % (path, exc)) from None
    else:
        raw = _plain_unpickle(data, path)
    from probe.reader.bounded import check

    too_much = check(raw)
    if too_much is not None:
        raise UsageError("%s is refused: %s; a Flight Recorder dump holds plain entries" % (path, too_much),
                         hint="probe reads dumps that torch wrote; this file was made otherwise")
    if not isinstance(raw, dict) or not isinstance(raw.get("entries", []), list):
        raise UsageError("%s is not a Flight Recorder dump: no entries list" % path,
                         hint="torch writes one a rank as $TORCH_FR_DUMP_TEMP_FILE<rank>")
    return raw


def _plain_unpickle(data: bytes, path: str) -> Any:
    if data[:1] != b"\x80":
        raise UsageError("%s is not a Flight Recorder dump: neither a pickle nor JSON" % path,
                         hint="torch writes one a rank as $TORCH_FR_DUMP_TEMP_FILE<rank>")
    from probe.reader.bounded import MAX_INT_BITS

    try:
        for count, (opcode, arg, _) in enumerate(pickletools.genops(data)):
            if opcode.name not in _PLAIN_OPCODES:
                raise UsageError("%s is refused: its pickle uses %s, which can import or call code; a Flight "
                                 "Recorder dump holds plain values only" % (path, opcode.name),
                                 hint="probe reads dumps that torch wrote; this file was made otherwise")
            if count >= MAX_OPCODES:
                raise UsageError("%s is refused: its pickle has more than %d opcodes" % (path, MAX_OPCODES),
                                 hint="probe reads dumps that torch wrote; this file was made otherwise")
            if opcode.name in _LONGS and arg.bit_length() > MAX_INT_BITS:
                raise UsageError("%s is refused: it holds an integer of %d bits (more than %d)" % (
                    path, arg.bit_length(), MAX_INT_BITS), hint="probe reads dumps that torch wrote; this file "
                                                                  "was made otherwise")
        return _PlainUnpickler(io.BytesIO(data)).load()
    except UsageError:
        raise
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError, IndexError, KeyError, MemoryError,
            RecursionError) as exc:
        raise UsageError("%s is not a Flight Recorder dump that can be read: %s" % (path, exc or type(exc).__name__),
                         hint="a dump cut short (the job killed while torch wrote it) cannot be read") from None


def rank_dump(pid: int, environ: Dict[str, str], started: Optional[float]) -> Tuple[Optional[str], Optional[str]]:
    """(path, None) of the dump torch wrote for process ``pid`` (its ``RANK`` and ``TORCH_FR_DUMP_TEMP_FILE``
    or torch's default name, from the environment it started with), or (None, why not): none there, one
    older than the process (``started``: its start, time.time(); None for a process gone), or a file that
    is not ours to read (a link, another user's)."""
    rank = environ.get("RANK", "").strip()
    if not rank.isdigit():
        return None, "its environment names no RANK"
    prefix = environ.get("TORCH_FR_DUMP_TEMP_FILE") or environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    if not prefix:
        home = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME") or "~", ".cache")
        prefix = os.path.join(home, "torch", "comm_lib_trace_rank_")
    path = os.path.expanduser(prefix) + rank
    try:
        info = os.lstat(path)
    except OSError:
        return None, "torch wrote no dump of it (%s; NCCL's watchdog writes one on a collective's timeout)" % path
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        return None, "%s is refused: a link, not a regular file, or another user's" % path
    if started is not None and info.st_mtime < started:
        return None, "torch's dump %s is older than the process (an earlier run's)" % path
    return path, None
