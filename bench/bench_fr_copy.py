"""The Flight Recorder's copy (``probe.tables.torch.fr_copy``, issue 37 item 2): what keeping it costs a rank.

    python bench/bench_fr_copy.py [--sizes 200,2000] [--dumps 15] [--rounds 4] [--window 8]

In one process, a 1-rank gloo process group with ``TORCH_FR_BUFFER_SIZE`` = the largest size:

* per buffer size (the recorder filled with that many all_reduces): torch's ``_dump_fr_trace_json`` alone,
  the whole copy (the dump, the header, the file written and renamed: ``fr_copy._copy``), the GIL the
  dump keeps (a spinning thread's loop count during dumps against during as long a sleep), the file's
  size, and the reader's time (``probe.diagnose.fr_copy.read``, its rows and the per-group summary);
* one look (every group's number read and written into the file's mapped page: what the accept thread
  does every 0.25 s and the step hook after each step), us;
* a training loop (an MLP, an all_reduce of the loss and an SGD step; 1 intra-op thread; the recorder
  full at the largest size) in windows of
  ``--window`` s with the keeper on (a look every 0.25 s on a thread, as the accept thread does, and after
  each step) interleaved with windows with it off (A B B A): steps a second, the process's CPU a step
  (the dumps run on a thread of their own), and the copies' CPU share of the time. The copies' interval is
  ``max(PROBE_FR_COPY_EVERY, a copy's CPU time / MAX_SHARE)``: at most ``MAX_SHARE`` (0.2 %) of the time. The training
  comparison runs the keeper at PROBE_FR_COPY_EVERY=2, five times its default, so that windows hold copies.
"""

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import Summary, figure, header, table  # noqa: E402


def _gil_share(dump: Any, runs: int) -> float:
    """The share of a dump's time during which another thread could not run (it keeps the GIL)."""
    stop, count = [False], [0]

    def spin() -> None:
        while not stop[0]:
            count[0] += 1

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    time.sleep(0.1)
    start, before = time.perf_counter(), count[0]
    for _ in range(runs):
        dump(True, False)
    took, during = time.perf_counter() - start, count[0] - before
    before = count[0]
    time.sleep(took)
    idle = count[0] - before
    stop[0] = True
    thread.join(5)
    return max(0.0, 1.0 - during / idle) if idle else 0.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="200,2000", help="recorder sizes; the last is the training loop's")
    parser.add_argument("--dumps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--window", type=float, default=8.0)
    args = parser.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))
    run_dir = tempfile.mkdtemp(prefix="bench-fr-copy-")
    os.environ["PROBE_RUNTIME_DIR"] = run_dir
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(max(sizes))
    os.environ["PROBE_FR_COPY_EVERY"] = "2"
    import torch
    import torch.distributed as dist

    from probe.diagnose import fr_copy as reader
    from probe.tables.torch import fr_copy

    torch.set_num_threads(1)
    header("The Flight Recorder's copy: torch's dump, the copy, the reader, and a training loop with the keeper "
           "on and off", ["torch %s, gloo, 1 rank, 1 intra-op thread; TORCH_FR_BUFFER_SIZE=%d; runtime dir %s"
                          % (torch.__version__, max(sizes), run_dir)])
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    from torch._C._distributed_c10d import _dump_fr_trace_json as dump

    tensor = torch.ones(1000)
    issued = 0
    rows: List[List[str]] = []
    for size in sizes:
        while issued < size:
            dist.all_reduce(tensor)
            issued += 1
        dump(True, False)  # warm
        dumps, copies, copies_cpu, reads = [], [], [], []
        for _ in range(args.dumps):
            start = time.perf_counter()
            raw = dump(True, False)
            dumps.append(time.perf_counter() - start)
        fr_copy.look()  # a look: the file, the dump thread, which it asks for a dump (waited for: no overlap)
        deadline = time.monotonic() + 30
        while fr_copy._state["copy_seq"].get("0") != issued and time.monotonic() < deadline:
            time.sleep(0.01)
        for _ in range(args.dumps):
            start = time.perf_counter()
            fr_copy._copy()
            copies.append(time.perf_counter() - start)
            copies_cpu.append(fr_copy._state["copy_s"])
            start = time.perf_counter()
            header_read, entries, why = reader.read(os.getpid())
            reader.summary(reader.rows_of(entries), time.time())
            reads.append(time.perf_counter() - start)
        assert header_read is not None and len(entries) == size and why is None, (why, len(entries))
        gil = _gil_share(dump, max(3, args.dumps // 3))
        d, c, r, cc = Summary.of(dumps), Summary.of(copies), Summary.of(reads), Summary.of(copies_cpu)
        rows.append([str(size), "%.2f" % (d.median * 1e3), "%.2f-%.2f" % (d.q1 * 1e3, d.q3 * 1e3),
                     "%.2f" % (c.median * 1e3), "%.2f" % (cc.median * 1e3), "%.0f %%" % (gil * 100),
                     "%.0f" % (len(raw) / 1024), "%.2f" % (r.median * 1e3), "%.1f" % (100 * cc.median / 2.0),
                     "%.1f" % max(fr_copy.DEFAULT_EVERY, cc.median / fr_copy.MAX_SHARE)])
        figure("dump of %d entries (_dump_fr_trace_json)" % size, dumps)
        figure("copy of %d entries (dump + write)" % size, copies)
        figure("copy of %d entries, its CPU (what the MAX_SHARE cap counts)" % size, copies_cpu)
        figure("read of a copy of %d entries (rows + summary)" % size, reads)
    print(table(rows, ["entries", "dump ms", "IQR", "copy ms", "copy CPU ms", "GIL kept", "KiB", "read ms",
                       "% CPU at 1 copy / 2 s", "interval s (default, cap)"]))
    print()

    looks = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(2000):
            fr_copy._look(False)
        looks.append((time.perf_counter() - start) / 2000)
    print("one look (every group's number read and written to the mapped page; a step's end does the same): "
          "%.1f us (min of 5 x 2000; median %.1f us)" % (min(looks) * 1e6, statistics.median(looks) * 1e6))
    figure("one look (numbers into the mapped page)", looks, unit="us", scale=1e6)

    # A training loop with the keeper on and off, windows interleaved.
    torch.manual_seed(0)
    layers: List[Any] = []
    for _ in range(4):
        layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randn(32, 256)
    state: Dict[str, Any] = {"on": False, "quit": False}

    def looker() -> None:
        while not state["quit"]:
            if state["on"]:
                fr_copy.look()
            time.sleep(0.25)

    thread = threading.Thread(target=looker, daemon=True)
    thread.start()

    def window(on: bool) -> Dict[str, float]:
        state["on"] = on
        copies, spent = fr_copy._state["copies"], fr_copy._state["copies_s"]
        steps = 0
        start = time.perf_counter()
        cpu = time.process_time()
        while time.perf_counter() - start < args.window:
            loss = model(data).pow(2).mean()
            loss.backward()
            dist.all_reduce(loss.detach())
            optimizer.step()
            optimizer.zero_grad()
            if on:
                fr_copy.at_step()
            steps += 1
        wall = time.perf_counter() - start
        state["on"] = False
        return {"rate": steps / wall, "cpu": (time.process_time() - cpu) / steps, "wall": wall,
                "copies": fr_copy._state["copies"] - copies, "spent": fr_copy._state["copies_s"] - spent}

    window(False)
    got: Dict[str, List[Dict[str, float]]] = {"off": [], "on": []}
    ratios: List[float] = []
    cpu_ratios: List[float] = []
    for i in range(args.rounds):
        order = ("off", "on", "on", "off") if i % 2 == 0 else ("on", "off", "off", "on")
        here: Dict[str, List[Dict[str, float]]] = {"off": [], "on": []}
        for what in order:
            here[what].append(window(what == "on"))
        ratios += [w["rate"] / statistics.mean(x["rate"] for x in here["off"]) for w in here["on"]]
        cpu_ratios += [w["cpu"] / statistics.mean(x["cpu"] for x in here["off"]) for w in here["on"]]
        for what in here:
            got[what] += here[what]
    state["quit"] = True
    thread.join(5)
    off, on = [w["rate"] for w in got["off"]], [w["rate"] for w in got["on"]]
    shares = [w["spent"] / w["wall"] for w in got["on"]]
    share = sum(w["spent"] for w in got["on"]) / sum(w["wall"] for w in got["on"])
    copies = sum(w["copies"] for w in got["on"])
    on_s = sum(w["wall"] for w in got["on"])
    a, b, r = Summary.of(off), Summary.of(on), Summary.of(ratios)
    ca, cb, cr = (Summary.of([w["cpu"] for w in got["off"]]), Summary.of([w["cpu"] for w in got["on"]]),
                  Summary.of(cpu_ratios))
    print(table([["keeper off", str(a.n), "%.1f" % a.median, "%.1f-%.1f" % (a.q1, a.q3), "%.3f" % (ca.median * 1e3)],
                 ["keeper on", str(b.n), "%.1f" % b.median, "%.1f-%.1f" % (b.q1, b.q3), "%.3f" % (cb.median * 1e3)]],
                ["training loop (%d-entry recorder)" % max(sizes), "windows", "steps/s", "IQR",
                 "process CPU ms a step"]))
    print("on / off (per round, neighbouring windows): steps/s median %.4f, IQR %.4f-%.4f; process CPU a step "
          "median %.4f, IQR %.4f-%.4f" % (r.median, r.q1, r.q3, cr.median, cr.q1, cr.q3))
    print("with the keeper on: %d copies in %.0f s (one every %.1f s), their CPU %.2f %% of the time (a copy that "
          "runs past its window counts in the next)" % (copies, on_s, on_s / max(copies, 1), share * 100))
    figure("training steps/s with the keeper on", on, peer="keeper off", peer_values=off, unit="steps/s", scale=1.0,
           ratio=r.median, goal="<= 1 % slower", met=r.median >= 0.99)
    figure("process CPU a step with the keeper on", [w["cpu"] for w in got["on"]], peer="keeper off",
           peer_values=[w["cpu"] for w in got["off"]], ratio=cr.median)
    figure("copies' CPU share of the time (keeper on, per window)", shares, unit="%", scale=100.0, goal="about 1 %",
           met=share <= 0.02)
    print("SUMMARY fr copy: 2000-entry copy %s ms; training with the keeper on / off = %.3f; copies' CPU %.2f %% of the time"
          % (rows[[int(x[0]) for x in rows].index(2000)][3] if 2000 in sizes else "-", r.median, share * 100))
    fr_copy.remove()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
