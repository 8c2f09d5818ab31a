"""Sustained load: 50 concurrent clients against one agent, and what that costs the target's main loop.

    python bench/bench_load.py [--clients 50] [--rounds 6] [--window 2.5]

The target is tests/targets/busy.py (``PROBE=1``): its main thread counts in a tight pure-Python loop
and keeps the longest gap between two iterations. ``--clients`` threads of this process each send one
request after another on the agent's unix socket, in turn ``GET /v1/health``, ``POST /v1/query``
``{"sql": "SELECT 1"}`` and ``GET /v1/backtrace`` (``probe.client.transport.request``, one connection
per request, as the CLI does). Windows of ``--window`` seconds with the clients running (load) and
with them paused (quiet) alternate, A B B A, ``--rounds`` of each. At every window's start and end one
eval reads the target's ``counter``, its own clock, and the longest gap (then reset), so a window's
iterations/s and pause come from the target itself. Reported, with medians and spread over windows:

* requests/s, and latency p50 / p99 (per kind and all), of the requests completed in load windows;
  every request is counted as answered (200), busy (503 ``busy``), or failed (anything else: no answer);
* the main loop's iterations/s in load and quiet windows, and the ratio (its slowdown under load);
* the longest main-loop pause per window.

Latency is measured in this process, whose own 50 threads share one GIL and the machine's CPUs with
the target: it is the clients' view, not the agent's service time.
"""

import argparse
import ast
import json
import os
import statistics
import threading
import time
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

from _common import REPO, Summary, Target, figure, header, ms, summary_table, table

BUSY = os.path.join(REPO, "tests", "targets", "busy.py")
KINDS = ("health", "query", "backtrace")
QUERY = json.dumps({"sql": "SELECT 1"}).encode()


class Load:
    """Client threads that send requests while ``go`` is set; each result is (done_at, kind, seconds, outcome)."""

    def __init__(self, address: Any, clients: int) -> None:
        self.address = address
        self.go = threading.Event()
        self.stop = threading.Event()
        self.results: List[Tuple[float, str, float, str]] = []
        self._lock = threading.Lock()
        self._inflight = 0
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> "Load":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.go.set()
        for thread in self._threads:
            thread.join(60.0)

    def pause(self, timeout: float = 60.0) -> None:
        """Stop sending, and wait (bounded) until every request in flight has its answer."""
        self.go.clear()
        deadline = time.monotonic() + timeout
        while self._inflight and time.monotonic() < deadline:
            time.sleep(0.005)

    def _client(self, index: int) -> None:
        from probe.client import transport
        from probe.errors import ProbeError

        turn = index  # the clients start on different kinds
        while not self.stop.is_set():
            if not self.go.wait(0.5) or self.stop.is_set():
                continue
            kind = KINDS[turn % len(KINDS)]
            turn += 1
            with self._lock:
                self._inflight += 1
            started = time.perf_counter()
            try:
                if kind == "query":
                    response = transport.request(self.address, "POST", "/v1/query", QUERY, timeout=30.0)
                else:
                    response = transport.request(self.address, "GET", "/v1/" + kind, timeout=30.0)
                outcome = "answered" if response.status == 200 else (
                    "busy" if response.status == 503 and b'"busy"' in response.body else "HTTP %d" % response.status)
            except ProbeError as exc:
                outcome = "failed: %s" % exc.message[:80]
            except Exception as exc:  # noqa: BLE001 - counted, never raised in a client thread
                outcome = "failed: %s" % type(exc).__name__
            took = time.perf_counter() - started
            with self._lock:
                self.results.append((time.monotonic(), kind, took, outcome))
                self._inflight -= 1


def mark(client: Any) -> Tuple[float, int, float, float]:
    """(this process's clock, the target's counter, the target's clock), and the longest gap since the last mark."""
    result = client.eval("(counter, time.perf_counter(), reset_gap())", timeout=30.0)
    if not result.ok:
        raise RuntimeError("eval failed: %s" % result.error)
    counter, their_clock, gap = ast.literal_eval(result.value or "")
    return time.monotonic(), int(counter), float(their_clock), float(gap)


def percentile(values: List[float], q: float) -> float:
    data = sorted(values)
    return data[min(len(data) - 1, max(0, int(round(q * (len(data) - 1)))))]


def run(clients: int, rounds: int, window: float) -> None:
    import probe as probe_lib
    from probe.client import transport

    with Target(BUSY) as target:
        client = probe_lib.connect(str(target.pid), timeout=30.0)
        client.query_rows("SELECT 1")  # DuckDB and pyarrow loaded before any window
        address = transport.UnixAddress(target.socket)
        rates: Dict[str, List[float]] = {"quiet": [], "load": []}
        gaps: Dict[str, List[float]] = {"quiet": [], "load": []}
        per_window: List[Dict[str, float]] = []
        in_windows: List[Tuple[float, str, float, str]] = []
        with Load(address, clients) as load:
            load.go.set()  # warm-up: every client thread makes its first requests
            time.sleep(1.0)
            load.pause()
            load.results.clear()
            for i in range(rounds):
                for kind in (("quiet", "load") if i % 2 == 0 else ("load", "quiet")):
                    if kind == "load":
                        load.go.set()
                    start = mark(client)
                    time.sleep(window)
                    end = mark(client)
                    if kind == "load":
                        load.pause()
                    rates[kind].append((end[1] - start[1]) / (end[2] - start[2]))
                    gaps[kind].append(end[3])
                    if kind == "load":
                        done = [r for r in load.results if start[0] <= r[0] <= end[0]]
                        in_windows.extend(done)
                        took = [r[2] for r in done]
                        per_window.append({"rps": len(done) / (end[0] - start[0]), "rate": rates[kind][-1],
                                           "p50": percentile(took, 0.5) if took else float("nan"),
                                           "p99": percentile(took, 0.99) if took else float("nan")})
        every = load.results
    report(clients, rates, gaps, per_window, every, in_windows)


def report(clients: int, rates: Dict[str, List[float]], gaps: Dict[str, List[float]],
           per_window: List[Dict[str, float]], every: List[Tuple[float, str, float, str]],
           results: List[Tuple[float, str, float, str]]) -> None:
    """``every`` request sent (for the tally), ``results``: those completed inside load windows."""
    tally = Counter(r[3] for r in every)
    print("requests: %d in all; %s" % (len(every), ", ".join("%s %d" % item for item in tally.most_common())))
    dropped = sum(n for outcome, n in tally.items() if outcome not in ("answered", "busy"))
    print("not answered (neither 200 nor 503 busy): %d" % dropped)
    print()
    print("--- per load window (%d clients) ---" % clients)
    rows = []
    for name, key, scale in (("requests/s", "rps", 1.0), ("latency p50 ms", "p50", 1000.0),
                             ("latency p99 ms", "p99", 1000.0)):
        s = Summary.of(w[key] * scale for w in per_window)
        rows.append([name, str(s.n), "%.1f" % s.median, "%.1f-%.1f" % (s.q1, s.q3), "%.1f-%.1f" % (s.low, s.high)])
    print(table(rows, ["what", "windows", "median", "IQR", "min-max"]))
    print()
    print("--- latency of every request in load windows, by kind ---")
    rows = []
    for kind in KINDS + ("all",):
        took = [r[2] for r in results if kind in ("all", r[1])]
        if took:
            rows.append([kind, str(len(took)), ms(percentile(took, 0.5)), ms(percentile(took, 0.99)), ms(max(took))])
    print(table(rows, ["request", "n", "p50 ms", "p99 ms", "max ms"]))
    print()
    print("--- the target's main loop, per window (millions of iterations/s; longest pause) ---")
    print(summary_table({"quiet: iterations/s": rates["quiet"], "load: iterations/s": rates["load"]},
                        scale=1e-6, unit="M/s"))
    print(summary_table({"quiet: longest pause": gaps["quiet"], "load: longest pause": gaps["load"]}))
    quiet, loaded = statistics.median(rates["quiet"]), statistics.median(rates["load"])
    print("main loop under load: %.2fx its quiet rate (medians), i.e. %.0f %% slower" %
          (loaded / quiet, (1.0 - loaded / quiet) * 100.0))
    figure("the target's main loop, iterations/s in load windows", rates["load"], peer="in quiet windows",
           peer_values=rates["quiet"], unit="M/s", scale=1e-6)
    figure("the target's main loop, longest pause in load windows", gaps["load"], peer="in quiet windows",
           peer_values=gaps["quiet"])
    figure("requests not answered (neither 200 nor 503 busy)", value=float(dropped), unit="requests", goal="0",
           met=dropped == 0)
    print("each load window, requests/s : main loop M/s: %s" % ", ".join(
        "%.0f : %.1f" % (w["rps"], w["rate"] * 1e-6) for w in sorted(per_window, key=lambda w: w["rps"])))


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=6, help="load windows and quiet windows, each")
    parser.add_argument("--window", type=float, default=2.5, help="seconds per window")
    args = parser.parse_args(argv)
    header("Sustained load: %d concurrent clients on one agent's unix socket; the target's main loop meanwhile"
           % args.clients,
           ["target: tests/targets/busy.py (PROBE=1), main thread counting in a pure-Python loop",
            "requests: health, POST /v1/query SELECT 1, backtrace, in turn, one connection each",
            "%d load and %d quiet windows of %.1f s, interleaved A B B A" % (args.rounds, args.rounds, args.window)])
    started = time.monotonic()
    run(args.clients, args.rounds, args.window)
    print("(run took %.0f s)" % (time.monotonic() - started))


if __name__ == "__main__":
    main()
