"""What a scan of the collector's objects costs the program: ``probe.tables.tracked.tracked_of`` (two passes
in C, the program held meanwhile, never exposed to its own unfinished tuples) beside the loop it replaced (a
Python loop over ``gc.get_objects()`` that let the program's threads run between its bytecodes, and so could
make a ``tuple(generator)`` of theirs fail with SystemError).

    python bench/bench_tracked.py [--objects 250000,1000000] [--rounds 7]

In one process: N tracked objects (dicts and instances, as a training process holds), a thread that
ticks every 1 ms and records its longest gap (how long the program was held up), then each scan in turn,
interleaved. Prints, for each size, the scan's time and the longest gap, medians with their spread, and
the ratios against the old loop.
"""

import argparse
import gc
import os
import sys
import threading
import time
from typing import Any, Callable, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import Summary, figure, start_run  # noqa: E402
from probe.tables.tracked import tracked_of  # noqa: E402


class Wanted:
    pass


class Filler:
    pass


class Ticker:
    """A program thread that wants the GIL every millisecond; ``longest`` is its longest wait."""

    def __init__(self) -> None:
        self.longest = 0.0
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self.stop:
            time.sleep(0.001)
            now = time.perf_counter()
            self.longest = max(self.longest, now - last)
            last = now


def old_loop() -> List[Any]:
    """The loop the tables had: every object in Python, the program free to run between bytecodes."""
    objects = gc.get_objects()
    try:
        return [obj for obj in objects if type(obj) is Wanted]
    finally:
        del objects


def new_scan() -> List[Any]:
    return tracked_of(lambda cls: cls is Wanted)


def measure(scan: Callable[[], List[Any]], ticker: Ticker) -> Tuple[float, float]:
    time.sleep(0.01)
    ticker.longest = 0.0
    started = time.perf_counter()
    found = scan()
    spent = time.perf_counter() - started
    time.sleep(0.003)  # the ticker's wake after the scan counts the gap the scan made
    assert len(found) == 1000, len(found)
    return spent, ticker.longest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", default="250000,1000000")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    start_run("A scan of the collector's objects: tracked_of beside the Python loop it replaced")
    keep: List[Any] = [Wanted() for _ in range(1000)]
    ticker = Ticker()
    print("%-10s %-26s %-26s %-26s %-26s" % ("objects", "tracked_of: scan ms", "old loop: scan ms",
                                            "tracked_of: longest gap ms", "old loop: longest gap ms"))
    for size in [int(s) for s in args.objects.split(",") if s]:
        keep.extend({"filler": Filler()} for _ in range(max(0, size - len(gc.get_objects())) // 2))
        new: List[Tuple[float, float]] = []
        old: List[Tuple[float, float]] = []
        for _ in range(args.rounds):
            new.append(measure(new_scan, ticker))
            old.append(measure(old_loop, ticker))
        cells = []
        for series in ([s for s, _ in new], [s for s, _ in old], [g for _, g in new], [g for _, g in old]):
            summary = Summary.of(series)
            cells.append("%.1f [%.1f-%.1f]" % (summary.median * 1e3, summary.low * 1e3, summary.high * 1e3))
        tracked = len(gc.get_objects())
        print("%-10d %-26s %-26s %-26s %-26s" % (tracked, *cells))
        figure("%d tracked objects: scan time" % tracked, [s for s, _ in new], peer="Python loop over gc.get_objects()",
               peer_values=[s for s, _ in old])
        figure("%d tracked objects: longest hold-up of a program thread" % tracked, [g for _, g in new],
               peer="Python loop over gc.get_objects()", peer_values=[g for _, g in old])
    ticker.stop = True
    print("SUMMARY tracked_of holds the program for the whole scan; the old loop let it run (and could crash it)")


if __name__ == "__main__":
    main()
