"""``probe ... profile`` (issue 37 item 1) beside torch's own debug server: a rank's step while a capture runs
against while none does, and the time from the command to the ranks' traces of a real torchrun job.

    python bench/bench_profile.py [--rounds 7] [--steps 20] [--ranks 8] [--runs 3]

1. In one process (CPU, one intra-op thread): an MLP (4 x Linear(256) + ReLU, batch 32) trained with SGD,
   with probe's optimizer post-step hook in (as in every agent). Blocks of ``--steps`` steps, in an order
   rotated each round: no capture (the profile's callable is not in the hook: what every step costs
   outside a capture); a capture by probe (``probe.tables.torch.profile.start``, as the agent's route calls
   it; the block's first step starts it, its last stops it), without and with input shapes; and a capture
   by torch's debug server: its worker server (``torch._C._distributed_c10d._WorkerServer`` on 127.0.0.1,
   the one ``start_debug_server`` starts on every rank) asked for ``/handler/torch_profile?duration=D``
   (the route its frontend's ``/profile`` fans out to the ranks: ``torch.profiler`` with shapes and
   ``profile_all_threads`` for D seconds, then its Chrome trace), the block run once its profiler is on and
   within D. Each step in CPU time of the training thread (``time.thread_time``). A block's figure is its
   median step; each ratio is a capturing block over the block without in the same round, median over
   rounds. Beside it: probe's stop on the training thread, and building its rows and trace events.
2. A real torchrun gloo job of ``--ranks`` ranks (``bench/targets/watch_train.py``, ``PROBE=1``, torch's
   debug server started in every rank, 0.3 s slept in each step: 3 steps last about torch's shortest
   capture): ``--runs`` times, interleaved, (a) ``probe MASTER profile --steps 3 -o FILE --json``: the
   whole command (start, the steps, fetch, merge, write one trace), its fetch-and-merge part, and the time
   beyond the capture itself; (b) torch's frontend ``/profile?duration=1``
   (its shortest, in whole seconds): the page with every rank's trace, one Perfetto view per rank: it
   merges nothing, so its figure is the time to have the ranks' traces, and the time beyond its 1 s.
   Beside them the probe command's own start (``python -m probe --version``): torch's page is asked from
   the running bench, with no process to start.

dynolog (Meta's daemon that asks Kineto for an on-demand trace per process) is the other peer the issue
names: it is not installed here and this machine has no network, so it is not measured.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import REPO, Summary, figure, header, table  # noqa: E402


def _loop(torch: Any) -> Any:
    torch.manual_seed(0)
    layers: List[Any] = []
    for _ in range(4):
        layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randn(32, 256)

    def block(steps: int) -> float:
        times = []
        for _ in range(steps):
            start = time.thread_time()
            loss = model(data).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.thread_time() - start)
        return statistics.median(times[1:])  # the first carries the start of a capture
    return block


class _TooShort(Exception):
    """torch's capture ended before the block did."""


class _TorchServer:
    """torch's debug server's worker server in this process, on 127.0.0.1: its ``torch_profile`` handler
    asked as its frontend asks it (POST), on a thread, while the training loop runs its block."""

    def __init__(self, torch: Any) -> None:
        import torch.distributed.debug._handlers  # noqa: F401  (registers torch_profile, as start_debug_server does)
        from torch._C._distributed_c10d import _WorkerServer

        self.torch = torch
        self.server = _WorkerServer("127.0.0.1", 0)
        self.answer: Any = None

    def block(self, block: Any, steps: int, duration: float) -> Tuple[float, int]:
        """The block's median step CPU time while torch's profiler runs, and the events its trace holds."""
        import threading
        import urllib.request

        autograd_profiler = self.torch.autograd.profiler

        def enabled() -> bool:  # the process's flag (torch._C._autograd._profiler_enabled() is this thread's)
            return bool(autograd_profiler._is_profiler_enabled)

        def ask() -> None:
            request = urllib.request.Request("http://127.0.0.1:%d/handler/torch_profile?duration=%g"
                                             % (self.server.port, duration), data=b"")
            self.answer = urllib.request.urlopen(request, timeout=duration + 120).read()

        self.answer = None
        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        deadline = time.monotonic() + 30
        while not enabled() and time.monotonic() < deadline:
            time.sleep(0.001)
        if not enabled():
            raise SystemExit("torch's debug server did not start its profiler within 30 s")
        step = block(steps)
        within = enabled()
        asking.join(duration + 150)
        if self.answer is None:
            raise SystemExit("torch's debug server gave no trace")
        if not within:
            raise _TooShort()
        events = json.loads(self.answer).get("traceEvents", [])
        return step, sum(1 for e in events if e.get("ph") == "X")

    def close(self) -> None:
        self.server.shutdown()


def in_process(rounds: int, steps: int) -> None:
    import torch

    torch.set_num_threads(1)
    from probe.tables.torch import profile
    from probe.tables.torch.steps import install_step_hook

    header("profile: a CPU training step while a capture runs vs while none does (one process), probe beside "
           "torch's debug server",
           ["torch %s, 1 intra-op thread; %d rounds of %d-step blocks, the order rotated each round"
            % (torch.__version__, rounds, steps)])
    block = _loop(torch)
    install_step_hook()
    block(steps)  # warm-up
    server = _TorchServer(torch)
    arms = ("off", "probe", "probe-shapes", "torch")
    got: Dict[str, List[float]] = {arm: [] for arm in arms}
    ratios: Dict[str, List[float]] = {arm: [] for arm in arms[1:]}
    stops: List[float] = []
    builds: List[float] = []
    torch_events: List[int] = []
    began = time.perf_counter()
    block(steps)
    duration = max(2.0, 40 * (time.perf_counter() - began))  # torch's capture outlasts the block, by far
    try:
        for i in range(rounds):
            this: Dict[str, float] = {}
            for arm in arms[i % len(arms):] + arms[:i % len(arms)]:
                if arm == "torch":
                    for _ in range(3):  # a loaded box can stretch the block past torch's capture: again, longer
                        try:
                            this[arm], events = server.block(block, steps, duration)
                            break
                        except _TooShort:
                            duration *= 2
                    else:
                        raise SystemExit("torch's capture of %g s ended before the block did, three times" % duration)
                    torch_events.append(events)
                elif arm.startswith("probe"):
                    profile.start(steps - 1, shapes=arm == "probe-shapes")  # after the block's first step, to its last
                    this[arm] = block(steps)
                    status = profile.status()
                    assert status["state"] == "done", status
                    stops.append(status["stop_s"])
                    built = time.perf_counter()
                    profile.rows()
                    profile.fetch(64 << 20)
                    builds.append(time.perf_counter() - built)
                else:
                    this[arm] = block(steps)
            for arm in arms:
                got[arm].append(this[arm])
            for arm in arms[1:]:
                ratios[arm].append(this[arm] / this["off"])
    finally:
        server.close()
    rows = []
    for arm, label in zip(arms, ("no capture", "probe capturing", "probe capturing, --shapes",
                                 "torch debug server capturing (shapes, all threads)")):
        summary = Summary.of(got[arm])
        ratio = Summary.of(ratios[arm]) if arm in ratios else None
        rows.append([label, "%.3f" % (summary.median * 1e3), "%.3f-%.3f" % (summary.q1 * 1e3, summary.q3 * 1e3),
                     "%.2fx (%.2f-%.2f)" % (ratio.median, ratio.q1, ratio.q3) if ratio else ""])
    print(table(rows, ["step (CPU ms)", "median", "IQR", "over no capture (IQR)"]))
    s_probe, s_torch = Summary.of(ratios["probe"]), Summary.of(ratios["torch"])
    print("SUMMARY profile: a step while capturing is %.2fx one without (IQR %.2f-%.2f); stop on the training "
          "thread %.1f ms; rows + trace built afterwards %.0f ms (medians)"
          % (s_probe.median, s_probe.q1, s_probe.q3, statistics.median(stops) * 1e3, statistics.median(builds) * 1e3))
    print("SUMMARY profile: torch's debug server capturing (shapes, all threads): a step is %.2fx one without "
          "(IQR %.2f-%.2f); probe with --shapes %.2fx; torch's trace held %d events a capture (median)"
          % (s_torch.median, s_torch.q1, s_torch.q3, statistics.median(ratios["probe-shapes"]),
             statistics.median(torch_events)))
    figure("profile: step CPU time while capturing", got["probe"], peer="no capture", peer_values=got["off"],
           ratio=s_probe.median)
    figure("profile: step CPU time while capturing, --shapes", got["probe-shapes"], peer="no capture",
           peer_values=got["off"], ratio=statistics.median(ratios["probe-shapes"]))
    figure("profile: torch debug server: step CPU time while capturing", got["torch"], peer="no capture",
           peer_values=got["off"], ratio=s_torch.median)
    figure("profile: step CPU time while capturing, probe --shapes vs torch debug server", got["probe-shapes"],
           peer="torch debug server", peer_values=got["torch"])
    figure("profile: stop on the training thread", stops)
    figure("profile: rows and trace built (agent thread)", builds)


_STEP_SLEEP = 0.3
"""Slept in each step of the job: 3 steps last about as long as torch's shortest capture (1 s), so that both
capture about the same stretch of the job."""


def _torch_profiles(port: int, duration: float) -> Tuple[int, int]:
    """torch's frontend ``/profile?duration=D``: the page with each rank's trace (or why it has none); the
    ranks with a trace on it and its size in bytes."""
    import urllib.request

    page = urllib.request.urlopen("http://127.0.0.1:%d/profile?duration=%g" % (port, duration),
                                  timeout=duration + 180).read().decode("utf-8", "replace")
    if "Failed to fetch" in page:
        raise SystemExit("torch's debug server fetched no profile from a rank: %s" % page[-2000:])
    return page.count("<button onclick=\"run"), len(page)


def _wait_for_page(port: int, timeout: float = 120.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen("http://127.0.0.1:%d/" % port, timeout=10).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit("torch's debug server's frontend did not answer on port %d" % port)
            time.sleep(0.5)


def merged(ranks: int, runs: int) -> None:
    from bench_watch import Job, _free_port

    header("profile: the ranks' traces of a real %d-rank torchrun gloo job: `probe MASTER profile --steps 3 -o "
           "FILE` beside torch's debug server's /profile" % ranks,
           ["bench/targets/watch_train.py with torch's debug server in every rank, %d runs, interleaved" % runs,
            "dynolog (on-demand Kineto through its daemon) is not installed and there is no network: not measured"])
    base = tempfile.mkdtemp(prefix="bench-profile-")
    page_port = _free_port()
    job = Job(base, "job", ranks, TORCH_DEBUG_PORT=str(page_port), STEP_SLEEP=str(_STEP_SLEEP))
    walls: List[float] = []
    merges: List[float] = []
    beyond: List[float] = []
    torch_walls: List[float] = []
    torch_beyond: List[float] = []
    startups: List[float] = []
    duration = 1.0  # the shortest its page offers (whole seconds)
    rows = []
    try:
        job.ready(ranks)
        _wait_for_page(page_port)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PROBE")}
        env.update(PYTHONPATH=REPO, PROBE_RUNTIME_DIR=job.run)
        for i in range(runs):
            for who in (("probe", "torch") if i % 2 == 0 else ("torch", "probe")):
                if who == "torch":
                    began = time.monotonic()
                    got, size = _torch_profiles(page_port, duration)
                    wall = time.monotonic() - began
                    if got != ranks:
                        raise SystemExit("torch's page held %d traces of %d ranks" % (got, ranks))
                    torch_walls.append(wall)
                    torch_beyond.append(wall - duration)
                    rows.append(["torch /profile", str(i), "%.2f" % wall, "%.2f" % (wall - duration), "-",
                                 "%d traces, not merged" % got, "%.1f" % (size / 1e6)])
                    continue
                began = time.monotonic()
                subprocess.run([sys.executable, "-m", "probe", "--version"], capture_output=True, env=env, timeout=60)
                startups.append(time.monotonic() - began)  # the command's own start, for reference
                out = os.path.join(base, "trace%d.json" % i)
                began = time.monotonic()
                done = subprocess.run([sys.executable, "-m", "probe", "127.0.0.1:%d" % job.port, "profile", "--steps",
                                       "3", "-o", out, "--json", "--timeout", "300"], capture_output=True, text=True,
                                      env=env, timeout=400)
                wall = time.monotonic() - began
                if done.returncode != 0:
                    raise SystemExit("profile failed (%d): %s" % (done.returncode, done.stderr[-2000:]))
                summary = json.loads(done.stdout)
                if len(summary["ranks"]) != ranks:
                    raise SystemExit("probe's trace held %d of %d ranks" % (len(summary["ranks"]), ranks))
                walls.append(wall)
                merges.append(summary["merge_s"])
                beyond.append(wall - summary["captured_s"])
                rows.append(["probe profile", str(i), "%.2f" % wall, "%.2f" % (wall - summary["captured_s"]),
                             "%.2f" % summary["merge_s"], "%d ranks, %d events, one trace" % (
                                 len(summary["ranks"]), summary["events"]), "%.1f" % (os.path.getsize(out) / 1e6)])
    finally:
        job.stop()
    print(table(rows, ["what", "run", "wall s", "beyond the capture s", "fetch+merge s", "got", "MB"]))
    print("SUMMARY profile: %d ranks: one merged trace in %.2f s (command, median; fetch and merge %.2f s; %.2f s "
          "beyond the 3 steps captured)" % (ranks, statistics.median(walls), statistics.median(merges),
                                             statistics.median(beyond)))
    print("probe's start-up alone (`python -m probe --version`): %.2f s median (IQR %.2f-%.2f), part of its time "
          "beyond the capture; torch's page is asked from this running process" % (
              statistics.median(startups), Summary.of(startups).q1, Summary.of(startups).q3))
    print("SUMMARY profile: torch's debug server: %d separate traces (no merge) in %.2f s for a %g s capture "
          "(%.2f s beyond it), median" % (ranks, statistics.median(torch_walls), duration,
                                          statistics.median(torch_beyond)))
    figure("profile: %d-rank command to one merged trace" % ranks, walls, unit="s", scale=1.0,
           peer="torch debug server /profile (%d traces, not merged, %g s capture)" % (ranks, duration),
           peer_values=torch_walls)
    figure("profile: %d-rank time beyond the capture" % ranks, beyond, unit="s", scale=1.0,
           peer="torch debug server /profile", peer_values=torch_beyond)
    figure("profile: %d-rank fetch and merge" % ranks, merges, unit="s", scale=1.0)
    figure("profile: probe CLI start-up (--version)", startups, unit="s", scale=1.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    in_process(args.rounds, args.steps)
    if args.ranks:
        merged(args.ranks, args.runs)


if __name__ == "__main__":
    main()
