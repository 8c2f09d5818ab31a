"""What SQL and the agent cost a target's memory: idle, after queries, and at the peak of hostile queries.

    python bench/bench_sql_memory.py [--runs 5] [--root DIR] [--before COMMIT] [--skip-peaks] [--clients 1,2,4]

Each run starts tests/targets/idle.py (``PROBE=1``, ``PROBE_SQL_QUIET=2``) from ``--root`` (default: this
checkout; another checkout measures an older probe), reads VmRSS, RssAnon (private) and RssFile (shared
library pages) from /proc/PID/status when ready, after a first query of the simplest shape (one table,
columns, ORDER BY, LIMIT: answered without DuckDB and pyarrow since issue 24), after a query DuckDB runs
(GROUP BY: DuckDB and pyarrow load), after a 1e6-row query, after a snippet that prints 100 MB, and 3 s
after the last query (past PROBE_SQL_QUIET, DuckDB's database is closed and its memory handed back).
``--before COMMIT`` measures that commit's tree (``git archive``, in a temporary directory) in the same
run, interleaved with this one (A B B A), and prints both. Then, with ``PROBE_EVAL=0``, the peak RSS
(VmHWM, reset through /proc/PID/clear_refs) that ``SELECT repeat('x', 100000000) AS s FROM range(30)``
adds, alone and 2 and 4 at once. Medians and min-max over runs, in MB. An old probe takes the target past
4 GB in the concurrent cases: run that on a machine that has it.
"""

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
HOSTILE = "SELECT repeat('x', 100000000) AS s FROM range(30)"


def status(pid: int) -> Dict[str, float]:
    out = {}
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) / 1024.0
    return out


class Target:
    def __init__(self, root: str, **env: str) -> None:
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PROBE") or k == "PROBE_RUNTIME_DIR"}
        self.env.update(PYTHONPATH=root, PYTHONUNBUFFERED="1", PROBE="1", PROBE_SQL_QUIET="2", **env)
        self.root = root
        self.popen = subprocess.Popen([sys.executable, os.path.join(root, "tests", "targets", "idle.py")],
                                      stdout=subprocess.PIPE, env=self.env)
        line = self.popen.stdout.readline().decode()
        assert line.startswith("READY"), line
        self.pid = self.popen.pid
        self.cli("health")  # the agent's socket is there

    def cli(self, *args: str) -> int:
        env = dict(self.env)
        env.pop("PROBE", None)
        for _ in range(100):
            done = subprocess.run([sys.executable, "-m", "probe", str(self.pid), *args], env=env, cwd=self.root,
                                  capture_output=True, timeout=300)
            if done.returncode == 0 or args[0] != "health":
                return done.returncode
            time.sleep(0.1)
        return done.returncode

    def close(self) -> None:
        self.popen.kill()
        self.popen.wait()


def idle_costs(root: str) -> Dict[str, Dict[str, float]]:
    target = Target(root)
    try:
        out = {"ready": status(target.pid)}
        steps = [("after a first query", ("query", "SELECT func FROM python.backtrace LIMIT 5", "-f", "json")),
                 ("after a DuckDB query", ("query", "SELECT is_main, count(*) AS n FROM python.threads GROUP BY ALL",
                                           "-f", "json")),
                 ("after a 1e6-row query", ("query", "SELECT i, i * 2 AS j FROM range(1000000) t(i)", "-f", "json",
                                            "--max-rows", "1000000")),
                 ("after a 100 MB print", ("eval", "print('x' * 100_000_000)"))]
        for label, args in steps:
            target.cli(*args)
            time.sleep(1.0)
            out[label] = status(target.pid)
        time.sleep(2.0)
        out["3 s after the last query"] = status(target.pid)
        return out
    finally:
        target.close()


def peak(root: str, clients: int) -> float:
    target = Target(root, PROBE_EVAL="0")
    try:
        target.cli("query", "SELECT 1", "-f", "json")
        with open("/proc/%d/clear_refs" % target.pid, "w") as f:
            f.write("5")
        start = status(target.pid)["VmRSS"]
        threads = [threading.Thread(target=target.cli, args=("query", HOSTILE, "-f", "json")) for _ in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        alive = target.popen.poll() is None
        return status(target.pid)["VmHWM"] - start if alive else float("inf")
    finally:
        target.close()


def summary(values: List[float]) -> str:
    return "%7.1f  (%.1f-%.1f)" % (statistics.median(values), min(values), max(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--root", default=os.path.dirname(HERE))
    parser.add_argument("--before", help="a commit whose tree is measured too, interleaved")
    parser.add_argument("--skip-peaks", action="store_true")
    parser.add_argument("--clients", default="1,2,4", help="how many hostile queries at once, per case")
    args = parser.parse_args()
    roots = [("this tree", args.root)]
    scratch = None
    if args.before:
        import tempfile

        scratch = tempfile.mkdtemp(prefix="probe-before-")
        archive = subprocess.run(["git", "-C", args.root, "archive", args.before], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", scratch], input=archive.stdout, check=True)
        roots.append(("at %s" % args.before, scratch))
    print("%d runs; the target's MB, median (min-max)" % args.runs)
    runs: Dict[str, List[Dict[str, Dict[str, float]]]] = {name: [] for name, _ in roots}
    for i in range(args.runs):
        for name, root in (roots if i % 2 == 0 else roots[::-1]):
            runs[name].append(idle_costs(root))
    for name, root in roots:
        print("probe %s (%s)" % (name, root))
        for label in runs[name][0]:
            print("  %-26s VmRSS %s   RssAnon %s   RssFile %s" % (label, *(summary([r[label][k] for r in runs[name]])
                                                                   for k in ("VmRSS", "RssAnon", "RssFile"))))
    for name, _ in roots:
        ready = statistics.median([r["ready"]["VmRSS"] for r in runs[name]])
        print("probe %s: VmRSS over ready, medians: %s" % (name, ", ".join(
            "%s +%.1f" % (label, statistics.median([r[label]["VmRSS"] for r in runs[name]]) - ready)
            for label in runs[name][0] if label != "ready")))
    if scratch:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    if not args.skip_peaks:
        for clients in [int(n) for n in args.clients.split(",")]:
            print("peak growth, %d x hostile query: %s" % (clients, summary([peak(args.root, clients)
                                                                            for _ in range(args.runs)])))


if __name__ == "__main__":
    main()
