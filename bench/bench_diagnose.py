"""``probe MASTER diagnose`` across a simulated job that is HEALTHY and PROGRESSING, through the node helpers: how
long one look at every rank takes and the whole diagnosis (discovery, two looks 1 s apart, a third at 3 s only
where a rank showed no sign of life between the first two, and the rules), at 1,024 and 16,384 ranks; a stall
record of 1,024 ranks; a refresh of ``probe MASTER page`` at 1,024 ranks.

    python bench/bench_diagnose.py [--runs 5] [--sizes 1024,16384] [--per-node 8] [--processes 8]
                                   [--real 128] [--profile N] [--record 1024] [--page 1024]

It ends with one line a size: ``diagnose N ranks: median X s``.

The stall record (``--record N``): each node's helper records its own ranks when they stall, all nodes at once
(``probe.host.watch``), so a job's record takes one node's time: one node's record of its 8 ranks, made as the
watch makes it (``capture.capture_members``: two looks 1 s apart and a third at 3 s, as the ranks show no sign
of life; the tables; each rank's file; the meta) from canned agents answering as a STALLED job (``Stalled``;
the tables' rows canned, so the files are smaller than a real rank's), in this process; the other nodes'
directories written as that node's renumbered; then the whole record read back by ``probe snapshot:DIR/ID
diagnose`` (the CLI, a process of its own). The page (``--page N``, one of ``--sizes``): a ``PageServer`` over
the simulated job in this process, and a refresh as the page's script makes it (``page_refresh``).

The job is bench_fanout_helpers.py's, answering as a job that makes progress (``bench_fanout_helpers.Live``):
the step counter (``torch.steps``) advances 10 steps a second of wall time, the threads' CPU grows with it,
the main thread's innermost line moves; the Flight Recorder, the trace and ``torch.anomalies`` are empty
(off), the RSS flat. So the second look settles it (healthy, 2 looks), as on a real job making steps.

Through the node helpers (``probe.diagnose.gathered``): one ``POST /v1/gather`` ``{"op": "evidence"}`` a node
a look; each helper runs diagnose's evidence code on its ranks (the stacks, the threads' CPU, Flight
Recorder, trace, step counter, anomalies, RSS and parameter queries; after the first look, both looks' 5
main-thread samples 80 ms apart for the straggler rule, in the background: ``probe.host.prefetch``) and
answers with each distinct stack once (by its digest where the client holds it). As in bench_fanout_helpers.py's 16,384-rank
job, the ranks are not served: each helper asks canned agents in memory (``_CannedLive``), so that the
helper's own work runs and no rank's. And since 128 or 2,048 nodes cannot all work at once on a 2-core
machine as they would on their own cores, each helper process does ONE node's collecting a look and its
other nodes answer with that node's evidence renumbered (``bench_fanout_helpers._one_node_gathers``); and
the answer's bytes too are built once a look a process, by the real helper code for one node (its gather,
``gathered.encode``, the JSON), every other node of the process served those bytes with its own ranks, pids
and ages put in (``bench_fanout_helpers._one_node_answers``). WHAT RUNS FOR REAL, ON THIS MACHINE: the whole
client (discovery, every node's token handshake and request a look: a hello and the request at a diagnosis's
first look, then the request alone with the nonce the answer before handed out, all on one connection a node
that its helper keeps (``probe.agent.listener``'s kept connections); reading and checking
every node's answer, every rank's evidence, the rules over all of them), and each node's serving side (the
helper's listener, its handshake, the request's checks: so this machine also carries 2,048 nodes' HTTP
serving, which a real job spreads over its nodes). WHAT IS SIMULATED: the ranks (canned answers, from
memory), and the helpers' collecting and encoding, done once a look a process where a real job does it on
every node at once; a node's time to collect is the one measured (the samples taken apart from the looks),
paid once by the process's first node asked, and by the others as they wait for it, not by each node
one after another in its own request. ``--real N``: also N ranks as real simulated agents (sockets, every request)
directly and through the helpers, every node's work on this machine (the peer). ``--profile N``: a
cProfile of one diagnose at N ranks (the client's functions, fan-out threads included).
"""

import argparse
import os
import sys
import tempfile
import time
from typing import Any, Dict, List

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
        _fresh_process()
        cluster = connect_all(job.master, token=fleet.TOKEN, deadline=deadline, timeout=deadline + 20.0)
        cluster.via = via
        start = time.perf_counter()
        sample = sample_job(cluster, deadline)
        look = time.perf_counter() - start
        bad = [(r, e.state, e.why[:200]) for r, e in sample.ranks.items() if e.state != "answering"]
        assert len(sample.ranks) == n, len(sample.ranks)
        if bad:
            print("  look %d: %d of %d ranks gave no evidence in %.0f s: %s" % (i, len(bad), n, deadline, bad[0]))
        _fresh_process()
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
        _fresh_process()
        time.sleep(1.0)
    return out


def _fresh_process() -> None:
    """What a new ``probe diagnose`` process starts without: the next nonces the helpers' answers handed out
    (``probe.client.proof.keep_next``), so that each diagnosis begins with a hello to every helper, as the
    CLI's does; and the stacks held by their digests (``probe.diagnose.gathered.hold``), so that its first
    look has them sent in full; and the connections the helpers keep (``probe.client.multiplex``), which a
    process's exit closes."""
    from probe.client import multiplex, proof
    from probe.diagnose import gathered

    getattr(multiplex, "close_kept", lambda: None)()
    for store in (getattr(proof, "_kept", None), getattr(gathered, "_HELD", None)):
        if store is not None:
            store.clear()


# -- the stall record --------------------------------------------------------------------------------


class Stalled(fleet.Live):
    """Answers of a STALLED job (the record's bench): the step counter stopped 100 s ago at step 5,000 on every
    rank, no thread gains CPU, every stack stays where it is (the main thread in its wait), the rest as
    ``Live``: so a record looks twice, and a third time at 3 s (no sign of life in the first second)."""

    STEP_S = 1e9  # the canned stacks' line never moves

    def threads(self, rank: int, age: float) -> Any:
        return super().threads(rank, 20.0)

    def steps(self, rank: int, age: float) -> Any:
        columns, _ = super().steps(rank, age)
        return columns, [["SGD@0x7f3a5c0e1d90", 5000, max(age - 100.0, 100.0), 0.1, 0.1, 64]]


def node_record(directory: str, node: int, per: int, world: int, job: str, started: float,
                like: Any = None) -> Any:
    """One node's stall record as its helper's watch makes it (``probe.host.watch.Watch._record``: every
    rank captured at once, ``capture.capture_members``, each rank's file, the meta last) of ``per`` ranks
    answering as ``Stalled`` from memory: (the seconds it took, its records). ``like``: another node's
    records, written renumbered for this one instead."""
    import copy
    from types import SimpleNamespace

    from probe.snapshot import capture, record

    start = time.perf_counter()
    members = [SimpleNamespace(rank=node * per + i, local_rank=i, host="node%d" % node, pid=fleet.PID_BASE + node * per + i)
               for i in range(per)]
    if like is None:
        pairs = [(fleet._CannedLive({"rank": m.rank, "pid": m.pid}, None), m) for m in members]
        records = capture.capture_members(pairs, "stall: no step for 60 s (hang_after 60 s)", job, 60.0,
                                          secrets=[fleet.TOKEN])
    else:
        records = []
        for m, rec in zip(members, like):
            rec = copy.deepcopy(rec)
            for part in [rec] + list(rec.get("evidence") or ()):
                part.update(rank=m.rank, host=m.host, pid=m.pid)
            records.append(rec)
    for rec in records:
        record.write_rank(directory, rec)
    record.write_meta(directory, {
        "job": job, "host": "node%d" % node, "node": "node%d" % node, "reason": "stall: no step for 60 s", "started": started,
        "ended": time.time(), "ranks": [m.rank for m in members], "failed": {}, "hang_after_s": 60.0, "by": "watch",
        "helper_pid": os.getpid(), "run": "torchelastic bench-%d" % world, "world_size": world})
    return time.perf_counter() - start, records


def stall_record(n: int, per: int, runs: int, root: str, env: Dict[str, str]) -> Dict[str, List[float]]:
    """A stall record of ``n`` ranks: each node's watch records its own ranks at once, so the record of the
    job takes as long as one node's (measured ``runs`` times, ``per`` ranks); the job's other nodes' parts are
    written as that node's evidence renumbered (as the diagnose bench's other nodes answer). Then the whole
    record read back as the person on call reads it: ``probe snapshot:DIR/ID diagnose`` (the CLI)."""
    import shutil
    import subprocess

    from probe.snapshot import store

    fleet._CannedLive.live = Stalled(time.time() - 200.0)
    fleet._CannedLive.frames = [[fleet._canned_frames(raw) for raw in variants] for variants in fleet._CannedLive.live.stacks]
    out: Dict[str, List[float]] = {"node": [], "read": [], "size": []}
    for i in range(runs + 1):
        started = time.time()
        job = "bench%d" % i
        first = store.new_snapshot_dir(root, job, started)
        took, records = node_record(first, 0, per, n, job, started)
        if i:
            out["node"].append(took)
        for node in range(1, -(-n // per)):  # the other nodes' parts, each in a directory of its own
            node_record(store.new_snapshot_dir(root, job, started), node, per, n, job, started, records)
        sid = os.path.basename(first)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "probe", "snapshot:%s/%s" % (root, sid), "diagnose"], env=env,
                              capture_output=True, text=True, timeout=300)
        read = time.perf_counter() - start
        if i:
            out["read"].append(read)
            out["size"].append(sum(os.path.getsize(os.path.join(d, f)) for d in os.scandir(root) if d.is_dir()
                                   for f in os.listdir(d.path)) / 1e6)
        else:
            print("record of %d ranks, read back: exit %d: %s" % (n, proc.returncode, (proc.stdout or proc.stderr)
                                                                   .strip().splitlines()[:1]), flush=True)
        for d in os.scandir(root):
            shutil.rmtree(d.path, ignore_errors=True)
    return out


# -- the page -------------------------------------------------------------------------------------


def page_refresh(job: "fleet.Job", runs: int) -> List[float]:
    """A refresh of ``probe MASTER page``: what the page's script asks at once (``/api/overview``, then the
    timeline's SQL over ``cluster.stack_history``; ``/api/metrics``; ``/api/diagnose``), over HTTP from its
    server, until the last answer; each refresh after the server's answers of the one before expired. The
    simulated node helpers keep no stack history: the timeline's answer is that there is none (as the page
    says where a helper keeps none), and diagnose's own ask for it is as quick. As ``probe MASTER --via helpers
    page``: at 1,024 ranks ``--via auto`` sends a query (the metrics' three) to each rank directly
    (``via_helpers.AUTO_ABOVE``), which the canned ranks here cannot answer (they refused at once: 4.5 s)."""
    import http.client
    import json
    import re
    import threading

    from probe.client.cluster import connect_all
    from probe.page.data import JobSource
    from probe.page.server import STATIC, PageServer

    with open(os.path.join(STATIC, "page.js")) as handle:
        timeline = re.search(r"const TIMELINE_SQL = `(.*?)`;", handle.read(), re.S).group(1)  # type: ignore[union-attr]

    def make() -> Any:
        cluster = connect_all(job.master, token=fleet.TOKEN, deadline=10.0, timeout=30.0)
        cluster.via = "helpers"  # `probe MASTER --via helpers page`: see the docstring
        return cluster

    server = PageServer(JobSource(make, lambda ranks, rest: rest, job.master, 5.0, 10.0), "127.0.0.1", 0, refresh=1.0)
    threading.Thread(target=server.serve, name="bench-page", daemon=True).start()
    origin = "http://127.0.0.1:%d" % server.port

    def ask(path: str, body: Any = None) -> Any:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        headers = {"X-Probe-Page-Token": server.token}
        if body is not None:
            headers.update({"Content-Type": "application/json", "X-Probe-Page": "1", "Origin": origin})
        conn.request("POST" if body is not None else "GET", path, json.dumps(body) if body is not None else None, headers)
        answer = conn.getresponse()
        data = answer.read()
        conn.close()
        got = json.loads(data)
        if b"keeps no stack history" in data:  # the simulated helpers keep none: the page says "no history"
            return got
        if answer.status != 200 or (isinstance(got, dict) and got.get("error")):
            raise RuntimeError("%s: %s %s" % (path, answer.status, data[:300]))
        return got

    def refresh() -> float:
        errors: List[str] = []

        def run(*paths: Any) -> None:
            try:
                for path, body in paths:
                    begun = time.perf_counter()
                    ask(path, body)
                    if counted:
                        parts.setdefault(path, []).append(time.perf_counter() - begun)
            except Exception as exc:  # said below, and the refresh counts as it took
                errors.append(str(exc)[:300])

        start = time.perf_counter()
        threads = [threading.Thread(target=run, args=paths) for paths in (
            (("/api/overview", None), ("/api/sql", {"sql": timeline, "rank": None, "merge": None})),
            (("/api/metrics", None),), (("/api/diagnose", None),))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        took = time.perf_counter() - start
        if errors:
            print("  page refresh: %s" % "; ".join(errors), flush=True)
        return took

    parts: Dict[str, List[float]] = {}  # each route's own time, over the refreshes counted
    counted = False
    try:
        out = []
        for i in range(runs + 1):
            job.report()
            time.sleep(max(1.5, 2.5 * (out[-1] if out else 2.0)))  # the answers before have expired (_Once)
            counted = i > 0
            took = refresh()
            if i:
                out.append(took)
        print("  page routes, median s: %s" % ", ".join("%s %.2f" % (path, Summary.of(v).median)
                                                       for path, v in sorted(parts.items())), flush=True)
        return out
    finally:
        server.httpd.shutdown()


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
    parser.add_argument("--record", type=int, default=1024, help="a stall record of this many ranks (0: none)")
    parser.add_argument("--page", type=int, default=1024, help="page refreshes at this size, one of --sizes (0: none)")
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
    extra: List[str] = []
    try:
        if args.record:
            root = tempfile.mkdtemp(prefix="probe-bench-records-")
            got = stall_record(args.record, args.per_node, args.runs, root, env)
            os.rmdir(root)
            node, read = Summary.of(got["node"]), Summary.of(got["read"])
            figure("stall record of %d simulated ranks (each node records its %d at once: one node's record)"
                   % (args.record, args.per_node), got["node"], unit="s", scale=1.0, goal="<= 10 s (issue 37)",
                   met=node.median <= 10.0)
            figure("probe snapshot:DIR/ID diagnose of that %d-rank record (%d node directories)"
                   % (args.record, -(-args.record // args.per_node)), got["read"], unit="s", scale=1.0)
            extra.append("stall record of %d ranks: median %.2f s [%.2f-%.2f] a node (all nodes at once), goal <= 10 s: "
                         "%s; the whole record (%.1f MB) read back by `probe snapshot:... diagnose`: median %.2f s "
                         "[%.2f-%.2f]" % (args.record, node.median, node.low, node.high, verdict(node.median <= 10.0),
                                          Summary.of(got["size"]).median, read.median, read.low, read.high))
            print(extra[-1], flush=True)
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
                if n == args.page:
                    refreshes = page_refresh(job, args.runs)
                    page = Summary.of(refreshes)
                    figure("page refresh, %d simulated ranks through the node helpers" % n, refreshes, unit="s",
                           scale=1.0, goal="<= 2 s (issue 37)", met=page.median <= 2.0)
                    extra.append("page refresh at %d ranks (overview + timeline, metrics, diagnose, at once): median "
                                 "%.2f s [%.2f-%.2f], goal <= 2 s: %s" % (n, page.median, page.low, page.high,
                                                                        verdict(page.median <= 2.0)))
                    print(extra[-1], flush=True)
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
        for line in extra:
            print(line)
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
    """One diagnose under cProfile, the fan-out's worker threads included (a profiler each, merged), in each
    thread's CPU time (waiting on the wire costs nothing): the functions by cumulative and by own time,
    summed over the threads."""
    import cProfile
    import pstats
    import threading

    from probe.client.cluster import connect_all
    from probe.diagnose.engine import diagnose, sampler_for

    profs: List[cProfile.Profile] = []

    def start_in_thread(*_: object) -> None:  # the first event of a new thread: its own profiler takes over
        prof = cProfile.Profile(time.thread_time)  # CPU time: a thread waiting on the wire costs nothing
        profs.append(prof)
        prof.enable()

    time.sleep(1.0)
    job.report()
    _fresh_process()
    main = cProfile.Profile(time.thread_time)
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
