"""One query fanned out to 16, 64, 256 and 1024 agents on this machine: time to the merged result
(``probe.connect_all([...]).query(SQL)``, one pyarrow table with rank and host), median and spread;
the same with 10 % of the agents not answering (listening sockets that never answer): the answer must
come at the deadline, not later. The cost on a rank of being probed (its training loop's longest pause,
its memory) is measured on a real torchrun job by ``bench_rank_cost.py``.

    python bench/bench_fanout.py [--runs 9] [--per-process 8] [--main loop|idle] [--deadline 1.5]
                                 [--sizes 16,64,256,1024] [--max-in-flight N] [--before DIR]

Agents: a fleet of real processes forked from one that loaded probe, DuckDB and pyarrow (see
bench/targets/agent_fleet.py), each hosting ``--per-process`` agents (one engine, one GIL), so that
1024 fit in memory: ~22 MB a process once its engine is up; ``--per-process 1`` fits up to ~600 agents
here. A size of n uses n agents spread evenly over the processes. "agent CPU ms/query" is the CPU
(user + system) the fleet used during the fan-out, per agent asked; it includes their main loops'
(1 kHz unless ``--main idle``: then the main threads wait, as a rank blocked in a collective does).

``--max-in-flight`` is the client's bound on young requests (default: the client's own, see
probe/client/fanout.py); ``--in-flight-sweep 8,32,256`` times one size at several bounds, in turn.

``--before DIR`` (a tree of an earlier commit: ``git archive REV | tar -x -C DIR``) starts as many
processes again running that tree's probe (this tree's fleet script), and times the two trees in turn,
run by run, so that both see the same machine.
"""

import argparse
import os
import socket
import sys
import time

from _common import REPO, Summary, clean_env, header, table, verdict

sys.path.insert(0, REPO)

from probe.client.cluster import DEFAULT_IN_FLIGHT, Cluster, Member  # noqa: E402

SQL = "SELECT count(*) AS threads FROM python.threads"
TOKEN = "bench-fanout-token"


def start_hosts(processes: int, per_process: int, tree: str = REPO, main: str = "loop"):
    """The fleet's processes (pids, for their CPU) and each one's agent ports; the fleet's Popen first."""
    import subprocess

    env = clean_env(probe=False)  # each child starts its agent itself, after the fork
    env.update(PROBE_LISTEN="127.0.0.1:0", PROBE_TOKEN=TOKEN, PYTHONPATH=tree, BENCH_MAIN=main)
    fleet = subprocess.Popen([sys.executable, os.path.join(REPO, "bench", "targets", "agent_fleet.py"),
                              str(processes), str(per_process)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    pids, ports = [], []
    for line in fleet.stdout:
        words = line.split()
        if words and words[0] == "AGENT":
            pids.append(int(words[1]))
            ports.append([int(p) for p in words[2:]])
        elif words and words[0] == "READY":
            break
    if len(pids) != processes:
        fleet.kill()
        fleet.wait(10)
        raise SystemExit("the agent fleet started %d processes of %d" % (len(pids), processes))
    return (fleet, pids), ports


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


def cluster_of(ports, deadline, silent=(), in_flight=DEFAULT_IN_FLIGHT):
    """The agents on ``ports`` as ranks, with the ``silent`` ones spread evenly among them (not last:
    the answering ranks must not wait behind them)."""
    order = list(ports)
    step = max(1, len(order) // max(1, len(silent)))
    for k, port in enumerate(silent):
        order.insert(min(len(order), k * (step + 1)), port)
    members = [Member(i, "127.0.0.1", "127.0.0.1:%d" % p) for i, p in enumerate(order)]
    return Cluster(members, TOKEN, timeout=deadline, deadline=deadline, max_in_flight=in_flight)


def timed(cluster, health=False):
    start, cpu = time.perf_counter(), time.process_time()
    if health:
        got = len(cluster.map(lambda c: c.health(fallback=False)))
    else:
        got = cluster.query(SQL).num_rows
    return time.perf_counter() - start, got, len(cluster.failures), time.process_time() - cpu


def hosts_cpu(hosts) -> float:
    """CPU seconds (user + system) the fleet's processes have used so far."""
    total = 0
    for pid in hosts[1]:
        with open("/proc/%d/stat" % pid) as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def sweep(fleet, ports, n: int, bounds, runs: int) -> None:
    """One size at several in-flight bounds, the bounds in turn run by run."""
    times: dict = {b: [] for b in bounds}
    agent_cpu: dict = {b: [] for b in bounds}
    client_cpu: dict = {b: [] for b in bounds}
    for _ in range(runs):
        for bound in bounds:
            before_cpu = hosts_cpu(fleet)
            seconds, got, failed, cpu = timed(cluster_of(spread(ports, n), 20.0, in_flight=bound))
            assert got == n and failed == 0, (bound, n, got, failed)
            times[bound].append(seconds)
            client_cpu[bound].append(cpu)
            agent_cpu[bound].append((hosts_cpu(fleet) - before_cpu) * 1000 / n)
    rows = []
    for bound in bounds:
        s = Summary.of(times[bound])
        rows.append([str(n), str(bound), "%.3f" % s.median, "%.3f-%.3f" % (s.q1, s.q3), "%.3f-%.3f" % (s.low, s.high),
                     "%.2f" % Summary.of(agent_cpu[bound]).median, "%.3f" % Summary.of(client_cpu[bound]).median])
    print(table(rows, ["agents", "max in flight", "median s", "IQR s", "min-max s", "agent CPU ms/query",
                       "client CPU s"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--per-process", type=int, default=8)
    parser.add_argument("--main", choices=("loop", "idle"), default="loop",
                        help="the fleet's main threads: a 1 kHz loop (busy) or waiting (idle)")
    parser.add_argument("--max-in-flight", type=int, default=DEFAULT_IN_FLIGHT)
    parser.add_argument("--in-flight-sweep", default="",
                        help="bounds to time in turn at the largest size (e.g. 8,32,256), instead of the sizes")
    parser.add_argument("--deadline", type=float, default=1.5)
    parser.add_argument("--sizes", default="16,64,256,1024")
    parser.add_argument("--before", default="", help="a tree of an earlier commit, timed beside this one")
    args = parser.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]
    header("fan-out: one query to many agents, time to the merged pyarrow table", [
        "query: %s; %d agents per process; max in flight %d" % (SQL, args.per_process, args.max_in_flight)])
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
        if args.in_flight_sweep:
            sweep(fleets["this tree"][0], ports, max(sizes), [int(b) for b in args.in_flight_sweep.split(",")], args.runs)
            return
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
                        seconds, got, failed, cpu = timed(cluster_of(spread(fleets[name][1], n), 20.0,
                                                                     in_flight=args.max_in_flight), what == "health")
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
                seconds, got, failed, _cpu = timed(cluster_of(spread(ports, n - k), deadline, silent,
                                                              args.max_in_flight))
                assert got == n - k and failed == k, (n, got, failed)
                times.append(seconds)
            s = Summary.of(times)
            rows.append([str(n), str(k), "%.2f" % deadline, "%.3f" % s.median, "%.3f-%.3f" % (s.low, s.high),
                         "+%.0f ms" % ((s.high - deadline) * 1000)])
        print(table(rows, ["agents", "silent", "deadline s", "median s", "min-max s", "worst past deadline"]))
    finally:
        for sock in silent_socks:
            sock.close()
        for (fleet, _pids), _ in fleets.values():
            fleet.kill()  # its children die with it (PR_SET_PDEATHSIG)
            fleet.wait(10)


if __name__ == "__main__":
    main()
