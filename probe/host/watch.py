"""The stall watch (issue 21): a node helper notices that its ranks stopped making steps and records every
one of them, before a watchdog or the scheduler ends the job.

A daemon thread of the node's helper (``python -m probe.host``, or torchrun's launcher), so it needs no GIL
of any rank. Every ``POLL_S`` it reads the progress file of each rank it has (``progress-<pid>.bin``, which
the rank's step counter writes in place at every optimizer step: ``probe.tables.torch.steps``): a few small
reads a second, nothing asked of any rank while steps advance.

The rule. A stall is no rank of the node advancing its step counter for ``hang_after`` seconds:
``PROBE_HANG_AFTER`` where set; otherwise ``max(PROBE_HANG_MIN (default 60), 5 x the longest recent step
time)``, at most 300, so that a slow job is not taken for a hung one and the record comes well before
the usual watchdog timeouts (NCCL's 10 minutes). Until a rank's second step its step time is taken to be
the time from its start to its first step. Before any rank's first step nothing is recorded, unless
``PROBE_HANG_AFTER`` is set: then a job that makes no first step for max(``PROBE_HANG_AFTER``,
``PROBE_HANG_MIN``) seconds is recorded too (a start-up, imports and data loading, takes longer than a
step; the step counter also comes in only once the program has imported torch.optim). Where steps
stopped for half of ``hang_after``, and again at ``hang_after``, each rank whose agent answers is asked
where its Flight Recorder is (its newest entry and its newest completed one): an entry that moved between
the two is progress (a long evaluation or a checkpoint that still makes collectives), and the wait starts
again. One record per stall: the next needs progress in between. ``PROBE_SNAPSHOT=0`` turns the watch off.

The record: ``probe.snapshot.capture.capture_members`` for every rank of the node (a rank whose agent
cannot answer is read from outside), each written into a new directory of ``store.snapshot_root()``
(``PROBE_SNAPSHOT_DIR``), the node's meta last, then ``store.clean``. A rank of that stall that dies
afterwards (the watchdog's SIGABRT, the launcher's SIGTERM, the process group's timeout) has its crash
record's text copied into its record file (``crash``), rewritten atomically, when the watch sees it dead
(in torchrun's launcher, also at the launcher's exit): a death after a recorded stall belongs to that
stall's record and makes no record of its own, until the ranks make progress again. Where no record holds
a rank that died, its death is recorded (``rank N died: ...``), named as exactly as this node saw it
(``probe.host.exits``: the signal, where the launcher or the zombie told it). Each meta says which run
of the job it is of (``probe.snapshot.runs``) and where the job served (``probe_port``, ``ports``), so that
a record is read as its own run's and found at the job's address once the job is gone.

A process of its own under ``PROBE_PORT`` that never becomes a rank (no launcher numbered it, it made no
process group) is watched alone, as rank 0 of one, while no rank is known on the node. Said in
``node-PORT.log``. Nothing here may take the helper down: every look is caught at its boundary.
"""

import collections
import math
import os
import socket
import threading
import time
from typing import Any, Deque, Dict, List, Optional, Tuple

from probe import _paths
from probe._stderr import say as _say
from probe._words import listed
from probe.host import alerts, deaths, exits

__all__ = ["Watch", "start", "hang_after_rule", "POLL_S", "HANG_MIN_S", "HANG_CAP_S", "STEP_FACTOR"]

POLL_S = 1.0
HANG_MIN_S = 60.0
HANG_CAP_S = 300.0
STEP_FACTOR = 5.0
RECENT = 256  # step times kept per rank (one a look at most: the last few minutes of a job stepping)
CAPTURE_DEADLINE_S = 60.0
FR_TIMEOUT_S = 5.0
CRASH_TEXT_BYTES = 256 * 1024
FOLLOW_DEATHS_S = 1800.0  # how long after a record a rank's death is still copied into it
REWORD_S = 60.0  # how long after a record made at deaths its words are amended by what the launcher says
EXIT_WAIT_S = 15.0  # how long torchrun's launcher, exiting, waits for a record being written to be whole

def _number(name: str) -> Optional[float]:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def enabled() -> bool:
    return os.environ.get("PROBE_SNAPSHOT", "1").strip().lower() not in ("0", "false", "no", "off")


def hang_after_rule(fixed: Optional[float], minimum: float, longest_step: float) -> float:
    """``fixed`` where given; else max(``minimum``, STEP_FACTOR x ``longest_step``), at most HANG_CAP_S
    (never below ``minimum``)."""
    if fixed is not None:
        return fixed
    return max(minimum, min(HANG_CAP_S, STEP_FACTOR * longest_step))


def _ticks_per_s() -> float:
    try:
        return float(os.sysconf("SC_CLK_TCK"))
    except (ValueError, OSError):
        return 100.0


class _Rank:
    """What the watch knows of one rank's process."""

    __slots__ = ("rank", "pid", "ticks", "steps", "moved", "first_seen", "times", "startup")

    def __init__(self, rank: int, pid: int, now: float) -> None:
        self.rank = rank
        self.pid = pid
        try:
            self.ticks = _paths.process_start_ticks(str(pid))
        except (OSError, ValueError, IndexError):
            self.ticks = 0
        self.steps = 0
        self.moved = now  # when its counter last moved (its own clock: CLOCK_MONOTONIC, the host's)
        self.first_seen = now
        self.times: Deque[float] = collections.deque(maxlen=RECENT)
        self.startup = 0.0  # start of the process to its first step: the step time until a real one is known

    def look(self, now: float) -> None:
        from probe.tables.torch.steps import read_progress

        found = read_progress(_paths.progress_path(self.pid))
        if found is None or found.pid != self.pid or (found.start_ticks and self.ticks
                                                      and found.start_ticks != self.ticks):
            return  # not made yet, or a file of an earlier process with this pid
        if found.steps == self.steps:
            return
        self.steps = found.steps
        self.moved = found.last if now - 1e6 < found.last <= now + 1.0 else now  # another clock: when seen
        if found.step_time > 0:
            self.times.append(found.step_time)
        elif not self.times and self.ticks and not self.startup:
            since_start = found.first - self.ticks / _ticks_per_s()
            if 0 < since_start < 1e6:
                self.startup = since_start

    def longest_step(self) -> float:
        return max(self.times) if self.times else self.startup


class _Recorded:
    """A stall recorded: where, and the ranks whose deaths are still to be copied into it."""

    def __init__(self, directory: str, files: Dict[int, str], ranks: Dict[int, _Rank], at: float) -> None:
        self.directory = directory
        self.files = files  # pid -> its rank file
        self.ranks = ranks  # pid -> the rank (its start ticks name its crash record)
        self.at = at


class Watch:
    """The watch of one helper (``helper.members``, ``helper.base_port``, ``helper.kind``)."""

    def __init__(self, helper: Any) -> None:
        self.helper = helper
        self.fixed = _number("PROBE_HANG_AFTER")
        minimum = _number("PROBE_HANG_MIN")
        self.minimum = HANG_MIN_S if minimum is None else minimum
        self.poll = _number("PROBE_WATCH_POLL_S") or POLL_S
        self.ranks: Dict[int, _Rank] = {}  # pid -> rank
        self.recorded: Optional[_Recorded] = None  # the last record, while its ranks may still die
        self.held: Dict[int, int] = {}  # pid -> start ticks: ranks a record holds, whose death is not news
        self.solo: Optional[Any] = None  # the lone process watched as rank 0 of one, where no rank is known
        self.rewording: Optional[Tuple[str, List[deaths.Death], str, float]] = None  # the last death record
        self.recording = False  # a record is being written (the launcher's exit waits for it)
        self.stalled_since: Optional[float] = None  # the progress time of the stall already recorded
        self.baseline: Optional[Tuple[float, Dict[int, Any], float, bool]] = None
        """(progress time, each rank's Flight Recorder mark then, stalled seconds to compare at, asked again)"""
        self.fr_moved = 0.0
        self.records = 0
        self._complained: Dict[str, bool] = {}
        self._lock = threading.Lock()  # one look at a time (the thread's, and the exit hook's)
        self.alerts = alerts.Alerts.from_env(self._log)  # PROBE_ALERT_WEBHOOK: probe.host.alerts

    # -- the thread -------------------------------------------------------------------------------

    def start(self) -> "Watch":
        thread = threading.Thread(target=self._run, name="probe-watch", daemon=True)
        thread.start()
        if self.helper.kind == "launcher":  # torchrun exits right after its last rank: copy the deaths first
            import atexit

            atexit.register(self._at_exit)
        return self

    def _run(self) -> None:
        while True:
            time.sleep(self.poll)
            try:
                self.look()
            except BaseException as exc:  # noqa: BLE001 -- the watch never takes its helper down
                self._once("look", "probe: the stall watch failed a look: %s: %s" % (type(exc).__name__, exc))

    def _at_exit(self) -> None:
        """At the launcher's exit (its ranks stopped): a record the watch is writing is let finish (for up to
        EXIT_WAIT_S: the launcher's exit would kill it half written), a death no record holds is recorded
        (what the crash records kept), then the deaths not copied yet, for at most 3 s more."""
        try:
            wait = EXIT_WAIT_S if self.recording else 1.0
            deadline = time.monotonic() + wait + 3.0
            if self._lock.acquire(timeout=wait):  # a rank that died unrecorded (its death ends the launcher)
                try:
                    members = self._members()
                    died = self._died_uncovered(members)
                    if died:
                        self._record_death(members, died)
                    self._reword()
                finally:
                    self._lock.release()
            while self.recorded is not None and time.monotonic() < deadline:
                if self._lock.acquire(timeout=0.5):
                    try:
                        members = self._members()
                        self._copy_deaths(members)
                        for member in members:
                            if self._dead(member):
                                _forget(self.ranks.pop(member.pid, None))
                    finally:
                        self._lock.release()
                time.sleep(0.1)
        except BaseException:  # noqa: BLE001 -- at exit: nothing more to do
            pass

    # -- one look ---------------------------------------------------------------------------------

    def look(self) -> Optional[str]:
        """Read every rank's progress; record where the node stalled. Returns the snapshot written, if any."""
        with self._lock:
            return self._look()

    def _look(self) -> Optional[str]:
        now = time.monotonic()
        members = self._members()
        self._reword()
        if self.recorded is not None:
            self._copy_deaths(members)
        died = self._died_uncovered(members)
        if died:
            return self._record_death(members, died)
        live: List[_Rank] = []
        for member in members:
            if self._dead(member):
                _forget(self.ranks.pop(member.pid, None))
                continue
            seen = self.ranks.get(member.pid)
            if seen is None:
                seen = self.ranks[member.pid] = _Rank(member.rank, member.pid, now)
            seen.rank = member.rank
            seen.look(now)
            live.append(seen)
        known = {m.pid for m in members}
        for pid in [p for p in self.ranks if p not in known]:
            del self.ranks[pid]
        for pid in [p for p in self.held if p not in known]:
            del self.held[pid]
        self.alerts.look(self, live)  # the cheap rules (RSS from /proc): probe.host.alerts
        if not live:
            self.baseline = None
            return None
        stepped = [r for r in live if r.steps]
        if not stepped and self.fixed is None:
            return None  # before the first step: nothing to compare with
        progress = max(max(r.moved if r.steps else r.first_seen for r in live), self.fr_moved)
        if self.stalled_since is not None:
            if progress <= self.stalled_since:
                return None  # this stall is recorded already
            self.stalled_since = None
            self.recorded = None  # progress since: the ranks of that record are no longer dying of it
            self.held.clear()
        hang_after = self.hang_after(live) if stepped else max(self.fixed or 0.0, self.minimum)
        stalled = now - progress
        if self.baseline is not None and self.baseline[0] != progress:
            self.baseline = None
        if stalled < hang_after / 2:
            return None
        if self.baseline is None:  # where each rank's Flight Recorder is, to compare with at hang_after
            self.baseline = (progress, self._fr_marks(members), hang_after, False)
            return None
        _, before, due, again = self.baseline
        if stalled < due:
            return None
        marks = self._fr_marks(members)
        if any(pid in before and before[pid] != mark for pid, mark in marks.items()):
            self.fr_moved = time.monotonic()  # collectives go on: progress, though no step
            self.baseline = None
            return None
        if marks and not any(pid in before for pid in marks) and not again:
            # no rank answered both times (the first answer of an agent may be slow): once more, half later
            self.baseline = (progress, marks, due + hang_after / 2, True)
            return None
        self.stalled_since = progress
        self.baseline = None
        last_step = max((r.moved for r in stepped), default=0.0)
        if not stepped:
            why = "no step since the ranks started, %.0f s" % stalled
        elif self.fr_moved > last_step:
            why = "no step for %.0f s, no collective for %.0f s" % (now - last_step, stalled)
        else:
            why = "no step for %.0f s" % stalled
        return self.record(members, "stall: %s (hang_after %.0f s)" % (why, hang_after), hang_after)

    def _members(self) -> List[Any]:
        """The node's ranks; where none is known, a lone process of the job watched as rank 0 of one."""
        members = self.helper.members.scan()
        self.solo = None
        if not members:
            self.solo = self.helper.members.solo()
            members = [self.solo] if self.solo is not None else []
        for member in members:
            seen = self.ranks.get(member.pid)
            if seen is not None and seen.ticks and self._dead(member):
                exits.note_zombie(member.pid, seen.ticks)  # its exit status, while its parent has not reaped it
        return members

    def _died_uncovered(self, members: List[Any]) -> List[deaths.Death]:
        """The deaths of ranks seen alive at an earlier look, where no record holds them yet and their crash
        records say they did not end cleanly (the watchdog's SIGABRT, a crash, an uncaught exception, SIGTERM
        from a launcher or a scheduler's time limit, a signal without a handler); none else (a clean exit
        leaves no crash record, a Ctrl-C is a person's choice). A rank that a record of this stall holds
        (its death is copied into that record) is no news."""
        from probe.reader import crash

        covered = set(self.recorded.ranks) if self.recorded is not None else set()
        covered |= set(self.held)
        found_deaths: List[deaths.Death] = []
        for member in members:
            if not self._dead(member) or member.pid not in self.ranks or member.pid in covered:
                continue
            seen = self.ranks[member.pid]
            found = crash.dead_record(member.pid)
            if found is None or (seen.ticks and found.start_ticks != seen.ticks):
                continue
            if found.cause.startswith("uncaught exception: KeyboardInterrupt"):
                continue
            found_deaths.append((found.died_at or float("inf"), member.rank, member.pid, found.cause))
        return found_deaths

    def _record_death(self, members: List[Any], died: List[deaths.Death]) -> Optional[str]:
        """Record the node at a rank's death, no stall recorded before it: what the ranks still alive show
        (they may be ending too), and the dead one's crash record; the stall rule then waits for progress."""
        live = [r for m in members if not self._dead(m) for r in [self.ranks.get(m.pid)] if r is not None]
        self.stalled_since = max([r.moved if r.steps else r.first_seen for r in live] + [self.fr_moved, 0.0])
        self.baseline = None
        directory = self.record(members, deaths.reason(died), None, died)
        for member in members:  # a dead rank recorded here needs no second record
            if self._dead(member):
                _forget(self.ranks.pop(member.pid, None))
        return directory

    def _reword(self) -> None:
        """The last record made at deaths, its words made more exact where the launcher has said more since
        (for REWORD_S after it)."""
        if self.rewording is None:
            return
        directory, died, words, at = self.rewording
        if time.monotonic() - at > REWORD_S:
            self.rewording = None
            return
        try:
            self.rewording = (directory, died, deaths.reword(directory, died, words), at)
        except Exception as exc:  # noqa: BLE001
            self.rewording = None
            self._log("probe: cannot amend the record in %s: %s" % (directory, getattr(exc, "message", exc)))

    def hang_after(self, live: List[_Rank]) -> float:
        return hang_after_rule(self.fixed, self.minimum, max((r.longest_step() for r in live), default=0.0))

    @staticmethod
    def _dead(member: Any) -> bool:
        return member.state == "dead"

    def _fr_marks(self, members: List[Any]) -> Dict[int, Any]:
        """Each answering rank's Flight Recorder: (its newest entry, its newest completed one), read as the
        table's rows (no SQL engine in the rank), all ranks at once; none where the rank cannot answer or has
        no torch."""
        from probe.client.client import Client
        from probe.client.fanout import fan_out
        from probe.client.targets import parse_target

        asked = [m for m in members if m.state == "running"]

        def mark(member: Any) -> Tuple[Any, Any]:
            rows = Client(parse_target(str(member.pid)), None, FR_TIMEOUT_S).table_rows("torch.flight_recorder")
            names = [name for name, _ in rows.columns]
            at, state = names.index("record_id"), names.index("state")
            ids = [row[at] for row in rows.rows if row[at] is not None]
            done = [row[at] for row in rows.rows if row[at] is not None and row[state] == "completed"]
            return max(ids, default=None), max(done, default=None)

        outcomes = fan_out(asked, mark, 16, FR_TIMEOUT_S + 1.0)
        return {m.pid: o.value for m, o in zip(asked, outcomes) if o.error is None}

    # -- recording --------------------------------------------------------------------------------

    def record(self, members: List[Any], reason: str, hang_after: Optional[float],
               died: Optional[List[deaths.Death]] = None) -> Optional[str]:
        """Record every rank of ``members`` into a new snapshot directory; its path (None where it failed).
        ``died``: the deaths it is made at (its reason is worded again once the ranks are captured)."""
        self.recording = True
        try:
            return self._record(members, reason, hang_after, died)
        finally:
            self.recording = False

    def _record(self, members: List[Any], reason: str, hang_after: Optional[float],
                died: Optional[List[deaths.Death]]) -> Optional[str]:
        from probe.client.client import Client
        from probe.client.targets import parse_target
        from probe.snapshot import capture, record, store

        started = time.time()
        what = "stall" if reason.startswith("stall") else "a rank's death"
        job = self._job(members)
        root = store.snapshot_root()
        try:
            directory = store.new_snapshot_dir(root, job, started)
        except Exception as exc:  # noqa: BLE001
            self._log("probe: %s on this node (%s); cannot record it: %s" % (what, reason, getattr(exc, "message", exc)))
            return None
        self._log("probe: %s on this node (%s); recording ranks %s into %s"
                  % (what, reason, ",".join(str(m.rank) for m in members), directory))
        pairs = [(Client(parse_target(str(m.pid)), None, CAPTURE_DEADLINE_S / 2), m) for m in members]
        secrets = [self.helper._token.decode("utf-8")] if getattr(self.helper, "_token", None) else []
        records = capture.capture_members(pairs, reason, job, CAPTURE_DEADLINE_S, secrets=secrets)
        if died:
            reason = deaths.reason(died)
        deaths.patched(records, members, [self._dead(m) for m in members], reason)
        from probe.host import history
        history.carry(self.helper, records)  # where each rank has been, the last hour (cluster.stack_history)
        files: Dict[int, str] = {}
        failed: Dict[str, str] = {}
        for member, rec in zip(members, records):
            try:
                files[member.pid] = record.write_rank(directory, rec)
            except Exception as exc:  # noqa: BLE001 -- this rank's file only
                failed[str(member.rank)] = "not written: %s" % getattr(exc, "message", exc)
                continue
            if not record.is_recorded(rec):
                failed[str(member.rank)] = str((rec.get("missing") or {}).get("evidence") or "no stacks could be read")
        ended = time.time()
        from probe import __version__

        record.write_meta(directory, dict(self._where(members), **{
            "job": job, "host": socket.gethostname(), "reason": reason, "started": started, "ended": ended,
            "ranks": sorted(m.rank for m in members if str(m.rank) not in failed), "failed": failed,
            "hang_after_s": hang_after, "by": "watch", "helper_pid": os.getpid(), "probe_version": __version__}))
        store.clean(root, job)
        self.records += 1
        self.recorded = _Recorded(directory, files, {p: r for p, r in self.ranks.items() if p in files}, time.monotonic())
        for member in members:  # a rank dead before the watch first saw it: no start ticks known
            if member.pid in files and member.pid not in self.recorded.ranks:
                self.recorded.ranks[member.pid] = _Rank(member.rank, member.pid, time.monotonic())
        self.held.update((p, r.ticks) for p, r in self.recorded.ranks.items())
        self.rewording = (directory, died, reason, time.monotonic()) if died else None
        self._log("probe: %s recorded in %s: %d rank(s) in %.1f s%s"
                  % (what, directory, len(files), ended - started, "; not recorded: %s" % listed(failed) if failed else ""))
        self.alerts.recorded(self, directory, reason, members, died)
        return directory

    def _copy_deaths(self, members: List[Any]) -> None:
        """Copy the crash record of each rank of the last record that has died since into its record file."""
        recorded = self.recorded
        if recorded is None:
            return
        if time.monotonic() - recorded.at > FOLLOW_DEATHS_S:
            self.recorded = None
            return
        from probe.snapshot import record

        for member in members:
            path = recorded.files.get(member.pid)
            if path is None or not self._dead(member):
                continue
            del recorded.files[member.pid]
            text = self._crash_text(recorded.ranks.get(member.pid), member.pid)
            if text is None:
                continue
            try:
                rec = record.read_rank(path)
                if rec.get("crash"):
                    continue
                rec["crash"] = text
                rec["died"] = True
                rec["died_how"] = _died_how(recorded.ranks.get(member.pid), member.pid)
                record.write_rank(recorded.directory, rec)
                self._log("probe: rank %d (process %d) died after the stall was recorded; its crash record is "
                          "copied into %s" % (member.rank, member.pid, path))
                self.alerts.died(self, member, rec["died_how"])
            except Exception as exc:  # noqa: BLE001
                self._log("probe: cannot copy rank %d's crash record into %s: %s"
                          % (member.rank, path, getattr(exc, "message", exc)))
        if not recorded.files:
            self.recorded = None

    @staticmethod
    def _crash_text(seen: Optional[_Rank], pid: int) -> Optional[str]:
        path = None
        if seen is not None and seen.ticks:
            path = _paths.crash_record_path(pid, seen.ticks)
        else:
            from probe.reader import crash

            found = crash.dead_record(pid)
            path = found.path if found is not None else None
        if path is None:
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as handle:
            return handle.read(CRASH_TEXT_BYTES).decode("utf-8", "replace")

    def _where(self, members: List[Any]) -> Dict[str, Any]:
        """What the meta says of where the job served and which run it is (``probe.snapshot.runs``)."""
        from probe.host.members import node_host, process_environ
        from probe.snapshot import runs

        environs = [process_environ(m.pid, (b"SLURM_JOB_ID", b"SLURM_STEP_ID", b"TORCHELASTIC_RUN_ID"))
                    for m in members]
        return {"node_host": node_host(), "node": self.helper.members.node_key(), "probe_port": self.helper.base_port,
                "helper_port": self.helper.port, "ports": sorted({m.port for m in members if m.port}),
                "run": runs.run_of(environs),
                "launch": runs.launch_of(os.getpid() if self.helper.kind == "launcher" else None,
                                         [m.pid for m in members])}

    def _job(self, members: List[Any]) -> str:
        """The job's name in the snapshot's id: the Slurm job id or torchelastic's run id a rank was started
        with, else ``port<PROBE_PORT>`` (``pid<PID>`` for a process watched alone)."""
        from probe.host.members import process_environ
        from probe.snapshot import store

        if self.solo is not None and [m.pid for m in members] == [self.solo.pid]:
            return store.job_id(pid=members[0].pid)
        for member in members:
            env = process_environ(member.pid, (b"SLURM_JOB_ID", b"TORCHELASTIC_RUN_ID"))
            if env:
                return store.job_id(env.get(b"SLURM_JOB_ID", b"").decode("ascii", "replace") or None,
                                    env.get(b"TORCHELASTIC_RUN_ID", b"").decode("ascii", "replace") or None,
                                    self.helper.base_port)
        return store.job_id(os.environ.get("SLURM_JOB_ID"), os.environ.get("TORCHELASTIC_RUN_ID"),
                            self.helper.base_port)

    # -- saying -----------------------------------------------------------------------------------

    def _log(self, line: str) -> None:
        """Into ``node-PORT.log``: a node helper's stderr is that file; torchrun's launcher also says it on
        its own stderr."""
        _say(line)
        if self.helper.kind != "node":
            try:
                fd = os.open(_paths.node_log_path(self.helper.base_port),
                             os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                try:
                    os.write(fd, (line + "\n").encode("utf-8", "replace"))
                finally:
                    os.close(fd)
            except OSError:
                pass

    def _once(self, key: str, line: str) -> None:
        if not self._complained.get(key):
            self._complained[key] = True
            self._log(line)


def _died_how(seen: Optional[_Rank], pid: int) -> Optional[str]:
    """How a rank of a record died, in the words of its crash record made exact where this node saw it."""
    from probe.reader import crash

    found = crash.dead_record(pid)
    if found is None or (seen is not None and seen.ticks and found.start_ticks != seen.ticks):
        return None
    return exits.death_words(pid, found.cause)


def _forget(seen: Optional[_Rank]) -> None:
    """A rank that died: its progress file goes where its agent could not remove it (SIGKILL, SIGTERM, a
    crash), if it is still that very process's (its pid and start time)."""
    if seen is None or not seen.ticks:
        return
    from probe.tables.torch.steps import read_progress

    path = _paths.progress_path(seen.pid)
    found = read_progress(path)
    if found is not None and found.pid == seen.pid and found.start_ticks == seen.ticks:
        try:
            os.unlink(path)
        except OSError:
            pass


def start(helper: Any) -> Optional[Watch]:
    """The helper's watch, started (None where ``PROBE_SNAPSHOT=0`` or it cannot start); never raises."""
    try:
        if not enabled():
            return None
        watch = Watch(helper).start()
        helper.watch = watch
        return watch
    except BaseException as exc:  # noqa: BLE001
        _say("probe: no stall watch in process %d: %s" % (os.getpid(), exc))
        return None
