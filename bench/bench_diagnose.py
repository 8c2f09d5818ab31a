"""``probe MASTER diagnose`` across a simulated job that is HEALTHY and PROGRESSING: how long one look at every
rank takes and the whole diagnosis (discovery, two looks 1 s apart, a third at 3 s only where a rank showed
no sign of life between the first two, and the rules), at 16, 256 and 1024 ranks.

    python bench/bench_diagnose.py [--runs 5] [--sizes 16,256,1024] [--per-node 8] [--profile 256]

The agents are bench_fanout_helpers.py's SIMULATED ones (no agent CPU, no GIL), answering as a job that
makes progress (``bench_fanout_helpers.Live``): the step counter (``torch.steps``) advances 10 steps a second
of wall time, the threads' CPU (``python.threads``) grows with it, the main thread's innermost line moves;
the Flight Recorder, the trace and ``torch.anomalies`` are empty (off), the RSS (``process.info``) flat. So
the second look settles it (healthy, 2 looks), as on a real job making steps. One look sends 7 requests a
rank (the stacks; threads' CPU, Flight Recorder, trace, step counter, anomalies, RSS queries). What is
timed is the client: discovery, the fan-out of the evidence and the rules. ``--profile N``: a cProfile of
one diagnose at N ranks (the client's functions by cumulative time).
"""

import argparse
import os
import sys
import tempfile
import time
from typing import List

from _common import REPO, Summary, clean_env, header, table

sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_fanout_helpers as fleet  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sizes", default="16,256,1024")
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--profile", type=int, default=0, help="also profile one diagnose at this many ranks")
    args = parser.parse_args()
    runtime = tempfile.mkdtemp(prefix="probe-bench-")
    os.environ["PROBE_RUNTIME_DIR"] = runtime
    env = dict(clean_env(), PROBE_RUNTIME_DIR=runtime, PROBE_HOST="localhost", PYTHONPATH=REPO)
    header("probe MASTER diagnose on SIMULATED agents answering as a healthy, progressing job "
           "(bench_fanout_helpers.Live)", [
               "one look: every rank's stacks and 6 queries (threads' CPU, Flight Recorder, trace, torch.steps, "
               "torch.anomalies, RSS): 7 requests a rank, direct; whole: discovery, the looks (1 s apart; a third "
               "at 3 s only where a rank showed no sign of life) and the rules; %d runs; load average %s"
               % (args.runs, " ".join("%.1f" % x for x in os.getloadavg()))])
    from probe.client.cluster import connect_all
    from probe.diagnose.engine import diagnose, sampler_for
    from probe.diagnose.gather import sample_job

    rows: List[List[str]] = []
    try:
        for n in [int(s) for s in args.sizes.split(",") if s]:
            procs = max(1, min(args.processes, n // args.per_node))
            job = fleet.Job(n, args.per_node, False, runtime, procs, procs, env, live=True)
            try:
                looks, wholes, cpus, samples = [], [], [], []
                for i in range(args.runs + 1):
                    job.report()
                    cluster = connect_all(job.master, token=fleet.TOKEN, deadline=10.0, timeout=30.0)
                    start = time.perf_counter()
                    sample = sample_job(cluster, 10.0)
                    look = time.perf_counter() - start
                    assert len(sample.ranks) == n and all(e.state == "answering" for e in sample.ranks.values())
                    start, cpu = time.perf_counter(), time.process_time()
                    cluster = connect_all(job.master, token=fleet.TOKEN, deadline=10.0, timeout=30.0)
                    report = diagnose(sampler_for(cluster, False), 10.0, lambda r, rest: rest)
                    whole, used = time.perf_counter() - start, time.process_time() - cpu
                    assert report.status == "healthy" and "steps advance" in report.verdicts[0].summary, \
                        report.as_json()
                    if i:  # the first is a warm-up: imports, first connections
                        looks.append(look)
                        wholes.append(whole)
                        cpus.append(used)
                        samples.append(report.samples)
                    else:
                        print("%d ranks: %s" % (n, report.verdicts[0].summary), flush=True)
                if n == args.profile:
                    profile(job, n)
            finally:
                job.close()
            one, all_, cpu_s = Summary.of(looks), Summary.of(wholes), Summary.of(cpus)
            rows.append([str(n), str(args.per_node), str(one.n), "%.3f" % one.median, "%.3f-%.3f" % (one.q1, one.q3),
                         "%.3f-%.3f" % (one.low, one.high), "%.3f" % all_.median, "%.3f-%.3f" % (all_.q1, all_.q3),
                         "%.3f-%.3f" % (all_.low, all_.high), "%.3f" % cpu_s.median,
                         "/".join(str(k) for k in sorted(set(samples)))])
        print(table(rows, ["ranks", "a node", "n", "one look s", "IQR s", "min-max s", "diagnose s", "IQR s",
                           "min-max s", "client CPU s", "looks"]))
        print("load average at the end: %s" % " ".join("%.1f" % x for x in os.getloadavg()))
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
