"""Where each rank has been: the node helper samples its ranks' stacks every ``PROBE_STACK_EVERY`` seconds.

A daemon thread of the helper (``python -m probe.host``, or torchrun's launcher). Every ``every`` seconds
(``PROBE_STACK_EVERY``, default 30; ``0`` turns it off) it asks each live rank of the node for its stacks:
its agent's ``GET /v1/backtrace`` where it answers, else read from outside as ``probe PID backtrace`` does (a
C call holding the GIL, a stopped process), at most ``IN_FLIGHT`` ranks at once and within ``ASK_S``. It keeps
the last ``KEEP_S`` seconds (an hour), deduplicated: each distinct stack once, by the hash of its frames, and
per sample a row (time, rank, pid, thread, stack id, source) that refers to it. Bounded whatever the ranks
do: at most ``MAX_ROWS`` rows and ``MAX_STACKS`` distinct stacks of at most ``MAX_FRAMES`` frames (the
oldest rows go first; a stack goes with the last row that names it).

Served as ``GET /v1/stack_history`` (``?current=1``: each thread's current run only), the rows of the table
``cluster.stack_history`` (``probe.client.stack_history`` joins them with their stacks); a stall record
the watch writes carries them (:func:`rows`). Nothing here may take the helper down: a failed sample is said
once in the helper's log and the next one is tried.
"""

import collections
import hashlib
import json
import math
import os
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from probe._stderr import say as _say

__all__ = ["History", "start", "answer", "rows", "carry", "EVERY_S", "KEEP_S", "MAX_ROWS", "MAX_STACKS"]

EVERY_S = 30.0
KEEP_S = 3600.0
MAX_ROWS = 100_000  # about 10 MB at most: 8 ranks of 10 threads sampled every 30 s for an hour are 9,600
MAX_STACKS = 4096
MAX_FRAMES = 128  # innermost frames of a stack kept
IN_FLIGHT = 8
ASK_S = 5.0

_Row = Tuple[float, int, Optional[int], str, str, str]  # time, rank, pid, thread, stack id, source


class History:
    """The last hour of one helper's ranks' stacks (``helper.local_members()``), deduplicated."""

    def __init__(self, helper: Any, every: float = EVERY_S, keep: float = KEEP_S) -> None:
        self.helper = helper
        self.every = every
        self.keep = keep
        self.samples = 0
        self.seconds = 0.0  # spent sampling, in all (the helper's wall time, not the ranks')
        self._rows: Deque[_Row] = collections.deque()
        self._stacks: Dict[str, Tuple[str, str, int]] = {}  # id -> (innermost func, frames' JSON, rows naming it)
        self._lock = threading.Lock()
        self._complained = False
        self.listeners: List[Callable[["History"], None]] = []  # called after each sample, on this thread

    # -- sampling ---------------------------------------------------------------------------------

    def start(self) -> "History":
        threading.Thread(target=self._run, name="probe-stack-history", daemon=True).start()
        return self

    def _run(self) -> None:
        while True:
            time.sleep(self.every)
            try:
                self.sample()
                for listener in list(self.listeners):  # a rule over the samples (probe.host.alert_straggler)
                    listener(self)
            except BaseException as exc:  # noqa: BLE001 -- the history never takes its helper down
                if not self._complained:
                    self._complained = True
                    _say("probe: the stack history failed a sample: %s: %s" % (type(exc).__name__, exc))

    def sample(self) -> int:
        """Ask every live rank of the node for its stacks once; the rows added."""
        from probe.client.client import Client
        from probe.client.fanout import fan_out
        from probe.client.results import thread_stacks
        from probe.client.targets import parse_target

        started = time.monotonic()
        members = [m for m in self.helper.local_members() if m.get("pid") and m.get("state") != "dead"]

        def stacks_of(member: Dict[str, Any]) -> Tuple[Dict[str, Any], str]:
            client = Client(parse_target(str(member["pid"])), None, ASK_S)
            stacks = thread_stacks(client.backtrace())  # read from outside where the agent cannot answer
            return stacks, "outside" if client.note else "agent"

        outcomes = fan_out(members, stacks_of, IN_FLIGHT, ASK_S + 1.0)
        at = time.time()
        added = 0
        with self._lock:
            for member, outcome in zip(members, outcomes):
                if outcome.error is not None:
                    continue
                stacks, source = outcome.value
                for thread, key in stacks.items():
                    stack_id = self._intern(key)
                    if stack_id is None:
                        continue
                    self._rows.append((at, member["rank"], member.get("pid"), thread, stack_id, source))
                    added += 1
            self._trim(at)
        self.samples += 1
        self.seconds += time.monotonic() - started
        return added

    def _intern(self, key: Tuple[Tuple[str, str, int], ...]) -> Optional[str]:
        """The stack's id, stored once (with the lock held); None where the bound on distinct stacks is
        reached and no old row frees one."""
        frames = json.dumps([list(f) for f in key[:MAX_FRAMES]])
        stack_id = hashlib.blake2b(frames.encode("utf-8", "replace"), digest_size=8).hexdigest()
        known = self._stacks.get(stack_id)
        if known is None:
            while len(self._stacks) >= MAX_STACKS and self._rows:
                self._drop_oldest()
            if len(self._stacks) >= MAX_STACKS:
                return None
            known = (key[0][0] if key else "", frames, 0)
        self._stacks[stack_id] = (known[0], known[1], known[2] + 1)
        return stack_id

    def _drop_oldest(self) -> None:
        row = self._rows.popleft()
        func, frames, count = self._stacks[row[4]]
        if count <= 1:
            del self._stacks[row[4]]
        else:
            self._stacks[row[4]] = (func, frames, count - 1)

    def _trim(self, now: float) -> None:
        while self._rows and (len(self._rows) > MAX_ROWS or self._rows[0][0] < now - self.keep):
            self._drop_oldest()

    # -- reading ----------------------------------------------------------------------------------

    def window(self, since: float, thread: str = "MainThread") -> Tuple[Optional[float], List[_Row], Dict[str, str]]:
        """(the oldest sample kept, the rows of ``thread`` at ``since`` or later oldest first, the frames' JSON
        of each stack they name): what a rule over the last minutes reads (the straggler's alert), a copy of
        that window alone."""
        out: List[_Row] = []
        with self._lock:
            for row in reversed(self._rows):
                if row[0] < since:
                    break
                if row[3] == thread:
                    out.append(row)
            oldest = self._rows[0][0] if self._rows else None
            stacks = {r[4]: self._stacks[r[4]][1] for r in out}
        out.reverse()
        return oldest, out, stacks

    def answer(self, current: bool = False) -> Dict[str, Any]:
        """``GET /v1/stack_history``'s body: the rows, and each stack they name once."""
        with self._lock:
            self._trim(time.time())
            rows = list(self._rows)
            stacks = dict(self._stacks)
        if current:
            from probe.client.stack_history import current_runs, shape_of

            shapes: Dict[str, Any] = {}

            def shape(stack_id: str) -> Any:
                if stack_id not in shapes:
                    shapes[stack_id] = shape_of(json.loads(stacks[stack_id][1]))
                return shapes[stack_id]

            rows = [tuple(r) for r in current_runs(rows, shape, 3, 4)]  # type: ignore[misc]
        named = {r[4] for r in rows}
        return {"every_s": self.every, "keep_s": self.keep, "samples": self.samples,
                "rows": [list(r) for r in rows], "stacks": {k: [v[0], v[1]] for k, v in stacks.items() if k in named}}


def every_s() -> float:
    """``PROBE_STACK_EVERY`` seconds (default 30); 0 (or off, no) turns the history off."""
    raw = os.environ.get("PROBE_STACK_EVERY", "").strip().lower()
    if raw in ("0", "off", "no", "false"):
        return 0.0
    try:
        value = float(raw) if raw else EVERY_S
    except ValueError:
        return EVERY_S
    return value if math.isfinite(value) and value > 0 else EVERY_S


def start(helper: Any) -> Optional[History]:
    """The helper's history, started (``helper.history``); None where ``PROBE_STACK_EVERY=0``; never raises."""
    try:
        every = every_s()
        if not every:
            return None
        history = History(helper, max(every, 0.1)).start()
        helper.history = history
        return history
    except BaseException as exc:  # noqa: BLE001
        _say("probe: no stack history in process %d: %s" % (os.getpid(), exc))
        return None


def answer(helper: Any, path: str) -> Dict[str, Any]:
    """``GET /v1/stack_history[?current=1]`` of ``helper``; a helper that keeps none answers 404."""
    from probe.errors import NotFound

    history = getattr(helper, "history", None)
    if history is None:
        raise NotFound("this node helper keeps no stack history", hint="PROBE_STACK_EVERY=0 turned it off")
    return history.answer(current="current=1" in path.partition("?")[2].split("&"))  # type: ignore[no-any-return]


def rows(helper: Any) -> List[List[Any]]:
    """The history as ``cluster.stack_history``'s rows (``probe.client.stack_history.COLUMNS``), for a
    record the watch writes; none where the helper keeps none."""
    history = getattr(helper, "history", None)
    if history is None:
        return []
    from probe.client.stack_history import rows_of_answer
    from probe.host.members import node_host

    return rows_of_answer(history.answer(), node_host())


def carry(helper: Any, records: List[Dict[str, Any]]) -> None:
    """Put each rank's history into its record (a stall's or a death's, by the watch); never raises."""
    try:
        from probe.client.stack_history import carry as _carry

        _carry(records, rows(helper))
    except Exception as exc:  # noqa: BLE001 -- the record is written without it
        _say("probe: the record carries no stack history: %s: %s" % (type(exc).__name__, exc))
