"""Soak: minutes of concurrent clients against a target whose threads come and go (run by hand).

The target is ``tests/targets/churn.py`` (threads start and exit all the time, garbage whose
finalisers release the GIL, frequent collections: the conditions of CPython's gh-106883 freeze).
Six client threads (four queries of python.backtrace, backtraces, evals) run for ``--seconds``; every
``--window`` seconds the target reports its loop count, its longest loop pause, the threads it has
started and its RSS. A request that gets
no answer within 10 s counts as a failure: a frozen target shows as failures and a stopped count.

    python bench/bench_soak.py [--seconds 180] [--window 15] [--python PATH]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

import probe  # noqa: E402
from _common import start_run  # noqa: E402

QUERY = "SELECT func, file, lineno, depth FROM python.backtrace ORDER BY depth LIMIT 10"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--window", type=float, default=15.0)
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args()
    start_run("soak: 6 clients for %.0f s against tests/targets/churn.py" % args.seconds)
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
    env.pop("PROBE", None)
    target = subprocess.Popen([args.python, os.path.join(REPO, "tests", "targets", "churn.py"), "--start"],
                              stdout=subprocess.PIPE, env=env)
    try:
        assert target.stdout is not None
        pid = int(target.stdout.readline().split()[1])
        socket = "/proc/%d" % pid
        deadline = time.monotonic() + 20
        client = probe.connect(str(pid), timeout=10.0)
        while True:
            try:
                client.health()
                break
            except probe.ProbeError:
                if time.monotonic() > deadline or not os.path.exists(socket):
                    raise
                time.sleep(0.05)
        return soak(client, pid, args.seconds, args.window)
    finally:
        target.kill()
        target.wait(10)


def soak(client: "probe.Client", pid: int, seconds: float, window: float) -> int:
    counts = {"query": 0, "backtrace": 0, "eval": 0, "busy": 0}
    failures: list = []
    latencies: list = []
    stop_at = time.monotonic() + seconds

    def work(kind: str) -> None:
        while time.monotonic() < stop_at:
            started = time.perf_counter()
            try:
                if kind == "query":
                    client.query_rows(QUERY)
                elif kind == "backtrace":
                    client.backtrace()
                else:
                    client.eval("state['count']")
                counts[kind] += 1
                latencies.append(time.perf_counter() - started)
            except probe.ProbeError as exc:
                if exc.code == "busy":
                    counts["busy"] += 1
                else:
                    failures.append("%s: %s" % (kind, exc))

    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in ("query",) * 4 + ("backtrace", "eval")]
    for thread in threads:
        thread.start()
    print("window  requests  loop-iter/s  longest-pause-ms  threads-started  rss-MB")
    rates, pauses = [], []
    previous = _state(client)
    begun = time.monotonic()
    while time.monotonic() < stop_at:
        time.sleep(min(window, max(stop_at - time.monotonic(), 0.1)))
        now = _state(client)
        done = sum(counts[k] for k in ("query", "backtrace", "eval"))
        rate = (now["count"] - previous["count"]) / max(now["clock"] - previous["clock"], 1e-9)
        rates.append(rate)
        pauses.append(now["max_gap"] * 1000)
        print("%5.0fs  %8d  %11.0f  %16.1f  %15d  %6.0f" % (
            time.monotonic() - begun, done, rate, now["max_gap"] * 1000, now["threads"], now["rss"] / 1e6))
        client.eval("state['max_gap'] = 0.0")
        previous = now
    for thread in threads:
        thread.join(15)
    total = sum(counts[k] for k in ("query", "backtrace", "eval"))
    latencies.sort()
    print("requests answered: %d (%s), busy: %d, failed: %d" % (
        total, ", ".join("%s %d" % (k, counts[k]) for k in ("query", "backtrace", "eval")), counts["busy"],
        len(failures)))
    if latencies:
        print("latency ms: p50 %.1f  p99 %.1f  max %.1f" % (
            latencies[len(latencies) // 2] * 1000, latencies[int(len(latencies) * 0.99)] * 1000, latencies[-1] * 1000))
    print("main loop iter/s per window: median %.0f (min %.0f, max %.0f); longest pause ms: median %.1f, max %.1f"
          % (statistics.median(rates), min(rates), max(rates), statistics.median(pauses), max(pauses)))
    for failure in failures[:5]:
        print("failure:", failure)
    return 1 if failures else 0


def _state(client: "probe.Client") -> dict:
    code = ("import json, time, resource, os\n"
            "json.dumps(dict(state, clock=time.monotonic(), "
            "rss=int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')))")
    return json.loads(client.eval(code).value[1:-1])


if __name__ == "__main__":
    sys.exit(main())
