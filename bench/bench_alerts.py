"""Alerts (issue 36 items 2 and 5): what their evaluation adds to the stall watch's look, at the master's node
of a simulated 1,024-rank job on 128 nodes.

    python bench/bench_alerts.py [--rounds 6] [--looks 150] [--gap 0.002] [--history-minutes 10]

A real ``probe.host.helper.Helper`` and its real ``probe.host.watch.Watch`` over SIMULATED ranks, as
``bench_metrics.py`` builds them (``Node``): 8 ``sleep`` processes registered as this node's ranks, each with
a progress file in the step counter's format (rewritten before each look: the ranks step), and 127 other
nodes' reports held, as ``bench_fanout_helpers.py`` sends them. The helper keeps a stack history
(``probe.host.history.History``, not started: filled here) of ``--history-minutes`` minutes of samples a
second of its 8 ranks, 10 threads each, one rank in its own code and the others in an all_reduce (a
straggler), and one more sample before every look, so that the straggler's rule judges at every look (its
worst case: ``PROBE_STACK_EVERY`` as short as the watch's poll) over windows of 5 minutes.

Windows of ``--looks`` looks alternate (A B B A): alerts on (a webhook on 127.0.0.1 that answers at once,
every rule at its defaults: the RSS read a minute, the straggler judged after each sample, its one alert
posted) and off (no webhook, no judging). The figure is the wall time of ``Watch.look()`` itself, ``--gap``
seconds apart, while the sampler's thread judges (the GIL they share is counted); the real watch looks once
a second. Beside it the judgement's own time, and one reading of the 8 ranks' RSS (once a minute).
"""

import argparse
import hashlib
import json
import os
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_metrics  # noqa: E402 -- sets PROBE_RUNTIME_DIR before probe is imported
from _common import Summary, figure, header, table  # noqa: E402

THREADS = 10
STRAGGLER = 5
C10D = "/usr/lib/python3/site-packages/torch/distributed/distributed_c10d.py"


def _stack(rank: int, thread: int) -> List[List[Any]]:
    """A stack as the history keeps it (innermost first): the main thread of the straggler in its loader, of
    the others in an all_reduce; the other threads blocked in a queue."""
    if thread == 0 and rank == STRAGGLER:
        return [["decode", "/srv/job/data.py", 41], ["load_batch", "/srv/job/data.py", 77], ["main", "/srv/job/train.py", 120]]
    if thread == 0:
        return [["all_reduce", C10D, 2800], ["wrapper", "/usr/lib/python3/site-packages/torch/distributed/c10d_logger.py", 81],
                ["main", "/srv/job/train.py", 131]]
    return [["wait", "/usr/lib/python3.11/threading.py", 327], ["get", "/usr/lib/python3.11/queue.py", 171],
            ["worker_%d" % thread, "/srv/job/workers.py", 20 + thread]]


def _sample(history: Any, at: float, ranks: int) -> None:
    """One sample of every rank into ``history``, as its sampler adds it (its own interning and trimming)."""
    with history._lock:
        for rank in range(ranks):
            for thread in range(THREADS):
                key = tuple(tuple(f) for f in _stack(rank, thread))
                stack_id = history._intern(key)
                history._rows.append((at, rank, 1000 + rank, "MainThread" if thread == 0 else "t%d" % thread,
                                      stack_id, "agent"))
        history._trim(at)
    history.samples += 1


class _Receiver:
    """A webhook on 127.0.0.1 that answers every post at once."""

    def __init__(self) -> None:
        self.posts: List[Dict[str, Any]] = []
        posts = self.posts

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                posts.append(json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0))))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = "http://127.0.0.1:%d/hook" % self.server.server_address[1]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="A B B A groups: alerts on and off")
    parser.add_argument("--looks", type=int, default=150, help="looks a window")
    parser.add_argument("--gap", type=float, default=0.002, help="seconds between two looks")
    parser.add_argument("--history-minutes", type=float, default=10.0)
    parser.add_argument("--every", type=float, default=0.01, help="seconds between two samples of the history")
    args = parser.parse_args()
    os.environ.update(PROBE_ALERT_STRAGGLER_MINUTES="5")
    os.environ.pop("PROBE_ALERT_RSS_EVERY_S", None)  # its default, a reading a minute: timed on its own below
    from probe.host.alerts import Alerts, Hook
    from probe.host.history import History

    header("Alerts: what their evaluation adds to the watch's look (the master of 1,024 ranks / 128 nodes)", [
        "a real helper and watch over 8 simulated ranks (127 other nodes' reports held); %d rounds of %d looks "
        "%.0f ms apart, alerts on (every rule, the straggler judged at every look over 5 min of a %.0f-minute "
        "history) / off, interleaved (A B B A)" % (args.rounds, args.looks, args.gap * 1e3, args.history_minutes)])
    node = bench_metrics.Node(8, 127)
    receiver = _Receiver()
    logged: List[str] = []
    try:
        helper, watch = node.helper, node.helper.watch
        history = History(helper, 1.0)
        now = time.time()
        for i in range(int(args.history_minutes * 60)):
            _sample(history, now - args.history_minutes * 60 + i, 8)
        helper.history = history
        on = Alerts([Hook(receiver.url, False)], logged.append)
        off = Alerts([], logged.append)
        stop = threading.Event()
        judging = {"on": False}

        def sampler() -> None:  # the history's own thread: a sample, then its listeners (the straggler's rule)
            while not stop.wait(args.every):
                _sample(history, time.time(), 8)
                for listener in list(history.listeners) if judging["on"] else ():
                    listener(history)

        threading.Thread(target=sampler, daemon=True).start()
        step = [100]
        looks: Dict[str, List[float]] = {"on": [], "off": []}
        windows: Dict[str, List[float]] = {"on": [], "off": []}
        for i in range(args.rounds * 2):
            order = ("off", "on") if i % 2 == 0 else ("on", "off")
            for what in order:
                watch.alerts = on if what == "on" else off
                judging["on"] = what == "on"
                times = []
                for _ in range(args.looks):
                    step[0] += 1
                    node.step(step[0])
                    start = time.perf_counter()
                    watch.look()
                    times.append(time.perf_counter() - start)
                    time.sleep(args.gap)
                looks[what] += times
                windows[what].append(statistics.median(times))
        stop.set()
        on.drain(5.0)
        judged, judging_s = on.straggler.judged, on.straggler.seconds
        from probe.host.alert_rules import rss_bytes

        rss = []
        for _ in range(50):
            start = time.perf_counter()
            for proc in node.procs:
                rss_bytes(proc.pid)
            rss.append(time.perf_counter() - start)
    finally:
        receiver.close()
        node.close()
    s_on, s_off = Summary.of(looks["on"]), Summary.of(looks["off"])
    rows = [[name, str(s.n), "%.1f" % (s.median * 1e6), "%.1f-%.1f" % (s.q1 * 1e6, s.q3 * 1e6),
             "%.1f-%.1f" % (s.low * 1e6, s.high * 1e6)] for name, s in (("alerts on", s_on), ("alerts off", s_off))]
    print(table(rows, ["the watch's look", "n", "median us", "IQR us", "min-max us"]))
    per_window = [a - b for a, b in zip(windows["on"], windows["off"])]
    diff = s_on.median - s_off.median
    iqr = max(s_off.q3 - s_off.q1, 1e-9)
    print()
    print("per window pair, on - off (medians): %s us" % ", ".join("%+.1f" % (d * 1e6) for d in per_window))
    print("the straggler judged %d times on the history's thread: %.2f ms a judgement (mean; the first reads the whole window), %d alert(s) "
          "posted: %s" % (judged, 1e3 * judging_s / max(judged, 1), len(receiver.posts),
                          "; ".join(p.get("summary", "")[:120] for p in receiver.posts[:1])))
    figure("the watch's look, alerts on (every rule)", looks["on"], unit="us", scale=1e6, peer="alerts off",
           peer_values=looks["off"], ratio=s_on.median / s_off.median)
    figure("the watch's look: on - off, medians a window pair", per_window, unit="us", scale=1e6)
    figure("the straggler's judgement on the history's thread (mean)", value=1e3 * judging_s / max(judged, 1), unit="ms")
    r = Summary.of(rss)
    print("one reading of the 8 ranks' RSS (the memory rule, once a minute): median %.1f us" % (r.median * 1e6))
    figure("one reading of 8 ranks' RSS (a minute apart)", rss, unit="us", scale=1e6)
    measurable = abs(diff) > iqr
    print("SUMMARY the watch's look at the master of 1,024 ranks: %.1f us with every alert rule on, %.1f us off "
          "(%+.1f us, %+.1f %%; the off looks' IQR is %.1f us): %s" % (
              s_on.median * 1e6, s_off.median * 1e6, diff * 1e6, 100.0 * diff / s_off.median, iqr * 1e6,
              "more than the looks' own spread" if measurable else "within the looks' own spread: nothing measurable"))


if __name__ == "__main__":
    main()
