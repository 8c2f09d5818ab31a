"""``probe MASTER diagnose`` across a simulated job: how long one look at every rank takes (the evidence:
stacks, threads' CPU, Flight Recorder and trace queries, 4 requests a rank) and the whole diagnosis
(two or three looks: 1 s apart, and at 3 s where a rank showed no sign of life), at 16 and 256 ranks.

    python bench/bench_diagnose.py [--runs 5] [--sizes 16,256] [--per-node 8]

The agents are bench_fanout_helpers.py's SIMULATED ones (canned answers, no agent CPU, no GIL): every
query gets one canned row, so the torch evidence is "not known" and, the stacks never moving, every
diagnosis takes its third look at 3 s. What is timed is the client's fan-out of the evidence and the rules.
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
    parser.add_argument("--sizes", default="16,256")
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--processes", type=int, default=4)
    args = parser.parse_args()
    runtime = tempfile.mkdtemp(prefix="probe-bench-")
    os.environ["PROBE_RUNTIME_DIR"] = runtime
    env = dict(clean_env(), PROBE_RUNTIME_DIR=runtime, PROBE_HOST="localhost", PYTHONPATH=REPO)
    header("probe MASTER diagnose on SIMULATED agents (bench_fanout_helpers.py's canned servers)", [
        "one look: every rank's stacks, threads, Flight Recorder and trace queries (4 requests a rank); "
        "whole: discovery, the looks (1 s apart, a third at 3 s) and the rules; %d runs" % args.runs])
    from probe.client.cluster import connect_all
    from probe.diagnose.engine import diagnose, sampler_for
    from probe.diagnose.evidence import sample_job

    rows: List[List[str]] = []
    try:
        for n in [int(s) for s in args.sizes.split(",") if s]:
            procs = max(1, min(args.processes, n // args.per_node))
            job = fleet.Job(n, args.per_node, False, runtime, procs, procs, env)
            try:
                looks, wholes, cpus = [], [], []
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
                    assert report.status == "healthy", report.as_json()
                    if i:  # the first is a warm-up: imports, first connections
                        looks.append(look)
                        wholes.append(whole)
                        cpus.append(used)
            finally:
                job.close()
            one, all_, cpu_s = Summary.of(looks), Summary.of(wholes), Summary.of(cpus)
            rows.append([str(n), str(args.per_node), str(one.n), "%.3f" % one.median, "%.3f-%.3f" % (one.low, one.high),
                         "%.3f" % all_.median, "%.3f-%.3f" % (all_.low, all_.high), "%.3f" % cpu_s.median])
        print(table(rows, ["ranks", "a node", "n", "one look s", "min-max s", "diagnose s", "min-max s",
                           "client CPU s"]))
    finally:
        for name in os.listdir(runtime):
            try:
                os.unlink(os.path.join(runtime, name))
            except OSError:
                pass


if __name__ == "__main__":
    main()
