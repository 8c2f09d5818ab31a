"""``probe ... profile`` (issue 37 item 1): a rank's step while a capture runs against while none does, and
the time from the command to one merged trace of a real torchrun job.

    python bench/bench_profile.py [--rounds 7] [--steps 20] [--ranks 8] [--runs 3]

1. In one process (CPU, one intra-op thread): an MLP (4 x Linear(256) + ReLU, batch 32) trained with SGD,
   with probe's optimizer post-step hook in (as in every agent). Blocks of ``--steps`` steps alternate
   (A B B A ...): no capture (the profile's callable is not in the hook: what every step costs outside a
   capture), and a capture of those steps (``probe.tables.torch.profile.start``, as the agent's route
   calls it; the block's first step starts it, its last stops it). Each step in CPU time of the thread
   (``time.thread_time``). A block's figure is its median step; the ratio is a capturing block over the
   mean of the blocks without on either side, median over rounds. Beside it: the stop on the training
   thread, and building the rows and the trace events afterwards (the agent's thread).
2. A real torchrun gloo job of ``--ranks`` ranks (``bench/targets/watch_train.py``, ``PROBE=1``):
   ``probe MASTER profile --steps 3 -o FILE --json``, ``--runs`` times: the whole command (start, the
   steps, fetch, merge, write) and its fetch-and-merge part, with the trace's events and size.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, List

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


def in_process(rounds: int, steps: int) -> None:
    import torch

    torch.set_num_threads(1)
    from probe.tables.torch import profile
    from probe.tables.torch.steps import install_step_hook

    header("profile: a CPU training step while a capture runs vs while none does (one process)",
           ["torch %s, 1 intra-op thread; %d rounds of %d-step blocks, A B B A" % (torch.__version__, rounds, steps)])
    block = _loop(torch)
    install_step_hook()
    block(steps)  # warm-up
    off: List[float] = []
    on: List[float] = []
    ratios: List[float] = []
    stops: List[float] = []
    builds: List[float] = []
    for i in range(rounds):
        order = ("off", "on", "on", "off") if i % 2 == 0 else ("on", "off", "off", "on")
        got = {"off": [], "on": []}  # type: dict
        for what in order:
            if what == "on":
                profile.start(steps - 1)  # begins after the block's first step, ends at its last
                got["on"].append(block(steps))
                status = profile.status()
                assert status["state"] == "done", status
                stops.append(status["stop_s"])
                began = time.perf_counter()
                profile.rows()
                profile.fetch(64 << 20)
                builds.append(time.perf_counter() - began)
            else:
                got["off"].append(block(steps))
        off += got["off"]
        on += got["on"]
        ratios.append(statistics.mean(got["on"]) / statistics.mean(got["off"]))
    s_off, s_on, s_ratio = Summary.of(off), Summary.of(on), Summary.of(ratios)
    print(table([["no capture", "%.3f" % (s_off.median * 1e3), "%.3f-%.3f" % (s_off.q1 * 1e3, s_off.q3 * 1e3)],
                 ["capturing", "%.3f" % (s_on.median * 1e3), "%.3f-%.3f" % (s_on.q1 * 1e3, s_on.q3 * 1e3)]],
                ["step (CPU ms)", "median", "IQR"]))
    print("SUMMARY profile: a step while capturing is %.2fx one without (IQR %.2f-%.2f); stop on the training "
          "thread %.1f ms; rows + trace built afterwards %.0f ms (medians)"
          % (s_ratio.median, s_ratio.q1, s_ratio.q3, statistics.median(stops) * 1e3, statistics.median(builds) * 1e3))
    figure("profile: step CPU time while capturing", on, peer="no capture", peer_values=off, ratio=s_ratio.median)
    figure("profile: stop on the training thread", stops)
    figure("profile: rows and trace built (agent thread)", builds)


def merged(ranks: int, runs: int) -> None:
    from bench_watch import Job

    header("profile: `probe MASTER profile --steps 3 -o FILE` on a real %d-rank torchrun gloo job" % ranks,
           ["bench/targets/watch_train.py, %d runs" % runs])
    base = tempfile.mkdtemp(prefix="bench-profile-")
    job = Job(base, "job", ranks)
    walls: List[float] = []
    merges: List[float] = []
    rows = []
    try:
        job.ready(ranks)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PROBE")}
        env.update(PYTHONPATH=REPO, PROBE_RUNTIME_DIR=job.run)
        for i in range(runs):
            out = os.path.join(base, "trace%d.json" % i)
            began = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "probe", "127.0.0.1:%d" % job.port, "profile", "--steps", "3",
                                   "-o", out, "--json", "--timeout", "300"], capture_output=True, text=True, env=env,
                                  timeout=400)
            wall = time.monotonic() - began
            if done.returncode != 0:
                raise SystemExit("profile failed (%d): %s" % (done.returncode, done.stderr[-2000:]))
            summary = json.loads(done.stdout)
            walls.append(wall)
            merges.append(summary["merge_s"])
            rows.append([str(i), "%.2f" % wall, "%.2f" % summary["merge_s"], str(summary["events"]),
                         "%.1f" % (os.path.getsize(out) / 1e6), str(len(summary["ranks"]))])
    finally:
        job.stop()
    print(table(rows, ["run", "command s", "fetch+merge s", "events", "MB", "ranks"]))
    print("SUMMARY profile: %d ranks: one merged trace in %.2f s (command, median; fetch and merge %.2f s)"
          % (ranks, statistics.median(walls), statistics.median(merges)))
    figure("profile: %d-rank command to one merged trace" % ranks, walls, unit="s", scale=1.0)
    figure("profile: %d-rank fetch and merge" % ranks, merges, unit="s", scale=1.0)


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
