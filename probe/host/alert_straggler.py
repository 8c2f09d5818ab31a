"""The persistent straggler's alert: one rank has held the others up for ``PROBE_ALERT_STRAGGLER_MINUTES``.

Why from the stack history: in a job whose ranks meet in a collective at every step, every rank's step
takes as long as the slowest's, so the step counter cannot tell which rank is late. Where each rank's main
thread has been can: the helper samples every rank's stacks every ``PROBE_STACK_EVERY`` seconds
(``probe.host.history``), and ``diagnose``'s straggler rule (``probe.diagnose.straggler``) already says of
one sample in which phase it is (inside a collective, a backward pass, the optimizer, a forward pass, the
program's own code) and of the ranks' counts which one rank holds the others up. This rule asks that same
question of the last M minutes of the history: where exactly one rank is the straggler over the whole
window (in its phase in at least ``SHARE`` of its samples, and ``MIN_SAMPLES`` at least), it is an alert
naming the rank, its most sampled own function, since when, and the command that says more.

Cost to the watch: nothing but a test at its look; the judgement runs on the history's own thread after
each of its samples (``History.listeners``), so at the history's sampling and off the watch, and reads
only the samples added since the last (each rank's window and its counts by phase are kept here; each
stack's phase is worked out once: a stack id is the hash of its frames); the alert's body is made and
posted on the alerts' threads. One event is one
straggler's episode: the rank and the time it began (the first window that found it); it ends when a
window no longer finds that rank, and a new one may then fire, after the rule's cooldown.

Only the ranks of this node are seen (each node's helper samples its own): a straggler is found where at
least one other rank of its node waits for it.
"""

import collections
import json
import time
from collections import Counter
from typing import Any, Deque, Dict, Optional, Sequence, Tuple

from probe.host.alert_rules import number

__all__ = ["Straggler", "MINUTES", "SHARE", "MIN_SAMPLES"]

MINUTES = 5.0  # PROBE_ALERT_STRAGGLER_MINUTES; 0 turns the rule off
SHARE = 0.6  # of the straggler's samples in the window, in its phase
MIN_SAMPLES = 3  # samples of each rank in the window, at least

Frame = Tuple[str, str, int, str]


class Straggler:
    """The rule's state: each rank's window of samples and their counts by phase, each stack's phase, the
    episode under way."""

    def __init__(self) -> None:
        self.judged = 0  # judgements made (for the bench and the tests)
        self.seconds = 0.0  # spent judging, on the history's thread
        self.judged_whole = False  # a whole window was judged once (said in the log)
        self.failed = 0
        self._listening = False  # judging after each sample of the helper's history (or off)
        self._live: Sequence[Any] = ()
        self._library: Any = None
        self._phased: Dict[str, Tuple[str, Optional[Frame], Tuple[Frame, ...]]] = {}  # stack id -> phase, own frame
        self._episode: Optional[Tuple[int, float]] = None  # (rank, since) of the straggler the last window found
        self._whole = False  # the history covered a whole window
        self._kept: Dict[int, Deque[Tuple[float, str, Optional[Frame], str]]] = {}  # rank -> its window's samples
        self._counts: Dict[int, Counter] = {}  # rank -> its window's samples by phase
        self._newest = 0.0  # the newest sample read from the history

    def look(self, alerts: Any, watch: Any, live: Sequence[Any], now: float) -> None:
        """At the watch's look, until it is done once: where the helper keeps a stack history, judge after
        each of its samples, on its thread (``History.listeners``); the look itself adds an assignment and
        a test (the live ranks are kept for the job's id in the alert)."""
        self._live = live
        if self._listening:
            return
        history = getattr(watch.helper, "history", None)
        if history is None:
            return
        self._listening = True
        minutes = number("PROBE_ALERT_STRAGGLER_MINUTES", MINUTES)
        if minutes:
            history.listeners.append(lambda sampled: self._judge(alerts, watch, sampled, minutes * 60.0))

    def _judge(self, alerts: Any, watch: Any, history: Any, span: float) -> None:
        started = time.monotonic()
        try:
            found = self.find(history, time.time(), span)
            if self._whole and not self.judged_whole:
                self.judged_whole = True
                alerts.log("probe: the straggler alert judges the last %.3g s of the stack history at each of its "
                           "samples (PROBE_ALERT_STRAGGLER_MINUTES %.3g, PROBE_STACK_EVERY %.3g s)"
                           % (span, span / 60.0, history.every))
            if found is None:
                self._episode = None
                return
            rank = found["rank"]
            if self._episode is None or self._episode[0] != rank:
                self._episode = (rank, found["since"])
            found["since"] = self._episode[1]
            alerts.fire("straggler", "rank %d since %.3f" % (rank, self._episode[1]),
                        lambda: self.fields(watch, found, span))
        except Exception as exc:  # noqa: BLE001 -- a rule never stops the history's sampling
            if not self.failed:
                alerts.log("probe: the straggler alert failed a judgement: %s: %s" % (type(exc).__name__, exc))
            self.failed += 1
        finally:
            self.judged += 1
            self.seconds += time.monotonic() - started

    def find(self, history: Any, now: float, span: float) -> Optional[Dict[str, Any]]:
        """The straggler of the window ``[now - span, now]`` of ``history``'s main-thread samples, or None:
        the window must be whole (the history has a sample that old, give or take one sampling), each rank
        sampled ``MIN_SAMPLES`` times in it, and exactly one rank the straggler by ``diagnose``'s rule. Only
        the samples added since the last call are read: each rank's window is kept here, with its counts."""
        from probe.diagnose.straggler import _culprit

        start = now - span
        oldest, rows, stacks = history.window(max(start, self._newest))
        for row in rows:
            if row[0] <= self._newest:
                continue  # read already
            phase, own, _ = self._phase_of(row[4], stacks)
            self._kept.setdefault(row[1], collections.deque()).append((row[0], phase, own, row[4]))
            self._counts.setdefault(row[1], Counter())[phase] += 1
        if rows:
            self._newest = max(self._newest, rows[-1][0])
        for rank in list(self._kept):
            kept, counts = self._kept[rank], self._counts[rank]
            while kept and kept[0][0] < start:
                counts[kept.popleft()[1]] -= 1
            if not kept:
                del self._kept[rank], self._counts[rank]
        if oldest is None or oldest > start + max(history.every, 0.05 * span):
            return None  # the history has not watched the whole window yet
        self._whole = True
        by_rank = {r: kept for r, kept in self._kept.items() if len(kept) >= MIN_SAMPLES}
        if len(by_rank) < 2:
            return None
        phases = {r: self._counts[r] for r in by_rank}
        found = _culprit(phases, by_rank)
        if found is None:
            return None
        rank, phase, wait = found
        seq = by_rank[rank]
        count = phases[rank][phase]
        if count < MIN_SAMPLES or count < SHARE * len(seq):
            return None
        others = sorted(set(by_rank) - {rank})
        waited = Counter(k[0] for o in others for k in by_rank[o] if k[1] == wait)
        # where it was while the others waited (the history samples a node's ranks at one time): the window
        # may begin before the episode did, when every rank was elsewhere
        mine = [k for k in seq if k[1] == phase and waited[k[0]] * 2 > len(others)] or \
            [k for k in seq if k[1] == phase]
        funcs = Counter(k[2] for k in mine if k[2] is not None)
        top = funcs.most_common(1)[0][0] if funcs else None
        stack_id = next((k[3] for k in mine if k[2] == top), mine[0][3])
        return {"rank": rank, "phase": phase, "wait": wait, "count": count, "samples": len(seq), "top": top,
                "top_count": funcs[top] if top else 0, "frames": self._phased[stack_id][2][:8], "since": mine[0][0],
                "others": others, "waited": {o: (phases[o][wait], len(by_rank[o])) for o in others}}

    def _phase_of(self, stack_id: str, stacks: Dict[str, str]) -> Tuple[str, Optional[Frame], Tuple[Frame, ...]]:
        """(phase, innermost own frame, frames) of one stack, by ``diagnose``'s straggler rule; kept by id."""
        known = self._phased.get(stack_id)
        if known is not None:
            return known
        from probe.diagnose.straggler import _own, _phase

        if self._library is None:
            from probe.diagnose.library import local_layout

            self._library = local_layout()  # the helper runs the ranks' interpreter, as a rule on this node
        try:
            key: Tuple[Frame, ...] = tuple((str(f[0]), str(f[1]), int(f[2]), "") for f in json.loads(stacks[stack_id]))
        except (KeyError, TypeError, ValueError, IndexError):
            key = ()
        known = (_phase(key, self._library), _own(key, self._library), key)
        if len(self._phased) > 8192:  # the stacks of samples still kept stay
            keep = {k[3] for kept in self._kept.values() for k in kept}
            self._phased = {i: p for i, p in self._phased.items() if i in keep}
        self._phased[stack_id] = known
        return known

    def fields(self, watch: Any, found: Dict[str, Any], span: float) -> Dict[str, Any]:
        """The alert's body: who, where, since when, who waits, and the command that says more."""
        from probe.diagnose.straggler import _PHASE_WORDS
        from probe.host.alert_body import where

        out = where(watch, None)
        try:
            out["job"] = watch._job(list(self._live))  # as the snapshots and the metrics name it
        except Exception:  # noqa: BLE001 -- the alert goes without it
            pass
        rank, top = found["rank"], found["top"]
        fn = "%s (%s:%d)" % (top[0], top[1], top[2]) if top else "code its stacks do not name"
        wait = "a collective" if found["wait"] == "collective" else "the backward pass (DDP's gradient all_reduce)"
        others = ", ".join("rank %d %d of %d" % (o, n, of) for o, (n, of) in sorted(found["waited"].items())[:4])
        since = time.strftime("%H:%M:%S", time.localtime(found["since"]))
        summary = ("straggler: rank %d has held up %s since %s (%.3g min): its main thread was in %s in %d of %d "
                   "samples, mostly %s, while %s waited in %s (%s)" % (
                       rank, _ranks(found["others"]), since, span / 60.0, _PHASE_WORDS.get(found["phase"], found["phase"]),
                       found["count"], found["samples"], fn, _ranks(found["others"]), wait, others))
        command = "probe %s:%s diagnose" % (out["host"], out["probe_port"])
        out.update(rule="straggler", summary=summary, culprits=[rank], victims=found["others"], phase=found["phase"],
                   since=found["since"], since_text=since, samples=found["samples"], in_phase=found["count"],
                   where={"func": top[0], "file": top[1], "line": top[2], "thread": "MainThread"} if top else None,
                   where_text=fn, frames=[list(f[:3]) for f in found["frames"]], command=command,
                   window_s=span)
        return out


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank %d" % ranks[0]) if len(ranks) == 1 else "ranks %s" % ",".join(map(str, ranks))
