"""``python.workers``: the DataLoader worker processes of this process, what each holds, and which one a
thread waits for.

Found without importing torch: the iterators of torch's multi-process DataLoader (an object of a class
named ``_MultiProcessingDataLoaderIter``, or derived from one) are looked for on the frames of every
thread (a thread blocked in ``__next__`` holds its iterator as ``self``), then by the garbage collector
(``probe.tables.tracked``); the worker processes also from ``multiprocessing``'s own list of the
children this process started, by their target (``_worker_loop``). Everything is read from attributes
as they are (``vars()``), so nothing runs that the program did not write: no property, no
``__getattr__``, no ``is_alive()`` (it reaps a child that exited, which is the DataLoader's business).
A worker's liveness comes from ``/proc``.

What a worker holds: the DataLoader numbers its batches (tasks) as it sends them to its workers, in
turn, and keeps ``_task_info``: task -> (worker,) while the batch is being made, (worker, data) once it
came back early (it is handed out in order). ``_rcvd_idx`` is the task ``__next__`` returns next: the
worker that holds it is the one a thread inside ``__next__`` waits for. The sample indices of a batch
travel to the worker through a pipe and stay only there (``probe WORKER_PID inject``, then
python.locals, reads them).
"""

import json
import sys
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

from probe.tables.spec import Column
from probe.tables.tracked import tracked_of

__all__ = ["NAME", "DESCRIPTION", "COLUMNS", "EXAMPLE", "rows", "ITERATOR_CLASS"]

ITERATOR_CLASS = "_MultiProcessingDataLoaderIter"
_WAIT_FUNCS = frozenset(("__next__", "_next_data", "_get_data", "_try_get_data"))
_STATES = {"R": "running", "S": "sleeping", "D": "disk sleep", "T": "stopped", "t": "traced", "Z": "zombie",
           "X": "dead", "I": "idle"}

NAME = "python.workers"
DESCRIPTION = ("The DataLoader worker processes of this process (torch's multi-process DataLoader): pid, "
               "alive, the batches (tasks) each is making, and which one a thread blocked in the loader's "
               "__next__ waits for.")
COLUMNS = (
    Column("pid", "BIGINT", "The worker's process id (probe PID backtrace reads it from outside; probe PID "
                            "inject starts an agent there)."),
    Column("worker_id", "INTEGER", "Its number in its DataLoader (0 to num_workers - 1), as torch's "
                                   "get_worker_info().id says in the worker."),
    Column("alive", "BOOLEAN", "Whether the process exists and has not exited (from /proc; a zombie is not)."),
    Column("state", "VARCHAR", "Its state in /proc: running, sleeping, disk sleep, stopped, zombie; 'gone' when "
                               "no such process is left."),
    Column("iterator", "VARCHAR", "The DataLoader iterator it serves, Class@address (one per epoch, or one "
                                  "for all with persistent_workers); NULL where only the process was found."),
    Column("dataset", "VARCHAR", "The class of the dataset it reads, module.Class."),
    Column("active", "BOOLEAN", "Whether it still has work this epoch (false once an iterable dataset's "
                                "worker is exhausted); NULL where the iterator was not found."),
    Column("tasks_outstanding", "INTEGER", "Batches sent to it whose data has not come back yet."),
    Column("tasks", "VARCHAR", "Those batches' task numbers (the order in which the iterator hands batches "
                               "out within its epoch), as JSON, e.g. [21, 23]."),
    Column("ready", "INTEGER", "Batches it made that wait for an earlier one (they are handed out in order)."),
    Column("next_task", "BIGINT", "The task the iterator hands out next (its _rcvd_idx), on every row of "
                                  "that iterator."),
    Column("waited_by", "VARCHAR", "The threads (e.g. MainThread) blocked in the iterator's __next__ waiting for "
                                   "this worker's batch (next_task is one of its tasks); NULL otherwise."),
)
EXAMPLE = "SELECT pid, worker_id, alive, tasks, waited_by FROM python.workers WHERE waited_by IS NOT NULL"


def rows() -> Iterator[Tuple[Any, ...]]:
    blocked = _blocked_threads()
    iterators = _iterators(blocked)
    listed = set()
    for it in iterators:
        attrs = _vars(it)
        if attrs.get("_shutdown") is True:
            continue  # an epoch's iterator that stopped its workers: none of them is this process's now
        workers = list(attrs.get("_workers") or ())
        task_info = _copy_dict(attrs.get("_task_info"))
        status = list(attrs.get("_workers_status") or ())
        rcvd = attrs.get("_rcvd_idx")
        label = "%s@%#x" % (type(it).__name__, id(it))
        dataset = _class_text(attrs.get("_dataset"))
        for worker_id, process in enumerate(workers):
            pid = _pid_of(process)
            if pid is None:
                continue
            listed.add(pid)
            pending = sorted(t for t, v in task_info.items() if _holder(v) == worker_id and len(v) == 1)
            ready = sum(1 for v in task_info.values() if _holder(v) == worker_id and len(v) >= 2)
            entry = task_info.get(rcvd) if isinstance(rcvd, int) else None
            waits = None
            if entry is not None and len(entry) == 1 and _holder(entry) == worker_id:
                waits = ", ".join(blocked.get(id(it), (None, []))[1]) or None
            state = _proc_state(pid)
            yield (pid, worker_id, state not in ("zombie", "dead", "gone"), state, label, dataset,
                   bool(status[worker_id]) if worker_id < len(status) else None, len(pending),
                   json.dumps(pending), ready, rcvd if isinstance(rcvd, int) else None, waits)
    for pid, worker_id, dataset in _children_workers():
        if pid in listed:
            continue
        state = _proc_state(pid)
        yield (pid, worker_id, state not in ("zombie", "dead", "gone"), state, None, dataset, None, None, None,
               None, None, None)


def _vars(obj: Any) -> Dict[str, Any]:
    try:
        found = object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        return {}
    return found if isinstance(found, dict) else {}


def _copy_dict(value: Any) -> Dict[Any, Any]:
    if not isinstance(value, dict):
        return {}
    try:
        return dict(value)  # one C-level copy: the training thread may change it meanwhile
    except RuntimeError:
        return {}


def _holder(value: Any) -> Optional[int]:
    if isinstance(value, tuple) and value and isinstance(value[0], int):
        return value[0]
    return None


def _pid_of(process: Any) -> Optional[int]:
    popen = _vars(process).get("_popen")
    pid = _vars(popen).get("pid") if popen is not None else None
    return pid if isinstance(pid, int) and pid > 0 else None


def _class_text(obj: Any) -> Optional[str]:
    if obj is None:
        return None
    cls = type(obj)
    return "%s.%s" % (cls.__module__, cls.__qualname__)


def _is_iterator(obj: Any, seen: Optional[Dict[type, bool]] = None) -> bool:
    return _is_iterator_class(type(obj), seen) and "_workers" in _vars(obj)


def _is_iterator_class(cls: type, seen: Optional[Dict[type, bool]] = None) -> bool:
    known = seen.get(cls) if seen is not None else None
    if known is None:
        known = any(getattr(base, "__name__", None) == ITERATOR_CLASS for base in getattr(cls, "__mro__", ()))
        if seen is not None:
            seen[cls] = known
    return known


def _iterators(blocked: Dict[int, Tuple[Any, List[str]]]) -> List[Any]:
    """The live multi-process DataLoader iterators: those threads are blocked in, then the collector's."""
    found: Dict[int, Any] = {key: it for key, (it, _) in blocked.items()}
    if "torch.utils.data.dataloader" not in sys.modules:
        return list(found.values())
    seen: Dict[type, bool] = {}
    for obj in tracked_of(lambda cls: _is_iterator_class(cls, seen)):  # the program never runs while we hold all
        if _is_iterator(obj, seen):
            found.setdefault(id(obj), obj)
    return list(found.values())


def _blocked_threads() -> Dict[int, Tuple[Any, List[str]]]:
    """id(iterator) -> (the iterator, names of the threads inside its __next__: waiting for a batch)."""
    names = {t.ident: t.name for t in list(threading._active.values())}  # type: ignore[attr-defined]
    me = threading.get_ident()
    out: Dict[int, Tuple[Any, List[str]]] = {}
    current = sys._current_frames()
    frame: Any = None
    try:
        for ident, frame in current.items():
            if ident == me:
                continue
            depth = 0
            while frame is not None and depth < 200:
                if frame.f_code.co_name in _WAIT_FUNCS:
                    owner = frame.f_locals.get("self")
                    if _is_iterator(owner):
                        out.setdefault(id(owner), (owner, []))[1].append(names.get(ident, str(ident)))
                        break
                frame = frame.f_back
                depth += 1
    finally:
        current.clear()
        frame = None
    return out


def _children_workers() -> List[Tuple[int, Optional[int], Optional[str]]]:
    """(pid, worker id, dataset class) of the children multiprocessing started here that run torch's
    worker loop (``_worker_loop``'s 11th argument is the worker id, its 2nd the dataset)."""
    process_module = sys.modules.get("multiprocessing.process")
    children = getattr(process_module, "_children", None)
    if not isinstance(children, set):
        return []
    out = []
    for child in list(children):
        attrs = _vars(child)
        target = attrs.get("_target")
        if getattr(target, "__name__", None) != "_worker_loop":
            continue
        pid = _pid_of(child)
        if pid is None:
            continue
        args = attrs.get("_args")
        args = args if isinstance(args, tuple) else ()
        worker_id = args[10] if len(args) > 10 and isinstance(args[10], int) else None
        out.append((pid, worker_id, _class_text(args[1]) if len(args) > 1 else None))
    return sorted(out, key=lambda row: (row[1] is None, row[1] or 0, row[0]))


def _proc_state(pid: int) -> str:
    try:
        with open("/proc/%d/stat" % pid, "rb") as handle:
            raw = handle.read().decode("ascii", "replace")
    except OSError:
        return "gone"
    letter = raw[raw.rfind(")") + 2:][:1]
    return _STATES.get(letter, letter or "gone")
