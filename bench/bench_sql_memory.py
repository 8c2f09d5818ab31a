"""What SQL and the agent cost a target's memory: idle, after queries, and at the peak of hostile queries.

    python bench/bench_sql_memory.py [--runs 5] [--root DIR] [--before COMMIT] [--skip-peaks] [--clients 1,2,4]
                                     [--in-agent] | --latency RUNS | --trace RUNS

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
4 GB in the concurrent cases: run that on a machine that has it. ``--in-agent``: the targets run with
``PROBE_SQL_IN_AGENT=1`` (by default SQL the agent cannot answer in Python runs in the client).

``--latency RUNS``: whole ``probe PID query`` commands (a query answered in Python, a GROUP BY, a join),
SQL run by the client vs in the agent, interleaved. ``--trace RUNS``: the page's and diagnose's queries over
a training job's trace, through one client, each way, and whole ``probe PID diagnose`` commands.
"""

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Dict, List

from _common import start_run

HERE = os.path.dirname(os.path.abspath(__file__))
HOSTILE = "SELECT repeat('x', 100000000) AS s FROM range(30)"


def status(pid: int) -> Dict[str, float]:
    out = {}
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) / 1024.0
    return out


class Target:
    def __init__(self, root: str, **env: str) -> None:
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PROBE")
                    or k in ("PROBE_RUNTIME_DIR", "PROBE_SQL_IN_AGENT")}
        self.env.update(PYTHONPATH=root, PYTHONUNBUFFERED="1", PROBE="1", PROBE_SQL_QUIET="2")
        self.env.update(env)
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


LATENCY_SQL = {
    "simple (answered in Python)": "SELECT func, file, lineno FROM python.backtrace ORDER BY depth LIMIT 10",
    "GROUP BY": "SELECT thread_name, count(*) AS n FROM python.threads GROUP BY thread_name",
    "join": "SELECT t.thread_name, b.func FROM python.threads t JOIN python.backtrace b USING (thread_id) "
            "WHERE b.depth = 0",
}


def timed(target: "Target", sql: str) -> float:
    started = time.perf_counter()
    code = target.cli("query", sql, "-f", "json")
    elapsed = time.perf_counter() - started
    assert code == 0, sql
    return elapsed


def latency(root: str, runs: int) -> None:
    """Whole ``probe PID query`` commands, SQL run by the client (the default) and in the agent
    (``PROBE_SQL_IN_AGENT=1``), interleaved; the agent's first query (DuckDB loads) apart."""
    targets = {"client": Target(root), "agent": Target(root, PROBE_SQL_IN_AGENT="1", PROBE_SQL_QUIET="0")}
    try:
        first = {name: timed(t, LATENCY_SQL["GROUP BY"]) for name, t in targets.items()}
        times: Dict[str, Dict[str, List[float]]] = {sql: {"client": [], "agent": []} for sql in LATENCY_SQL}
        for i in range(runs):
            for label, sql in LATENCY_SQL.items():
                for name in (("client", "agent") if i % 2 == 0 else ("agent", "client")):
                    times[label][name].append(timed(targets[name], sql))
        rss = {name: status(t.pid) for name, t in targets.items()}
    finally:
        for target in targets.values():
            target.close()
    print("whole `probe PID query ... -f json` commands, %d runs interleaved; ms, median (min-max)" % runs)
    print("  %-28s %-24s %-24s %s" % ("query", "SQL run by the client", "in the agent (opt-in)", "client/agent"))
    for label in LATENCY_SQL:
        c, a = times[label]["client"], times[label]["agent"]
        print("  %-28s %-24s %-24s %.2fx" % (label, summary([x * 1000 for x in c]), summary([x * 1000 for x in a]),
                                             statistics.median(c) / statistics.median(a)))
    print("  first GROUP BY of a fresh target: client %.0f ms, agent %.0f ms (DuckDB and pyarrow load there)"
          % (first["client"] * 1000, first["agent"] * 1000))
    print("  the targets' VmRSS afterwards: client-run %.1f MB, agent-run %.1f MB"
          % (rss["client"]["VmRSS"], rss["agent"]["VmRSS"]))


def trace_latency(root: str, runs: int) -> None:
    """The page's and diagnose's queries over a training job's trace (tests/targets/train_trace.py,
    PROBE_TORCH_TRACE=1: 10,000 spans once warm), asked through one client as the page asks them, run
    by the client vs in the agent, interleaved; and a whole ``probe PID diagnose`` each way."""
    sys.path.insert(0, root)
    import probe as probe_lib
    from probe.diagnose.evidence import TRACE_SQL as DIAGNOSE_TRACE
    from probe.page.data import COUNTER_SQL, TRACE_SQL

    queries = {"page: trace by step": TRACE_SQL.format(n=30), "page: step counter": COUNTER_SQL,
               "diagnose: trace": DIAGNOSE_TRACE}

    def start(**env: str) -> Target:
        target = Target.__new__(Target)
        target.env = {k: v for k, v in os.environ.items() if not k.startswith("PROBE") or k == "PROBE_RUNTIME_DIR"}
        target.env.update(PYTHONPATH=root, PYTHONUNBUFFERED="1", PROBE="1", PROBE_TORCH_TRACE="1", **env)
        target.root = root
        target.popen = subprocess.Popen([sys.executable, os.path.join(root, "tests", "targets", "train_trace.py"),
                                         "normal"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=target.env)
        line = target.popen.stdout.readline().decode()
        assert line.startswith("READY"), line
        target.pid = target.popen.pid
        target.cli("health")
        return target

    targets = {"client": start(PROBE_SQL_IN_AGENT=""), "agent": start(PROBE_SQL_IN_AGENT="1")}
    try:
        time.sleep(8)  # the trace's ring fills (10,000 spans)
        clients = {name: probe_lib.connect(str(t.pid)) for name, t in targets.items()}
        for client in clients.values():
            for sql in queries.values():
                client.query_rows(sql)  # warm: modules loaded on each side
        times: Dict[str, Dict[str, List[float]]] = {label: {"client": [], "agent": []} for label in queries}
        times["whole `probe PID diagnose`"] = {"client": [], "agent": []}
        for i in range(runs):
            for name in (("client", "agent") if i % 2 == 0 else ("agent", "client")):
                for label, sql in queries.items():
                    started = time.perf_counter()
                    clients[name].query_rows(sql)
                    times[label][name].append(time.perf_counter() - started)
                if i < 3:
                    started = time.perf_counter()
                    targets[name].cli("diagnose")
                    times["whole `probe PID diagnose`"][name].append(time.perf_counter() - started)
        spans = clients["agent"].query_rows("SELECT count(*) FROM python.torch_trace").rows[0][0]
    finally:
        for target in targets.values():
            target.close()
    print("a training job's trace (%d spans), one client, %d runs interleaved; ms, median (min-max)" % (spans, runs))
    print("  %-28s %-24s %-24s %s" % ("query", "SQL run by the client", "in the agent (opt-in)", "client/agent"))
    for label, both in times.items():
        c, a = both["client"], both["agent"]
        print("  %-28s %-24s %-24s %.2fx" % (label, summary([x * 1000 for x in c]), summary([x * 1000 for x in a]),
                                             statistics.median(c) / statistics.median(a)))


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
    parser.add_argument("--latency", type=int, default=0, metavar="RUNS",
                        help="only time whole query commands, client-run vs agent-run, RUNS rounds")
    parser.add_argument("--trace", type=int, default=0, metavar="RUNS",
                        help="only time the page's and diagnose's trace queries on a training job, RUNS rounds")
    parser.add_argument("--in-agent", action="store_true", help="PROBE_SQL_IN_AGENT=1 in the memory runs")
    args = parser.parse_args()
    start_run("where SQL runs: agent memory and query latency, client-run vs agent-run")
    if args.latency:
        latency(args.root, args.latency)
        return
    if args.trace:
        trace_latency(args.root, args.trace)
        return
    if args.in_agent:
        os.environ["PROBE_SQL_IN_AGENT"] = "1"
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
            print("  %-26s VmRSS %s   RssAnon %s   RssFile %s   RssShmem %s" % (
                label, *(summary([r[label][k] for r in runs[name]]) for k in ("VmRSS", "RssAnon", "RssFile", "RssShmem"))))
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
