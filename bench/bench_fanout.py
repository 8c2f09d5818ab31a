"""One query fanned out to 16, 64, 256 and 1024 agents on this machine: time to the merged result
(``probe.connect_all([...]).query(SQL)``, one pyarrow table with rank and host), median and spread;
the same with 10 % of the agents not answering (listening sockets that never answer): the answer must
come at the deadline, not later. The cost on a rank of being probed (its training loop's longest pause,
its memory) is measured on a real torchrun job by ``bench_rank_cost.py``.

    python bench/bench_fanout.py [--runs 9] [--per-process 32] [--main loop|idle] [--deadline 1.5]
                                 [--sizes 16,64,256,1024] [--before DIR]

Agents: 32 processes hosting 32 agents each (see bench/targets/many_agents.py), so that 1024 fit in
memory; a size of n uses n agents spread evenly over the processes. "agent CPU ms/query" is the CPU
(user + system) the hosting processes used during the fan-out, per agent asked; it includes their
main loops' (bench/targets/many_agents.py), about 15 ms a second per process.

``--main idle`` leaves the hosts' main threads waiting (a rank blocked in a collective, the usual case
when one asks every rank where it is) instead of running the 1 kHz loop; with ``--per-process 8`` that
is 128 host processes for 1024 agents (~7 GB here).

``--before DIR`` (a tree of an earlier commit: ``git archive REV | tar -x -C DIR``) starts as many
processes again running that tree's probe (the same host script), and times the two trees in turn,
run by run, so that both see the same machine.
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


def start_hosts(processes: int, per_process: int, tree: str = REPO, main: str = "loop"):
    import subprocess

    env = clean_env(probe=True)
    env.update(PROBE_LISTEN="127.0.0.1:0", PROBE_TOKEN=TOKEN, PYTHONPATH=tree, BENCH_MAIN=main)
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


def hosts_cpu(hosts) -> float:
    """CPU seconds (user + system) the agent hosts have used so far."""
    total = 0
    for popen in hosts:
        with open("/proc/%d/stat" % popen.pid) as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--per-process", type=int, default=32)
    parser.add_argument("--main", choices=("loop", "idle"), default="loop",
                        help="the hosts' main threads: a 1 kHz loop (busy) or waiting (idle)")
    parser.add_argument("--deadline", type=float, default=1.5)
    parser.add_argument("--sizes", default="16,64,256,1024")
    parser.add_argument("--before", default="", help="a tree of an earlier commit, timed beside this one")
    args = parser.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]
    header("fan-out: one query to many agents, time to the merged pyarrow table", [
        "query: %s; agents hosted %d per process; max in flight 256" % (SQL, args.per_process)])
    processes = -(-max(sizes) // args.per_process)
    trees = [("this tree", REPO)] + ([("before", os.path.abspath(args.before))] if args.before else [])
    fleets = {}
    silent_socks = []
    try:
        for name, tree in trees:
            fleets[name] = start_hosts(processes, args.per_process, tree, args.main)
        for name, _ in trees:  # warm: every process loads DuckDB once
            cluster_of(spread(fleets[name][1], max(sizes)), 30.0).query(SQL)
        ports = fleets["this tree"][1]
        rows = []
        full = {}
        for what in ("query", "health"):
            for n in sizes:
                times: dict = {name: [] for name, _ in trees}
                cpus: dict = {name: [] for name, _ in trees}
                agent_cpu: dict = {name: [] for name, _ in trees}
                for _ in range(args.runs):
                    for name, _ in trees:  # the trees in turn, run by run
                        hosts_now = fleets[name][0]
                        before_cpu = hosts_cpu(hosts_now)
                        seconds, got, failed, cpu = timed(cluster_of(spread(fleets[name][1], n), 20.0),
                                                          what == "health")
                        assert got == n and failed == 0, (name, n, got, failed)
                        times[name].append(seconds)
                        cpus[name].append(cpu)
                        agent_cpu[name].append((hosts_cpu(hosts_now) - before_cpu) * 1000 / n)
                for name, _ in trees:
                    s = Summary.of(times[name])
                    if what == "query" and name == "this tree":
                        full[n] = s.median
                    goal = {256: 1.0, 1024: 2.0}.get(n) if what == "query" else None
                    rows.append([what, name, str(n), "%.3f" % s.median, "%.3f-%.3f" % (s.q1, s.q3),
                                 "%.3f-%.3f" % (s.low, s.high), "%.2f" % (s.median * 1000 / n),
                                 "%.2f" % Summary.of(agent_cpu[name]).median, "%.3f" % Summary.of(cpus[name]).median,
                                 "<= %.0f s: %s" % (goal, verdict(s.median <= goal)) if goal else ""])
        print(table(rows, ["request", "tree", "agents", "median s", "IQR s", "min-max s", "ms/agent",
                           "agent CPU ms/query", "client CPU s", "target"]))
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
        for hosts, _ in fleets.values():
            for popen in hosts:
                popen.kill()
            for popen in hosts:
                popen.wait(10)


if __name__ == "__main__":
    main()
