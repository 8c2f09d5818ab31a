"""The Flight Recorder's copy: what a rank that cannot run (a C call keeps its GIL, it is stopped, it died)
still says of its collectives.

The live table (``torch.flight_recorder``) needs the agent, and so the GIL; torch's debug server reads the
recorder in C++, probe reads files. Each process with the agent and an initialised ``torch.distributed``
keeps ``<runtime dir>/fr-<pid>.json`` (mode 0600), read by the CLI or the node helper of its host:

* a header (its first ``HEADER`` bytes: JSON padded with spaces): the process groups' names, what the last
  dump was and when, or why there is none (``why``);
* a page of numbers (``MARKS_AT``, mapped into memory and written in place: no syscall): every group's
  collective number (``_get_sequence_number_for_group``, 0.2 us a group; the recorder's
  ``collective_seq_id``) and when they were read (``looked_at``), by the agent's accept thread at each wake
  (every 0.25 s) and by the optimizer step hook after each step, so that a rank that stops between two
  steps has its exact numbers (they need no recorder: with it off, they are what is kept);
* from ``BODY_AT``, the recorder's entries as ``_dump_fr_trace_json`` gives them (``copied_at``,
  ``copy_seq``), dumped by a daemon thread when a number moved since the last dump, at most every
  ``every`` seconds (``PROBE_FR_COPY_EVERY``, default 10; 0 turns the copy off) and never more than
  ``MAX_SHARE`` of the time (a dump keeps the GIL: 2000 entries take 30-60 ms; ``bench/bench_fr_copy.py``),
  written whole to a hidden temporary file and renamed over the old one.

Why the dump is not taken at each step mark: it costs some 30 ms at 2000 entries (a step of many
collectives would pay it every step), and for a rank that hangs mid-step the entries that matter are the
ones issued after the last mark. The numbers are cheap enough for both marks and every wake; the dump
follows them at a bounded rate from a thread of its own, and is as fresh as the last look allowed.

A rank that cannot run has not looked since it stopped: ``looked_at`` bounds when (the next look was due a
quarter of a second later), and what it issued after its last look is in no copy. A process that ends
cleanly removes its file; one killed leaves it, to be read for a dead rank. Runs in the target: stdlib only,
never imports torch, never raises into the program.
"""

import json
import os
import struct
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["HEADER", "MARKS_AT", "BODY_AT", "FORMAT", "MAX_BODY", "MAX_MARKS", "MAX_SHARE", "look", "at_step",
           "remove", "parse_header", "parse_marks", "entries_of", "every"]

FORMAT = "probe-fr-copy"
VERSION = 1
HEADER = 4096
"""Bytes of the JSON header at the start of the file."""
MARKS_AT = 4096
"""Where the numbers' page begins (mapped into memory: written in place, no syscall a step)."""
BODY_AT = 8192
"""Where the recorder's entries begin."""
MAX_MARKS = 64
"""Process groups whose number is kept at most (a job of many subgroups: the first ones)."""
MARKS = struct.Struct("<8sQdI4x%dq" % MAX_MARKS)
"""The numbers' page: magic, a generation (odd while being written), when they were read (time.time()),
how many, and the numbers in the order of the header's ``groups``."""
MARKS_MAGIC = b"probefrm"
MAX_BODY = 32 << 20
"""A dump bigger than this is not copied (2000 entries without stacks take ~1 MB)."""
MAX_SHARE = 0.002
"""The copies take at most this share of the time: the interval grows to 100 times a copy's CPU time."""
DEFAULT_EVERY = 10.0

_lock = threading.Lock()
_wake = threading.Event()
_state: Dict[str, Any] = {
    "off": None,  # None: not decided yet; True: PROBE_FR_COPY_EVERY=0, or a failure that leaves it off
    "file": None, "map": None,  # (st_dev, st_ino) of the file made last, and its numbers' page (mapped)
    "pid": 0, "ticks": 0, "path": None, "gen": 0, "every": DEFAULT_EVERY,
    "groups": [], "marks": [], "cut": 0,
    "copied_at": None, "copied_mono": 0.0, "copy_s": None, "copy_seq": {}, "body": 0, "why": None,
    "copies": 0, "copies_s": 0.0,  # dumps taken, and their time in all (bench/bench_fr_copy.py reads them)
}


def every() -> float:
    """Seconds between two dumps at least (``PROBE_FR_COPY_EVERY``); 0: no copy kept."""
    try:
        value = float(os.environ.get("PROBE_FR_COPY_EVERY", DEFAULT_EVERY))
    except ValueError:
        return DEFAULT_EVERY
    return max(0.0, value) if value == value else DEFAULT_EVERY


def look() -> None:
    """The accept thread's wake: once ``torch.distributed`` is initialised, read every group's number into
    the file; ask for a dump where one is due. A few dict lookups before that; never raises."""
    try:
        if _state["off"] is True or "torch.distributed" not in sys.modules:
            return
        _look(True)
    except BaseException:
        pass


def at_step() -> None:
    """After each optimizer step (``probe.tables.torch.steps.after_each_step``): the numbers as the step
    ended, so that a rank that stops between two steps has its exact numbers in the file (a few us)."""
    try:
        if _state["map"] is not None:
            _look(False)
    except BaseException:
        pass


def _look(asks: bool) -> None:
    dist = sys.modules.get("torch.distributed")
    initialised = getattr(dist, "is_initialized", None)
    if initialised is None or not initialised():
        return
    if _state["off"] is None and not _start():
        return
    groups, marks, cut = _marks(dist)
    with _lock:
        try:
            if groups != _state["groups"] or _state["map"] is None:
                _state["groups"], _state["cut"] = groups, cut
                _write_header()
            _state["marks"] = marks
            _write_marks()
        except (OSError, ValueError):  # the runtime directory went, or the disk is full: no copy from here on
            _state["off"] = True
            return
    if asks and _state["why"] is None and _state["copy_seq"] != dict(zip(groups, marks)) and \
            time.monotonic() - _state["copied_mono"] >= _interval():
        _wake.set()


def _start() -> bool:
    """Decide once: off (PROBE_FR_COPY_EVERY=0), or on, with the step hook's callable and the dump thread."""
    _state["every"] = every()
    if not _state["every"]:
        _state["off"] = True
        return False
    from probe import _paths

    _state["pid"] = os.getpid()
    try:
        _state["ticks"] = _paths.process_start_ticks()
    except (OSError, ValueError):
        _state["ticks"] = 0
    _state["path"] = os.path.join(_paths.runtime_dir(), "fr-%d.json" % _state["pid"])
    c10d = sys.modules.get("torch._C._distributed_c10d")
    if getattr(c10d, "_dump_fr_trace_json", None) is None:
        _state["why"] = "this torch has no _dump_fr_trace_json (torch 2.5 or later has it): only the numbers are kept"
    _state["off"] = False
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_forget)
    steps = sys.modules.get("probe.tables.torch.steps")
    if steps is not None:
        steps.after_each_step(at_step, key="fr_copy")
    if _state["why"] is None:
        from probe._threads import daemon_thread

        thread = daemon_thread(_keep, "probe-fr-copy")
        _state["thread"] = thread
        thread.start()
    return True


def _forget() -> None:
    """In a forked child (a DataLoader worker): the parent's file and thread are not its own."""
    _state["off"], _state["file"], _state["map"] = True, None, None


def _marks(dist: Any) -> Tuple[List[str], List[int], int]:
    """Each process group's name (the recorder's ``process_group[0]``) and collective number."""
    world = getattr(getattr(dist, "distributed_c10d", None), "_world", None)
    names = getattr(world, "pg_names", None) or {}
    groups: List[str] = []
    marks: List[int] = []
    items = list(names.items())
    for group, name in items[:MAX_MARKS]:
        try:
            marks.append(int(group._get_sequence_number_for_group()))
        except Exception:  # a group without numbers (a fake backend): left out
            continue
        groups.append(str(name)[:64])
    return groups, marks, max(0, len(items) - MAX_MARKS)


def _interval() -> float:
    copy_s = _state["copy_s"] or 0.0
    return max(float(_state["every"]), copy_s / MAX_SHARE)


def _header_bytes() -> bytes:
    header = {"format": FORMAT, "version": VERSION, "pid": _state["pid"], "ticks": _state["ticks"],
              "every": _state["every"], "interval": round(_interval(), 3), "groups": _state["groups"],
              "groups_cut": _state["cut"], "copied_at": _state["copied_at"], "copy_s": _state["copy_s"],
              "copy_seq": _state["copy_seq"], "body": _state["body"], "why": _state["why"]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    if len(raw) > HEADER - 1:  # many long names: they go, the rest stays
        header["groups"], header["groups_cut"] = [], len(_state["groups"]) + _state["cut"]
        header["copy_seq"] = {}
        raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (HEADER - 1 - len(raw)) + b"\n"


def _write_header() -> None:
    """Under ``_lock``: the header in place, or the file itself where there is none yet. No descriptor is
    kept between writes (the program may close numbers it did not open, and reuse them for its own
    files): the file is opened by name, and written only where it is still the one made here."""
    if _state["file"] is None:
        _replace(b"")
        return
    try:
        fd = os.open(_state["path"], os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        _replace(b"")  # gone (removed by someone): made again, without entries until the next dump
        return
    try:
        info = os.fstat(fd)
        if (info.st_dev, info.st_ino) == _state["file"]:
            os.pwrite(fd, _header_bytes(), 0)
            return
    finally:
        os.close(fd)
    _replace(b"")  # another file at the name: ours replaces it (renamed over, never written into)


def _write_marks(mapped: Any = None) -> None:
    """Under ``_lock``: the numbers into the mapped page (``mapped``, else the current file's), the
    generation odd while they are written."""
    mapped = _state["map"] if mapped is None else mapped
    gen = _state["gen"] + 1
    struct.pack_into("<Q", mapped, 8, gen)
    marks = _state["marks"] if len(_state["groups"]) == len(_state["marks"]) else []
    MARKS.pack_into(mapped, 0, MARKS_MAGIC, gen, time.time(), len(marks), *(marks + [0] * (MAX_MARKS - len(marks))))
    struct.pack_into("<Q", mapped, 8, gen + 1)
    _state["gen"] = gen + 1


def _replace(body: bytes) -> None:
    """Under ``_lock``: a new file (header, numbers, ``body``) renamed over the old, whole; its numbers'
    page kept mapped (its descriptor closed)."""
    import mmap

    path = _state["path"]
    directory, name = os.path.split(path)
    temp = os.path.join(directory, ".%s.%s.tmp" % (name, os.urandom(4).hex()))
    fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    mapped = None
    try:
        data = memoryview(_header_bytes() + b"\0" * (BODY_AT - HEADER) + body)
        while data:
            data = data[os.write(fd, data):]
        mapped = mmap.mmap(fd, BODY_AT - MARKS_AT, offset=MARKS_AT)
        _write_marks(mapped)  # before the rename: a reader never sees the page empty
        info = os.fstat(fd)
        os.rename(temp, path)
    except BaseException:
        if mapped is not None:
            mapped.close()
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise
    finally:
        os.close(fd)  # the mapping stays without it
    _state["file"] = (info.st_dev, info.st_ino)
    old_map, _state["map"] = _state["map"], mapped
    if old_map is not None:
        old_map.close()


def _keep() -> None:
    """The dump thread: waits to be asked by a look, dumps, writes. A failure leaves the copy off, said why."""
    while _state["off"] is False:
        if not _wake.wait(60.0):
            continue
        _wake.clear()
        if _state["off"] is not False:
            return
        try:
            _copy()
        except BaseException as exc:
            with _lock:
                _state["why"] = "the copy failed: %s: %s" % (type(exc).__name__, str(exc)[:200])
                try:
                    _replace(b"")
                except BaseException:
                    _state["off"] = True
            return


def _copy() -> None:
    dist = sys.modules.get("torch.distributed")
    c10d = sys.modules.get("torch._C._distributed_c10d")
    dump = getattr(c10d, "_dump_fr_trace_json", None)
    if dist is None or dump is None:
        return
    groups, marks, _ = _marks(dist)  # read before the dump: the entries hold at least these
    seq = dict(zip(groups, marks))
    cpu = time.thread_time()
    wall = time.time()
    raw = dump(True, False)
    with _lock:
        if len(raw) > MAX_BODY:
            _state["why"] = "the recorder's dump is %d MB, over the copy's %d MB: not copied" % (
                len(raw) >> 20, MAX_BODY >> 20)
            _state["body"], _state["copied_at"], _state["copy_seq"] = 0, None, {}
            _replace(b"")
        else:
            _state["copied_at"], _state["copy_seq"], _state["body"] = wall, seq, len(raw)
            _replace(raw)
        # the copy's own CPU (the dump and the write), not its wall time, which a loaded machine stretches
        took = time.thread_time() - cpu
        _state["copied_mono"], _state["copy_s"] = time.monotonic(), took
        _state["copies"] += 1
        _state["copies_s"] += took


def remove() -> None:
    """At the agent's exit (only in the process that made it): no more copies, and the file goes."""
    if _state["pid"] != os.getpid():
        return
    _state["off"] = True
    _wake.set()
    with _lock:
        made, _state["file"] = _state["file"], None
        mapped, _state["map"] = _state["map"], None
        path = _state["path"]
    if mapped is not None:
        try:
            mapped.close()
        except (BufferError, ValueError, OSError):
            pass
    try:
        info = os.lstat(path) if made is not None else None
        if info is not None and (info.st_dev, info.st_ino) == made:  # only the file made here
            os.unlink(path)
    except OSError:
        pass


# -- reading ---------------------------------------------------------------------------------------------


def parse_header(raw: bytes) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """(header, None) from a file's first ``HEADER`` bytes, or (None, why it is not one). The bytes may be
    anyone's: every field is checked for its type."""
    if len(raw) < HEADER:
        return None, "shorter than a copy's header (%d bytes)" % len(raw)
    try:
        header = json.loads(raw[:HEADER].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None, "its header is not JSON"
    if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("version") != VERSION:
        return None, "not a copy of this version (format %s)" % str(header.get("format") if isinstance(
            header, dict) else type(header).__name__)[:40]
    numbers = ("every", "interval")
    if not all(isinstance(header.get(k), (int, float)) and not isinstance(header.get(k), bool) for k in numbers) \
            or not isinstance(header.get("pid"), int) or not isinstance(header.get("body"), int) \
            or not 0 <= header["body"] <= MAX_BODY:
        return None, "its header's fields are not what a copy holds"
    groups = header.get("groups")
    if not isinstance(groups, list) or len(groups) > MAX_MARKS or not all(isinstance(g, str) for g in groups):
        return None, "its header's groups are not names"
    value = header.get("copy_seq")
    if not isinstance(value, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value.values()):
        return None, "its header's copy_seq are not numbers"
    for key in ("copied_at", "copy_s"):
        if header.get(key) is not None and not isinstance(header.get(key), (int, float)):
            return None, "its header's %s is not a time" % key
    if header.get("why") is not None and not isinstance(header.get("why"), str):
        return None, "its header's why is not text"
    return header, None


def parse_marks(raw: bytes, groups: List[str]) -> Tuple[Optional[float], Dict[str, int], Optional[str]]:
    """(when they were read, group -> number, None) from the numbers' page, or (None, {}, why not). A page
    being written (its generation odd) is said so: read again."""
    if len(raw) < MARKS.size:
        return None, {}, "its numbers' page is cut short"
    magic, gen, looked_at, count, *marks = MARKS.unpack_from(raw, 0)
    if magic != MARKS_MAGIC:
        return None, {}, "its numbers' page is not one"
    if gen % 2:
        return None, {}, "its numbers were being written"
    if not 0 <= count <= min(MAX_MARKS, len(groups)) or looked_at != looked_at:
        return None, {}, "its numbers' page does not match its header"
    return float(looked_at), dict(zip(groups[:count], marks[:count])), None


def entries_of(body: bytes) -> Tuple[List[Dict[str, Any]], Optional[str]]:
    """The recorder's entries from a copy's body (``_dump_fr_trace_json``'s JSON), or why none."""
    try:
        data = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return [], "its entries are not JSON (cut short, or not written by the agent)"
    if not isinstance(data, dict):
        return [], "it holds no entries list"
    entries = data.get("entries", [])  # a recorder that is off (a buffer of 0) dumps no entries at all
    if not isinstance(entries, list):
        return [], "it holds no entries list"
    return [e for e in entries if isinstance(e, dict)], None
