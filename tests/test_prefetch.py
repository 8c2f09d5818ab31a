"""The node helper's samples taken for a diagnosis's next look (``probe.host.prefetch``): taken once, only by a
look of the same diagnosis (begun after its first look), never holding up the caller past its wait, bounded
in how many run at once, and a sampler that raises keeps nothing. The end-to-end path (a real helper, a
real torchrun job's straggler named through it with both looks' samples) is in test_diagnose_straggler.py."""

import threading
import time

from probe.host import prefetch


def test_samples_are_taken_once_and_only_by_a_look_after_they_began():
    key = ("pid-a", 0)
    assert prefetch.start(key, lambda: [["sample"]])
    assert prefetch.take(key, 10.0, time.monotonic() + 60) is None  # begun before that diagnosis's first look
    assert prefetch.start(key, lambda: [["sample"]])
    assert prefetch.take(key, 10.0, time.monotonic() - 60) == [["sample"]]
    assert prefetch.take(key, 0.0) is None  # taken already


def test_a_sampler_still_running_is_waited_for_only_as_long_as_asked_and_one_that_raises_keeps_nothing():
    gate = threading.Event()
    key = ("pid-b", 1)
    assert prefetch.start(key, lambda: gate.wait(30) and [["late"]])
    assert not prefetch.start(key, lambda: [["again"]])  # one under way for this rank: not twice
    began = time.monotonic()
    assert prefetch.take(key, 0.2) is None
    assert time.monotonic() - began < 10
    gate.set()

    def broken():
        raise RuntimeError("the rank went away")

    assert prefetch.start(("pid-c", 2), broken)
    assert prefetch.take(("pid-c", 2), 10.0) is None


def test_at_most_max_running_samplers_at_once():
    gate = threading.Event()
    started = [prefetch.start(("pid-d", r), lambda: gate.wait(30) and []) for r in range(prefetch.MAX_RUNNING + 8)]
    try:
        assert started.count(True) <= prefetch.MAX_RUNNING and not started[-1]
    finally:
        gate.set()
