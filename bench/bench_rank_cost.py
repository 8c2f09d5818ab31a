"""The cost on a rank of being discovered and probed across ranks: a real 2-rank torchrun job (gloo, on
the CPU) whose ranks train a small MLP (``bench/targets/train_rank.py``), probed every second through
the master's host helper as ``probe MASTER --all-ranks query`` and ``--all-ranks backtrace`` do
(discovery, then every rank's agent), in windows that alternate with unprobed ones (A B B A ...).

    python bench/bench_rank_cost.py [--rounds 6] [--window 6] [--width 256]

Per window, from the ranks' own once-a-second ``STAT`` lines (never by asking them): the longest step
of either rank (a pause on one rank shows on both, through the all_reduce), the median step, and each
rank's VmRSS; also VmRSS of the same job without probe, and with an agent that was never asked.
The client runs in this process (the library calls the CLI makes, without its start-up), on the
same 2 CPUs as the job: on a real job it runs elsewhere, so the figure is pessimistic.
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

from _common import REPO, TARGETS, Summary, clean_env, figure, header, table, tool

from probe.client.cluster import connect_all  # noqa: E402

SQL = "SELECT count(*) AS threads FROM python.threads"


def free_ports(count: int) -> int:
    """A port p such that p - 1 .. p + count - 1 were free a moment ago (the helper takes p - 1)."""
    for _ in range(100):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            base = sock.getsockname()[1]
        socks = []
        try:
            for port in range(base - 1, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise SystemExit("no run of free ports")


class Job:
    """``torchrun train_rank.py``; its STAT lines collected by a reader thread. Killed (the whole process
    group) and reaped on exit."""

    def __init__(self, nproc: int, width: int, probe_port: Optional[int]) -> None:
        env = clean_env(probe=False)
        env["PYTHONPATH"] = REPO
        env["PYTHONUNBUFFERED"] = "1"
        if probe_port is not None:
            env["PROBE_PORT"] = str(probe_port)
        self.popen = subprocess.Popen([tool("torchrun"), "--nproc-per-node=%d" % nproc,
                                       "--master-port=%d" % free_ports(1), os.path.join(TARGETS, "train_rank.py"),
                                       "--width", str(width)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        self.stats: List[Tuple[int, float, int, float, float, int]] = []  # rank, wall, steps, max, median, rss
        self.ready: Dict[int, int] = {}
        self._ready = threading.Event()
        self._nproc = nproc
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            words = line.split()
            if words[:1] == ["READY"]:
                self.ready[int(words[2])] = int(words[1])
                if len(self.ready) == self._nproc:
                    self._ready.set()
            elif words[:1] == ["STAT"]:
                self.stats.append((int(words[1]), float(words[2]), int(words[3]), float(words[4]), float(words[5]),
                                   int(words[6])))

    def wait_ready(self, timeout: float) -> None:
        if not self._ready.wait(timeout):
            raise SystemExit("the job's ranks did not print READY within %.0f s" % timeout)

    def wait_stats(self, after: float, timeout: float) -> None:
        """Until every rank has reported a second that ended after ``after`` (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(any(s[0] == r and s[1] > after for s in self.stats) for r in self.ready):
                return
            time.sleep(0.05)
        raise SystemExit("the ranks stopped reporting (no STAT line within %.0f s)" % timeout)

    def rss(self, rank: int) -> int:
        return [s[5] for s in self.stats if s[0] == rank][-1]

    def close(self) -> None:
        """The ranks first (torchrun starts each in its own session: killing the launcher's group would leave
        them running), while the launcher, their parent, keeps their pids from being reused; then it."""
        from probe.reader.proc import children

        for pid in children(self.popen.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait(20)
        self._reader.join(10)  # the pipe ends with the process group
        if self.popen.stdout is not None:
            self.popen.stdout.close()


def probe_once(master: str) -> Tuple[float, int]:
    """What ``--all-ranks query`` and ``--all-ranks backtrace`` do, once each: seconds and failures."""
    start = time.perf_counter()
    failed = 0
    for work in ("query", "backtrace"):
        cluster = connect_all(master, deadline=5.0, timeout=5.0)  # discovery through the host helper, each time
        if work == "query":
            cluster.query_rows(SQL)
        else:
            cluster.backtraces()
        failed += len(cluster.failures)
    return time.perf_counter() - start, failed


def window(job: Job, master: str, seconds: float, probed: bool, calls: List[float]) -> Dict[str, float]:
    start = time.time()
    failures = 0
    while time.time() < start + seconds:
        tick = time.time()
        if probed:
            took, failed = probe_once(master)
            calls.append(took)
            failures += failed
        time.sleep(max(0.0, tick + 1.0 - time.time()))
    end = time.time()
    job.wait_stats(end, 10.0)
    inside = [s for s in job.stats if start + 1.0 < s[1] <= end + 0.05]  # the first second is the change-over
    return {"max_step": max(s[3] for s in inside), "median_step": Summary.of([s[4] for s in inside]).median,
            "steps_per_s": sum(s[2] for s in inside) / len({s[0] for s in inside}) / max(1.0, end - start - 1.0),
            "rss": max(s[5] for s in inside), "failures": failures}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--window", type=float, default=6.0)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    header("cost on a rank of being discovered and probed across ranks", [
        "torchrun --nproc-per-node %d train_rank.py --width %d (gloo, CPU); probed: every second, discovery + "
        "--all-ranks query (%s) + discovery + --all-ranks backtrace; windows of %.0f s, %d rounds A B B A"
        % (args.nproc, args.width, SQL, args.window, args.rounds)])

    bare = Job(args.nproc, args.width, None)  # the same job without probe: its memory
    try:
        bare.wait_ready(120)
        bare.wait_stats(time.time() + 6.0, 20)
        rss_bare = [bare.rss(r) for r in sorted(bare.ready)]
        bare_steps = [s for s in bare.stats if s[1] > bare.stats[0][1] + 1.0]
    finally:
        bare.close()

    port = free_ports(args.nproc)
    job = Job(args.nproc, args.width, port)
    master = "127.0.0.1:%d" % port
    try:
        job.wait_ready(120)
        job.wait_stats(time.time() + 3.0, 20)
        rss_unasked = [job.rss(r) for r in sorted(job.ready)]
        warm: List[float] = []
        window(job, master, 3.0, True, warm)  # the first probe loads DuckDB in every rank
        rss_after_first = [job.rss(r) for r in sorted(job.ready)]
        results: Dict[str, List[Dict[str, float]]] = {"unprobed": [], "probed": []}
        calls: List[float] = []
        for i in range(args.rounds):
            order = ["unprobed", "probed"] if i % 2 == 0 else ["probed", "unprobed"]
            for name in order:
                results[name].append(window(job, master, args.window, name == "probed", calls))
        rss_end = [job.rss(r) for r in sorted(job.ready)]
    finally:
        job.close()

    rows = []
    for name, windows in results.items():
        row = [name, str(len(windows))]
        for key, scale in (("max_step", 1000.0), ("median_step", 1000.0), ("steps_per_s", 1.0)):
            s = Summary.of([w[key] * scale for w in windows])
            row += ["%.1f" % s.median, "%.1f-%.1f" % (s.low, s.high)]
        row.append(str(int(sum(w["failures"] for w in windows))))
        rows.append(row)
    print(table(rows, ["windows", "n", "longest step ms", "min-max", "median step ms", "min-max", "steps/s",
                       "min-max", "rank failures"]))
    for key, what in (("max_step", "longest step"), ("median_step", "median step")):
        figure("%s in windows probed every second" % what, [w[key] for w in results["probed"]],
               peer="in unprobed windows", peer_values=[w[key] for w in results["unprobed"]])
    print()
    c = Summary.of(calls)
    print("one probe (discovery + query + discovery + backtrace, both ranks): median %.0f ms, min-max %.0f-%.0f ms, "
          "n %d" % (c.median * 1000, c.low * 1000, c.high * 1000, c.n))
    print("no-probe job, longest step over %d rank-seconds: %.1f ms (median step %.1f ms)" % (
        len(bare_steps), max(s[3] for s in bare_steps) * 1000, Summary.of([s[4] for s in bare_steps]).median * 1000))
    print()
    mb = lambda kb: "%.1f" % (kb / 1024.0)  # noqa: E731
    print(table([["rank %d" % r, mb(rss_bare[r]), mb(rss_unasked[r]), mb(rss_after_first[r]), mb(rss_end[r]),
                  "%+.1f" % ((rss_unasked[r] - rss_bare[r]) / 1024.0),
                  "%+.1f" % ((rss_after_first[r] - rss_unasked[r]) / 1024.0),
                  "%+.1f" % ((rss_end[r] - rss_after_first[r]) / 1024.0)] for r in range(len(rss_bare))],
                ["VmRSS MB", "no probe", "agent, never asked", "after 1st probe", "at the end", "agent",
                 "1st probe", "%d probes later" % len(calls)]))


if __name__ == "__main__":
    sys.exit(main())
