"""The stall watch (issue 21): how soon a stalled node is recorded, what the watch costs a job that makes
progress, and how big a record is.

    python bench/bench_watch.py [--ranks 8] [--runs 3] [--rounds 3] [--window 10] [--stall-traced]

Real torchrun gloo jobs on the CPU (``bench/targets/watch_train.py``: a small MLP, an all_reduce of the loss
a step, one intra-op thread), ``PROBE=1`` and ``PROBE_PORT`` (torchrun's launcher is the node's helper and
runs the watch), each in a runtime and snapshot directory of the bench's own.

1. Stall to record, ``--runs`` times: ``--ranks`` ranks (steps with 50 ms of sleep), ``PROBE_HANG_AFTER=5``
   (and ``PROBE_HANG_MIN=600``: no record during the slow start of many ranks on few CPUs); once all are
   READY and their steps counted, the last rank stops calling collectives. The stall began at the newest
   step of any rank (read from the ranks' progress files afterwards); the figures are the watch noticing
   it (record began, minus the 5 s of hang_after), recording every rank of the node (record began -> meta
   written), and the whole (stall -> meta written); and the size of each rank's record file. Before the
   stall, the CPU time of one look of a watch (the one the helper runs, here in the bench process over the
   same ranks: the progress files, the node's member list) while steps advance.
2. The watch's cost on a job that makes progress, ``--rounds`` times, untraced and traced
   (``PROBE_TORCH_TRACE=1``): two 2-rank jobs at once, the watch on in one and off in the other
   (``PROBE_SNAPSHOT=0``), the same ``--window`` seconds of steps (no sleep) measured by the ranks
   themselves (wall time a step); the figure is each job's median step, and on / off per round. The
   progress file the step counter writes is in both (``bench_step_counter.py`` measures it).
"""

import argparse
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import REPO, TARGETS, Summary, header, table  # noqa: E402

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def _free_port(pair: bool = False) -> int:
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            if not pair:
                return port
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port")


class Job:
    """A torchrun job of watch_train.py; always stopped (its process group) and reaped."""

    def __init__(self, base: str, name: str, ranks: int, **env: str) -> None:
        self.dir = os.path.join(base, name)
        self.run = os.path.join(self.dir, "run")
        os.makedirs(self.run, 0o700)
        self.snaps = os.path.join(self.dir, "snaps")
        self.control = os.path.join(self.dir, "control")
        self.port = _free_port(pair=True)
        full = {k: v for k, v in os.environ.items() if not k.startswith("PROBE")}
        full.update(PROBE="1", PROBE_PORT=str(self.port), PROBE_RUNTIME_DIR=self.run, PROBE_SNAPSHOT_DIR=self.snaps,
                    WATCH_CONTROL=self.control, PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
        full.update(env)
        self.err = open(os.path.join(self.dir, "stderr"), "wb")
        self.popen = subprocess.Popen([TORCHRUN, "--nproc_per_node=%d" % ranks, "--master_port=%d" % _free_port(),
                                       os.path.join(TARGETS, "watch_train.py")], stdout=subprocess.PIPE,
                                      stderr=self.err, env=full, start_new_session=True)
        self.pending = b""
        self.pids: Dict[int, int] = {}

    def line(self, deadline: float) -> str:
        fd = self.popen.stdout.fileno()  # type: ignore[union-attr]
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no line from the job in %s" % self.dir)
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError("the job in %s exited; see its stderr" % self.dir)
                self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return line.decode("utf-8", "replace")

    def ready(self, ranks: int, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.pids) < ranks:
            words = self.line(deadline).split()
            if words[:1] == ["READY"]:
                self.pids[int(words[2])] = int(words[1])

    def order(self, text: str) -> None:
        with open(self.control, "a") as handle:
            handle.write(text + "\n")

    def times(self, ranks: int, timeout: float = 60.0) -> List[Tuple[int, float]]:
        """(steps, median step s) of each rank's TIMES line."""
        deadline = time.monotonic() + timeout
        out = []
        while len(out) < ranks:
            words = self.line(deadline).split()
            if words[:1] == ["TIMES"]:
                out.append((int(words[2]), float(words[3])))
        return out

    def stop(self) -> None:
        try:
            os.killpg(self.popen.pid, signal.SIGTERM)
            self.popen.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)
        except ProcessLookupError:
            self.popen.wait(10)
        self.popen.stdout.close()  # type: ignore[union-attr]
        self.err.close()


def _look_cost(job: Job, looks: int = 30) -> List[float]:
    """CPU seconds of one look of a watch over ``job``'s ranks (its member list and progress files)."""
    from probe.host.members import Members
    from probe.host.watch import Watch

    os.environ["PROBE_RUNTIME_DIR"] = job.run
    helper = SimpleNamespace(members=Members(job.port, children=False), base_port=job.port, kind="bench", _token=None)
    watch = Watch(helper)
    watch.look()  # the first look finds the ranks
    out = []
    for _ in range(looks):
        start = time.thread_time()
        watch.look()
        out.append(time.thread_time() - start)
        time.sleep(0.05)
    assert watch.records == 0
    return out


def stall_runs(base: str, ranks: int, runs: int, traced: bool = False) -> None:
    from probe.snapshot import record, store
    from probe.tables.torch.steps import read_progress

    noticed, recording, whole, sizes, looks = [], [], [], [], []
    for i in range(runs):
        job = Job(base, "stall-%d" % i, ranks, PROBE_HANG_AFTER="5", PROBE_HANG_MIN="600", STEP_SLEEP="0.05",
                  **({"PROBE_TORCH_TRACE": "1"} if traced else {}))
        try:
            job.ready(ranks)
            deadline = time.monotonic() + 120
            while not all(read_progress(os.path.join(job.run, "progress-%d.bin" % pid)) for pid in job.pids.values()):
                assert time.monotonic() < deadline, "the ranks' steps are not counted"
                time.sleep(0.2)
            looks += _look_cost(job)
            job.order("skip %d" % (ranks - 1))
            deadline = time.monotonic() + 300
            found: List[store.SnapshotInfo] = []
            while not found:
                assert time.monotonic() < deadline, "no record within 300 s"
                time.sleep(0.2)
                found = [s for s in store.list_snapshots(job.snaps) if s.complete]
            last = []
            for pid in job.pids.values():
                progress = read_progress(os.path.join(job.run, "progress-%d.bin" % pid))
                if progress is not None:
                    last.append(time.time() - (time.monotonic() - progress.last))
            stalled = max(last)
            meta = record.read_meta(next(os.path.join(found[0].path, n) for n in os.listdir(found[0].path)
                                         if n.startswith("meta-")))
            noticed.append(meta["started"] - stalled - 5.0)
            recording.append(meta["ended"] - meta["started"])
            whole.append(meta["ended"] - stalled)
            sizes += [os.stat(os.path.join(found[0].path, n)).st_size for n in os.listdir(found[0].path)
                      if n.startswith("rank-")]
            assert len(found) == 1 and sorted(meta["ranks"]) == list(range(ranks)), (found, meta)
            print("run %d: stall at %.3f, record %.3f -> %.3f, %d ranks, %s" % (
                i + 1, stalled, meta["started"], meta["ended"], len(meta["ranks"]), meta["reason"]), flush=True)
        finally:
            job.stop()
    rows = []
    for what, values, unit in (("noticed: record began - stall - hang_after (5 s)", noticed, 1.0),
                               ("recording %d ranks: began -> meta written" % ranks, recording, 1.0),
                               ("stall -> record complete (hang_after 5 s included)", whole, 1.0)):
        s = Summary.of(values)
        rows.append([what, str(s.n), "%.2f s" % (s.median * unit), "%.2f-%.2f" % (s.q1, s.q3), "%.2f-%.2f" % (s.low, s.high)])
    s = Summary.of([v / 1024.0 for v in sizes])
    rows.append(["record size per rank", str(s.n), "%.1f KB" % s.median, "%.1f-%.1f" % (s.q1, s.q3),
                 "%.1f-%.1f" % (s.low, s.high)])
    s = Summary.of([v * 1e6 for v in looks])
    rows.append(["one look of the watch (CPU), %d ranks stepping" % ranks, str(s.n), "%.0f us" % s.median,
                 "%.0f-%.0f" % (s.q1, s.q3), "%.0f-%.0f" % (s.low, s.high)])
    print(table(rows, ["stall -> record", "n", "median", "IQR", "min-max"]))
    print("(a look a second: %.3f%% of one CPU)" % (Summary.of(looks).median * 100))


def cost_rounds(base: str, rounds: int, window: float) -> None:
    results: Dict[str, List[float]] = {}
    ratios: Dict[str, List[float]] = {"untraced": [], "traced": []}
    steps: Dict[str, List[int]] = {}
    for r in range(rounds):
        for traced in (False, True):
            kind = "traced" if traced else "untraced"
            extra = {"PROBE_TORCH_TRACE": "1"} if traced else {}
            order = ("on", "off") if r % 2 == 0 else ("off", "on")
            jobs: Dict[str, Job] = {}
            try:
                for which in order:
                    env = dict(extra, **({"PROBE_SNAPSHOT": "0"} if which == "off" else {}))
                    jobs[which] = Job(base, "cost-%d-%s-%s" % (r, kind, which), 2, **env)
                for job in jobs.values():
                    job.ready(2)
                time.sleep(2.0)
                for job in jobs.values():
                    job.order("measure")
                time.sleep(window)
                for job in jobs.values():
                    job.order("report")
                medians = {}
                for which, job in jobs.items():
                    got = job.times(2)
                    medians[which] = sum(m for _, m in got) / len(got)
                    results.setdefault("%s, watch %s" % (kind, which), []).append(medians[which])
                    steps.setdefault("%s, watch %s" % (kind, which), []).append(min(n for n, _ in got))
                ratios[kind].append(medians["on"] / medians["off"])
                print("round %d %s: watch on %.3f ms, off %.3f ms a step" % (
                    r + 1, kind, medians["on"] * 1e3, medians["off"] * 1e3), flush=True)
            finally:
                for job in jobs.values():
                    job.stop()
    rows = []
    for name, values in results.items():
        s = Summary.of(values)
        rows.append([name, str(s.n), "%.3f" % (s.median * 1e3), "%.3f-%.3f" % (s.q1 * 1e3, s.q3 * 1e3),
                     "%.3f-%.3f" % (s.low * 1e3, s.high * 1e3), str(min(steps[name]))])
    print(table(rows, ["median step (wall), 2 ranks", "rounds", "median ms", "IQR ms", "min-max ms",
                       "steps a window (least)"]))
    for kind, values in ratios.items():
        s = Summary.of(values)
        print("%s: watch on / off, per round: median %.4f, IQR %.4f-%.4f, min-max %.4f-%.4f"
              % (kind, s.median, s.q1, s.q3, s.low, s.high))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--skip-stall", action="store_true")
    parser.add_argument("--stall-traced", action="store_true", help="the stalled jobs run the torch trace "
                        "(PROBE_TORCH_TRACE=1): their records hold its last rows")
    parser.add_argument("--skip-cost", action="store_true")
    args = parser.parse_args()
    import torch

    base = tempfile.mkdtemp(prefix="bench-watch-")
    os.chmod(base, 0o700)
    header("The stall watch: stall -> record with %d ranks, and its cost on a job that makes progress" % args.ranks,
           ["torch %s, gloo on the CPU, %d CPUs (shared), load average %.1f at start"
            % (torch.__version__, os.cpu_count() or 0, os.getloadavg()[0])])
    try:
        if not args.skip_stall:
            stall_runs(base, args.ranks, args.runs, args.stall_traced)
            print()
        if not args.skip_cost:
            cost_rounds(base, args.rounds, args.window)
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
