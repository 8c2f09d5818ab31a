"""When to look: a first sample, a second a moment later, and a third later still where some rank showed no
sign of life between the first two (a stuck rank and a slow one look alike for a second)."""

import contextlib
import gc
import sys
import threading
import time
from typing import Any, Callable, Iterator, List, Optional, Sequence

from probe.diagnose import straggler
from probe.diagnose.evidence import Sample
from probe.diagnose.gather import sample_job, sample_one
from probe.diagnose.rules import judge, needs_longer_look
from probe.diagnose.verdict import Commands, Report

__all__ = ["diagnose", "FIRST_GAP_S", "LONGER_S"]

FIRST_GAP_S = 1.0
"""Seconds between the first two samples."""
LONGER_S = 3.0
"""From the first sample to the last one, where the first two left a rank in doubt."""

Sampler = Callable[[float, Optional[Sequence[int]], Optional[Sample]], Sample]


def sampler_for(target: Any, single: bool) -> Sampler:
    if single:
        return lambda deadline, only, previous: sample_one(target, deadline, previous)
    return lambda deadline, only, previous: sample_job(target, deadline, only, previous)


def diagnose(sampler: Sampler, deadline: float, command: Commands, gap: float = FIRST_GAP_S,
             longer: float = LONGER_S) -> Report:
    """Sample, wait, sample again (only the ranks that answered), judge; within about ``deadline`` seconds
    in all (the samples share it: the first takes at most half)."""
    looks: List[Sample] = []
    with _collector_paused(looks):
        return _diagnose(sampler, deadline, command, gap, longer, looks)


SWITCH_S = 0.05
"""Python's thread switch interval while a diagnosis runs (its default is 5 ms)."""


FREE_APART_AT = 1024
"""Ranks from which a diagnosis's looks are freed by a thread of their own once the verdict is made."""


@contextlib.contextmanager
def _collector_paused(looks: List[Sample]) -> Iterator[None]:
    """Python's cycle collector off while a diagnosis runs: the evidence of 16k ranks is millions of objects,
    none of them in a cycle, and each pass of the collector over them as they grew took seconds a look.
    What a diagnosis leaves in cycles is collected once it is done. And the thread switch interval raised
    to ``SWITCH_S``: a look through the node helpers waits on hundreds of answers at once (a thread each),
    and every thread waiting for the interpreter wakes once an interval to ask for it; at 16k ranks (512
    threads) the client spent 1.6-3.8 s of its 5.5-9 s of CPU in the kernel, and most of its spread on a
    loaded machine came from there (bench/bench_diagnose.py). A thread that waits on the wire lets the others
    run anyway.

    The looks (``looks``, filled by the diagnosis) are freed after it; at ``FREE_APART_AT`` ranks and more by
    a thread of their own, while the verdict is shown (freeing 16k ranks' evidence took 0.2 s), the
    collector back on once they are gone (on while they lived, its first pass would walk them all)."""
    was = gc.isenabled()
    switch = sys.getswitchinterval()
    gc.disable()
    sys.setswitchinterval(max(switch, SWITCH_S))
    try:
        yield
    finally:
        sys.setswitchinterval(switch)
        held = list(looks)
        looks.clear()
        if not (held and len(held[-1].ranks) >= FREE_APART_AT and _free_apart(held, was)):
            held.clear()
            if was:
                gc.enable()


def _free_apart(held: List[Sample], was: bool) -> bool:
    """Free ``held`` in a daemon thread, then turn the collector back on where it was; False where no
    thread could be had."""
    def free() -> None:
        for sample in held:  # rank by rank: one call freeing it all would hold the interpreter throughout
            compared = sample.__dict__.get("_compared")  # probe.diagnose.gather: the evidence again, by rank
            for ranks in (sample.ranks, compared[1] if isinstance(compared, tuple) else {}):
                while ranks:
                    ranks.popitem()
        held.clear()
        if was:
            gc.enable()

    try:
        threading.Thread(target=free, name="probe-free", daemon=True).start()
    except RuntimeError:
        return False
    return True


def _diagnose(sampler: Sampler, deadline: float, command: Commands, gap: float, longer: float,
              looks: List[Sample]) -> Report:
    start = time.monotonic()
    first = sampler(max(deadline / 2, min(deadline, 1.0)), None, None)
    looks.append(first)
    answered = [r for r, ev in first.ranks.items() if ev.state == "answering"]
    samples = 1
    last = first
    # A rank stepping at the first look takes its straggler samples ahead of the next look, in the wait
    # (probe.diagnose.straggler.ahead): the look is asked that much sooner, its stacks read as late as before.
    # Not where its node helper takes them already, right after the first look (probe.host.prefetch).
    lead = straggler.AHEAD_S if any(straggler.ahead(first.ranks.get(r)) and not first.ranks[r].prefetching
                                    for r in answered) else 0.0
    for target_gap in (gap, longer):
        left = deadline - (time.monotonic() - start)
        wait = target_gap - lead - (time.monotonic() - first.at)
        if not answered or left - max(wait, 0) < 0.5:
            break
        if wait > 0:
            time.sleep(wait)
        left = deadline - (time.monotonic() - start)
        last = sampler(max(left, 0.5), answered if not first.single else None, first)
        looks.append(last)
        samples += 1
        if not needs_longer_look(first, last):
            break
    report = judge(first, last, command)
    report.samples = samples
    return report
