"""One query fanned out to 16, 64, 256 and 1024 agents on this machine: time to the merged result
(``probe.connect_all([...]).query(SQL)``, one pyarrow table with rank and host), median and spread;
the same with 10 % of the agents not answering (listening sockets that never answer): the answer must
come at the deadline, not later. The cost on a rank of being probed (its training loop's longest pause,
its memory) is measured on a real torchrun job by ``bench_rank_cost.py``.

    python bench/bench_fanout.py [--runs 9] [--per-process 32] [--deadline 1.5]

Agents: 32 processes hosting 32 agents each (see bench/targets/many_agents.py), so that 1024 fit in
memory; a size of n uses n agents spread evenly over the processes.
"""

import argparse
import os
import socket
import sys
import time

from _common import REPO, Summary, clean_env, header, table, verdict

sys.path.insert(0, REPO)

from probe.client.cluster import Cluster, Member  # noqa: E402

SQL = "SELECT count(*) AS threads FROM python.threads"
TOKEN = "bench-fanout-token"


def start_hosts(processes: int, per_process: int):
    import subprocess

    env = clean_env(probe=True)
    env.update(PROBE_LISTEN="127.0.0.1:0", PROBE_TOKEN=TOKEN, PYTHONPATH=REPO)
    hosts = []
    for _ in range(processes):
        hosts.append(subprocess.Popen([sys.executable, os.path.join(REPO, "bench", "targets", "many_agents.py"),
                                       str(per_process)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True))
    ports = []
    for popen in hosts:
        line = popen.stdout.readline().split()
        if not line or line[0] != "READY":
            raise SystemExit("an agent host did not start")
        ports.append([int(p) for p in line[2:]])
    return hosts, ports


def spread(ports, n):
    """n agents, taken round-robin over the processes."""
    out = []
    i = 0
    while len(out) < n:
        for host_ports in ports:
            if i < len(host_ports) and len(out) < n:
                out.append(host_ports[i])
        i += 1
    return out


def cluster_of(ports, deadline, silent=()):
    members = [Member(i, "127.0.0.1", "127.0.0.1:%d" % p) for i, p in enumerate(list(ports) + list(silent))]
    return Cluster(members, TOKEN, timeout=deadline, deadline=deadline, max_in_flight=256)


def timed(cluster, health=False):
    start, cpu = time.perf_counter(), time.process_time()
    if health:
        got = len(cluster.map(lambda c: c.health(fallback=False)))
    else:
        got = cluster.query(SQL).num_rows
    return time.perf_counter() - start, got, len(cluster.failures), time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--per-process", type=int, default=32)
    parser.add_argument("--deadline", type=float, default=1.5)
    args = parser.parse_args()
    sizes = [16, 64, 256, 1024]
    header("fan-out: one query to many agents, time to the merged pyarrow table", [
        "query: %s; agents hosted %d per process; max in flight 256" % (SQL, args.per_process)])
    hosts, ports = start_hosts(1024 // args.per_process, args.per_process)
    silent_socks = []
    try:
        cluster_of(spread(ports, 1024), 30.0).query(SQL)  # warm: every process loads DuckDB once
        rows = []
        full = {}
        for what in ("query", "health"):
            for n in sizes:
                times, cpus = [], []
                for _ in range(args.runs):
                    seconds, got, failed, cpu = timed(cluster_of(spread(ports, n), 20.0), what == "health")
                    assert got == n and failed == 0, (n, got, failed)
                    times.append(seconds)
                    cpus.append(cpu)
                s = Summary.of(times)
                if what == "query":
                    full[n] = s.median
                goal = {256: 1.0, 1024: 2.0}.get(n) if what == "query" else None
                rows.append([what, str(n), "%.3f" % s.median, "%.3f-%.3f" % (s.q1, s.q3),
                             "%.3f-%.3f" % (s.low, s.high), "%.2f" % (s.median * 1000 / n),
                             "%.3f" % Summary.of(cpus).median,
                             "<= %.0f s: %s" % (goal, verdict(s.median <= goal)) if goal else ""])
        print(table(rows, ["request", "agents", "median s", "IQR s", "min-max s", "ms/agent", "client CPU s",
                           "target"]))
        print()
        rows = []
        for n in sizes:
            k = max(1, n // 10)
            for _ in range(k):
                sock = socket.socket()
                sock.bind(("127.0.0.1", 0))
                sock.listen(4096)  # accepts in the kernel, never answers
                silent_socks.append(sock)
            silent = [s.getsockname()[1] for s in silent_socks[-k:]]
            times = []
            deadline = max(args.deadline, 2 * full[n] + 0.5)  # time enough for every answering agent here
            for _ in range(max(3, args.runs // 3)):
                seconds, got, failed, _cpu = timed(cluster_of(spread(ports, n - k), deadline, silent))
                assert got == n - k and failed == k, (n, got, failed)
                times.append(seconds)
            s = Summary.of(times)
            rows.append([str(n), str(k), "%.2f" % deadline, "%.3f" % s.median, "%.3f-%.3f" % (s.low, s.high),
                         "+%.0f ms" % ((s.high - deadline) * 1000)])
        print(table(rows, ["agents", "silent", "deadline s", "median s", "min-max s", "worst past deadline"]))
    finally:
        for sock in silent_socks:
            sock.close()
        for popen in hosts:
            popen.kill()
            popen.wait(10)


if __name__ == "__main__":
    main()
