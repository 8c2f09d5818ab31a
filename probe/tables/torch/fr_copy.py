"""The Flight Recorder's copy: what a rank that cannot run (a C call keeps its GIL, it is stopped, it died)
still says of its collectives.

The live table (``torch.flight_recorder``) needs the agent, and so the GIL; torch's debug server reads the
recorder in C++, probe reads files. Each process with the agent and an initialised ``torch.distributed``
keeps ``<runtime dir>/fr-<pid>.json`` (mode 0600), read by the CLI or the node helper of its host:

* a header (the first ``HEADER`` bytes, JSON padded with spaces): every process group's collective number
  (``marks``: ``_get_sequence_number_for_group``, 0.2 us a group, the same numbers as the recorder's
  ``collective_seq_id``) and when it was read (``looked_at``). The agent's accept thread reads them at each
  wake (every 0.25 s) and the optimizer step hook after each step, and writes the header in place (one
  ``pwrite``) when they changed; a look that finds them unchanged writes only every ``every`` seconds.
* the recorder's entries as ``_dump_fr_trace_json`` gives them (``copied_at``, ``copy_seq``), dumped by a
  daemon thread when a group's number moved since the last dump, at most every ``every`` seconds
  (``PROBE_FR_COPY_EVERY``, default 2; 0 turns the copy off) and never more than ``MAX_SHARE`` of the time
  (a dump holds the GIL: 2000 entries take ~30 ms; ``bench/bench_fr_copy.py``). Written whole to a hidden
  temporary file and renamed over the old one.

A rank that cannot run has not looked since it stopped: ``looked_at`` bounds when (the next look was due a
quarter of a second later), and what it issued after its last look is in no copy. A process that ends
cleanly removes its file; one killed leaves it, to be read for a dead rank. Runs in the target: stdlib only,
never imports torch, never raises into the program.
"""

import json
import os
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["HEADER", "FORMAT", "MAX_BODY", "MAX_MARKS", "MAX_SHARE", "look", "at_step", "remove", "parse_header",
           "every"]

FORMAT = "probe-fr-copy"
VERSION = 1
HEADER = 4096
"""Bytes of the header at the start of the file; the recorder's entries follow."""
MAX_MARKS = 64
"""Process groups whose number the header keeps at most (a job of many subgroups: the first ones)."""
MAX_BODY = 32 << 20
"""A dump bigger than this is not copied (2000 entries without stacks take ~1 MB)."""
MAX_SHARE = 0.01
"""The dumps take at most this share of the time: the interval grows to 100 times a dump's duration."""
DEFAULT_EVERY = 2.0

_lock = threading.Lock()
_wake = threading.Event()
_state: Dict[str, Any] = {
    "off": None,  # None: not decided yet; True: PROBE_FR_COPY_EVERY=0, or a failure that leaves it off
    "fd": None,  # the file's descriptor, for the header's pwrite; None before it exists
    "pid": 0, "ticks": 0, "path": None,
    "marks": {}, "cut": 0, "looked_at": 0.0, "written_at": 0.0,
    "copied_at": None, "copied_mono": 0.0, "copy_s": None, "copy_seq": {}, "body": 0, "why": None,
    "thread": None, "every": DEFAULT_EVERY,
}


def every() -> float:
    """Seconds between two dumps at least (``PROBE_FR_COPY_EVERY``); 0: no copy kept."""
    try:
        value = float(os.environ.get("PROBE_FR_COPY_EVERY", DEFAULT_EVERY))
    except ValueError:
        return DEFAULT_EVERY
    return max(0.0, value) if value == value else DEFAULT_EVERY


def look() -> None:
    """The accept thread's wake: once ``torch.distributed`` is initialised, read every group's number and
    keep the header current; ask for a dump where one is due. A few dict lookups before that; never raises."""
    try:
        if _state["off"] is True or "torch.distributed" not in sys.modules:
            return
        _look("look")
    except BaseException:
        pass


def at_step() -> None:
    """After each optimizer step (``probe.tables.torch.steps.after_each_step``): the numbers as the step
    ended, so that a rank that stops between two steps has its exact numbers in the header."""
    try:
        if _state["fd"] is not None:
            _look("step")
    except BaseException:
        pass


def _look(by: str) -> None:
    dist = sys.modules.get("torch.distributed")
    initialised = getattr(dist, "is_initialized", None)
    if initialised is None or not initialised():
        return
    if _state["off"] is None and not _start():
        return
    marks, cut = _marks(dist)
    now = time.time()
    changed = marks != _state["marks"]
    with _lock:
        _state["marks"], _state["cut"], _state["looked_at"] = marks, cut, now
        if changed or now - _state["written_at"] >= _state["every"] or _state["fd"] is None:
            try:
                _write_header()
            except OSError:  # the runtime directory went, or the disk is full: no copy from here on
                _state["off"] = True
                return
    if _state["why"] is None and marks != _state["copy_seq"] and \
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
    _state["off"], _state["fd"] = True, None


def _marks(dist: Any) -> Tuple[Dict[str, int], int]:
    """Each process group's collective number, by its name (the recorder's ``process_group[0]``)."""
    world = getattr(getattr(dist, "distributed_c10d", None), "_world", None)
    names = getattr(world, "pg_names", None) or {}
    out: Dict[str, int] = {}
    items = list(names.items())
    for group, name in items[:MAX_MARKS]:
        try:
            out[str(name)[:64]] = int(group._get_sequence_number_for_group())
        except Exception:  # a group without numbers (a fake backend): left out
            continue
    return out, max(0, len(items) - MAX_MARKS)


def _interval() -> float:
    copy_s = _state["copy_s"] or 0.0
    return max(float(_state["every"]), copy_s / MAX_SHARE)


def _header_bytes() -> bytes:
    header = {"format": FORMAT, "version": VERSION, "pid": _state["pid"], "ticks": _state["ticks"],
              "every": _state["every"], "interval": round(_interval(), 3), "looked_at": _state["looked_at"],
              "marks": _state["marks"], "marks_cut": _state["cut"], "copied_at": _state["copied_at"],
              "copy_s": _state["copy_s"], "copy_seq": _state["copy_seq"], "body": _state["body"],
              "why": _state["why"]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    if len(raw) > HEADER - 1:  # many long names: the marks go, the rest stays
        header["marks"], header["marks_cut"] = {}, len(_state["marks"]) + _state["cut"]
        raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (HEADER - 1 - len(raw)) + b"\n"


def _write_header() -> None:
    """Under ``_lock``: the header in place, or the file itself where there is none yet."""
    _state["written_at"] = time.time()
    if _state["fd"] is None:
        _replace(b"")
        return
    os.pwrite(_state["fd"], _header_bytes(), 0)


def _replace(body: bytes) -> None:
    """Under ``_lock``: a new file (header and ``body``) renamed over the old; its descriptor kept."""
    path = _state["path"]
    directory, name = os.path.split(path)
    temp = os.path.join(directory, ".%s.%s.tmp" % (name, os.urandom(4).hex()))
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        data = memoryview(_header_bytes() + body)
        while data:
            data = data[os.write(fd, data):]
        os.rename(temp, path)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise
    old, _state["fd"] = _state["fd"], fd
    if old is not None:
        os.close(old)


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
    seq, _ = _marks(dist)  # read before the dump: the entries hold at least these
    start = time.monotonic()
    wall = time.time()
    raw = dump(True, False)
    took = time.monotonic() - start
    with _lock:
        _state["copied_mono"], _state["copy_s"] = time.monotonic(), took
        if len(raw) > MAX_BODY:
            _state["why"] = "the recorder's dump is %d MB, over the copy's %d MB: not copied" % (
                len(raw) >> 20, MAX_BODY >> 20)
            _state["body"], _state["copied_at"], _state["copy_seq"] = 0, None, {}
            _replace(b"")
            return
        _state["copied_at"], _state["copy_seq"], _state["body"] = wall, seq, len(raw)
        _replace(bytes(raw))


def remove() -> None:
    """At the agent's exit (only in the process that made it): no more copies, and the file goes."""
    if _state["pid"] != os.getpid():
        return
    _state["off"] = True
    _wake.set()
    with _lock:
        fd, _state["fd"] = _state["fd"], None
        path = _state["path"]
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        try:
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
    numbers = ("every", "interval", "looked_at")
    if not all(isinstance(header.get(k), (int, float)) and not isinstance(header.get(k), bool) for k in numbers) \
            or not isinstance(header.get("pid"), int) or not isinstance(header.get("body"), int) \
            or not 0 <= header["body"] <= MAX_BODY:
        return None, "its header's fields are not what a copy holds"
    for key in ("marks", "copy_seq"):
        value = header.get(key)
        if not isinstance(value, dict) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                  for v in value.values()):
            return None, "its header's %s are not numbers" % key
    for key in ("copied_at", "copy_s"):
        if header.get(key) is not None and not isinstance(header.get(key), (int, float)):
            return None, "its header's %s is not a time" % key
    if header.get("why") is not None and not isinstance(header.get("why"), str):
        return None, "its header's why is not text"
    return header, None


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
