"""``probe MASTER diagnose`` across a simulated job that is HEALTHY and PROGRESSING, through the node helpers: how
long one look at every rank takes and the whole diagnosis (discovery, two looks 1 s apart, a third at 3 s only
where a rank showed no sign of life between the first two, and the rules), at 1,024 and 16,384 ranks.

    python bench/bench_diagnose.py [--runs 5] [--sizes 1024,16384] [--per-node 8] [--processes 8]
                                   [--real 128] [--profile N]

It ends with one line a size: ``diagnose N ranks: median X s``.

The job is bench_fanout_helpers.py's, answering as a job that makes progress (``bench_fanout_helpers.Live``):
the step counter (``torch.steps``) advances 10 steps a second of wall time, the threads' CPU grows with it,
the main thread's innermost line moves; the Flight Recorder, the trace and ``torch.anomalies`` are empty
(off), the RSS flat. So the second look settles it (healthy, 2 looks), as on a real job making steps.

Through the node helpers (``probe.diagnose.gathered``): one ``POST /v1/gather`` ``{"op": "evidence"}`` a node
a look; each helper runs diagnose's evidence code on its ranks (the stacks, 5 more main-thread samples 80 ms
apart for the straggler rule, the threads' CPU, Flight Recorder, trace, step counter, anomalies, RSS and
parameter queries) and answers with each distinct stack once. As in bench_fanout_helpers.py's 16,384-rank
job, the ranks are not served: each helper asks canned agents in memory (``_CannedLive``), so that the
helper's own work runs and no rank's. And since 128 or 2,048 nodes cannot all work at once on a 2-core
machine as they would on their own cores, each helper process does ONE node's collecting a look and its
other nodes answer with that node's evidence renumbered (``bench_fanout_helpers._one_node_gathers``):
every node's request, encoding and answer, and the client's reading of every rank's evidence and its rules
over all of them, run for real. ``--real N``: also N ranks as real simulated agents (sockets, every request)
directly and through the helpers, every node's work on this machine (the peer). ``--profile N``: a
cProfile of one diagnose at N ranks (the client's functions, fan-out threads included).
"""

import argparse
import os
import sys
import tempfile
import time
from typing import Dict, List

from _common import REPO, Summary, clean_env, figure, header, table, verdict

sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_fanout_helpers as fleet  # noqa: E402

HEAD = ["ranks", "a node", "how", "n", "one look s", "min-max s", "diagnose s", "IQR s", "min-max s", "client CPU s",
        "looks"]
GOALS = {1024: 2.0, 16384: 5.0}  # issue 37: diagnose <= 2 s at 1,024 ranks, <= 5 s at 16,384


def measure(job: "fleet.Job", n: int, via: str, runs: int, deadline: float) -> Dict[str, List[float]]:
    """One look and the whole diagnose, ``runs`` times after a warm-up: wall s, client CPU s, looks. A run
    where some rank gave no evidence in time (an overloaded machine) is said, and counts as it took."""
    from probe.client.cluster import connect_all
    from probe.diagnose.engine import diagnose, sampler_for
    from probe.diagnose.gather import sample_job

    out: Dict[str, List[float]] = {"look": [], "whole": [], "cpu": [], "samples": []}
    for i in range(runs + 1):
        job.report()
        cluster = connect_all(job.master, token=fleet.TOKEN, deadline=deadline, timeout=deadline + 20.0)
        cluster.via = via
        start = time.perf_counter()
        sample = sample_job(cluster, deadline)
        look = time.perf_counter() - start
        bad = [(r, e.state, e.why[:200]) for r, e in sample.ranks.items() if e.state != "answering"]
        assert len(sample.ranks) == n, len(sample.ranks)
        if bad:
            print("  look %d: %d of %d ranks gave no evidence in %.0f s: %s" % (i, len(bad), n, deadline, bad[0]))
        time.sleep(1.0)  # the helpers' one-node evidence of this look is not the next one's
        start, cpu = time.perf_counter(), time.process_time()
        cluster = connect_all(job.master, token=fleet.TOKEN, deadline=deadline, timeout=deadline + 20.0)
        cluster.via = via
        report = diagnose(sampler_for(cluster, False), deadline, lambda r, rest: rest)
        whole, used = time.perf_counter() - start, time.process_time() - cpu
        if not (report.status == "healthy" and "steps advance" in report.verdicts[0].summary):
            print("  diagnose %d: %s" % (i, "; ".join(v.summary[:200] for v in report.verdicts[:2])))
        if i:  # the first is a warm-up: imports, first connections
            out["look"].append(look)
            out["whole"].append(whole)
            out["cpu"].append(used)
            out["samples"].append(report.samples)
        else:
            print("%d ranks (%s): %s" % (n, via, report.verdicts[0].summary), flush=True)
        time.sleep(1.0)
    return out


def row(n: int, per: int, what: str, got: Dict[str, List[float]]) -> List[str]:
    one, whole, cpu = Summary.of(got["look"]), Summary.of(got["whole"]), Summary.of(got["cpu"])
    return [str(n), str(per), what, str(one.n), "%.3f" % one.median, "%.3f-%.3f" % (one.low, one.high),
            "%.3f" % whole.median, "%.3f-%.3f" % (whole.q1, whole.q3), "%.3f-%.3f" % (whole.low, whole.high),
            "%.3f" % cpu.median, "/".join(str(int(k)) for k in sorted(set(got["samples"])))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sizes", default="1024,16384")
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--processes", type=int, default=8, help="helper processes")
    parser.add_argument("--real", type=int, default=0, help="also this many ranks as real simulated agents, "
                                                            "directly and through the helpers")
    parser.add_argument("--profile", type=int, default=0, help="also profile one diagnose at this many ranks")
    parser.add_argument("--deadline", type=float, default=30.0, help="diagnose's --deadline (the CLI's default: 10)")
    args = parser.parse_args()
    runtime = tempfile.mkdtemp(prefix="probe-bench-")
    os.environ["PROBE_RUNTIME_DIR"] = runtime
    env = dict(clean_env(), PROBE_RUNTIME_DIR=runtime, PROBE_HOST="localhost", PYTHONPATH=REPO)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    header("probe MASTER diagnose through the node helpers, on a SIMULATED healthy, progressing job "
           "(bench_fanout_helpers.Live; see the docstring)", [
               "one look: a gather a node, each helper collecting diagnose's evidence of its ranks from canned "
               "agents, one node's collecting a helper process (its other nodes answer with it, renumbered); "
               "whole: discovery, the looks (1 s apart; a third at 3 s only where a rank showed no sign of life) "
               "and the rules; %d runs; %d ranks a node; %d helper processes" % (args.runs, args.per_node,
                                                                                 args.processes)])
    rows: List[List[str]] = []
    medians: Dict[int, float] = {}
    try:
        if args.real:
            n = args.real
            procs = max(1, min(4, n // args.per_node))
            job = fleet.Job(n, args.per_node, False, runtime, procs, procs, env, live=True)
            try:
                got = {via: measure(job, n, via, args.runs, args.deadline) for via in ("direct", "helpers")}
            finally:
                job.close()
            for via in ("direct", "helpers"):
                rows.append(row(n, args.per_node, "real agents, %s" % via, got[via]))
            figure("diagnose, %d real simulated ranks, through the helpers" % n, got["helpers"]["whole"],
                   peer="directly", peer_values=got["direct"]["whole"], unit="s", scale=1.0)
        for n in sizes:
            procs = max(1, min(args.processes, -(-n // args.per_node)))
            job = fleet.Job(n, args.per_node, True, runtime, 1, procs, env, live=True, one_node=True)
            try:
                got = measure(job, n, "helpers", args.runs, args.deadline)
                if n == args.profile:
                    profile(job, n)
            finally:
                job.close()
            rows.append(row(n, args.per_node, "helpers, one node's work a process", got))
            print(table(rows[-1:], HEAD), flush=True)
            medians[n] = Summary.of(got["whole"]).median
            goal = GOALS.get(n)
            figure("diagnose, %d simulated ranks through the node helpers" % n, got["whole"], unit="s", scale=1.0,
                   goal="<= %g s (issue 37)" % goal if goal else None,
                   met=medians[n] <= goal if goal else None)
            figure("one look, %d simulated ranks through the node helpers" % n, got["look"], unit="s", scale=1.0)
        print(table(rows, HEAD))
        print("load average at the end: %s" % " ".join("%.1f" % x for x in os.getloadavg()))
        for n in sizes:
            if n in GOALS:
                print("goal <= %g s at %d ranks: %s" % (GOALS[n], n, verdict(medians[n] <= GOALS[n])))
        for n in sizes:
            print("diagnose %d ranks: median %.2f s" % (n, medians[n]))
    finally:
        for name in os.listdir(runtime):
            try:
                os.unlink(os.path.join(runtime, name))
            except OSError:
                pass


def profile(job: "fleet.Job", n: int) -> None:
    """One diagnose under cProfile, the fan-out's worker threads included (a profiler each, merged): the
    functions by cumulative and by own time, summed over the threads (so over 100 % of the wall time)."""
    import cProfile
    import pstats
    import threading

    from probe.client.cluster import connect_all
    from probe.diagnose.engine import diagnose, sampler_for

    profs: List[cProfile.Profile] = []

    def start_in_thread(*_: object) -> None:  # the first event of a new thread: its own profiler takes over
        prof = cProfile.Profile()
        profs.append(prof)
        prof.enable()

    time.sleep(1.0)
    job.report()
    main = cProfile.Profile()
    threading.setprofile(start_in_thread)
    start = time.perf_counter()
    main.enable()
    try:
        cluster = connect_all(job.master, token=fleet.TOKEN, deadline=10.0, timeout=30.0)
        report = diagnose(sampler_for(cluster, False), 10.0, lambda r, rest: rest)
    finally:
        main.disable()
        threading.setprofile(None)  # type: ignore[arg-type]
        for prof in profs:
            prof.disable()  # from this thread: stops collecting; the stats are kept
    print("\ncProfile of one diagnose at %d ranks: %.3f s under the profiler, %d looks, %d threads profiled "
          "besides the caller" % (n, time.perf_counter() - start, report.samples, len(profs)))
    stats = pstats.Stats(main, stream=sys.stdout)
    for prof in profs:
        stats.add(prof)
    stats.sort_stats("cumulative").print_stats(30)
    stats.sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
