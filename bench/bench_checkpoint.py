"""``probe PID checkpoint`` of a 100 M-parameter model against a plain ``torch.save`` run by ``probe PID eval``.

    python bench/bench_checkpoint.py [--runs 4] [--layers 6] [--width 4096]

The target (bench/targets/big_model.py, ``PROBE=1``) holds a 100.7 M-parameter model (6 x
Linear(4096, 4096)) and SGD with momentum in ``__main__`` (state dicts: 806 MB), and its main thread
runs a busy loop that records the longest gap between two iterations. Each round, interleaved (A B B A
...), opens a gap window, runs one whole command, and closes the window:

* ``probe PID checkpoint DIR/a.pt``: temporary file, fsync, rename, directory fsync, sha256 while writing;
  the busy loop makes no optimizer step, so the command waits 2 s for one (it would write between two
  steps) and then writes alongside the loop, as for a hung job;
* ``probe PID checkpoint --concurrent DIR/c.pt``: the same without that wait;
* ``probe PID eval "torch.save({'model': model.state_dict(), 'optimizer': optimizer.state_dict()}, DIR/b.pt)"``:
  what one would type without the command (no fsync, written in place).

Reported: the command's wall time and the main loop's longest pause during it, median, IQR and
min-max over the runs. The files go to a temporary directory on the same file system as /tmp.
"""

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Callable, Dict, List, Tuple

from _common import Summary, Target, figure, header, table, time_command, tool


def gap(target: Target) -> float:
    target.send("gap")
    line = target.read_line(60.0)
    if not line.startswith("GAP "):
        raise RuntimeError("target did not report its gap: %r" % line)
    return float(line.split()[1])


def measured(target: Target, argv: List[str]) -> Callable[[], Tuple[float, float]]:
    def run() -> Tuple[float, float]:
        gap(target)
        took = time_command(argv, timeout=600)
        return took, gap(target)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=4096)
    args = parser.parse_args()
    params = args.layers * (args.width * args.width + args.width)
    header("Checkpoint of a %.1f M-parameter model: probe checkpoint vs torch.save through eval" % (params / 1e6),
           ["%d runs each, interleaved, 1 warm-up round; the main loop's longest pause per command" % args.runs,
            "target: bench/targets/big_model.py --layers %d --width %d (model + SGD momentum)" % (args.layers,
                                                                                                args.width)])
    probe = tool("probe")
    directory = tempfile.mkdtemp(prefix="probe-bench-ckpt-")
    try:
        with Target("big_model.py", "--layers", str(args.layers), "--width", str(args.width),
                    ready_timeout=300) as target:
            a, b, c = (os.path.join(directory, n) for n in ("a.pt", "b.pt", "c.pt"))
            code = ("torch.save({'model': model.state_dict(), 'optimizer': optimizer.state_dict()}, %r)" % b)
            runners: Dict[str, Callable[[], Tuple[float, float]]] = {
                "probe checkpoint": measured(target, [probe, str(target.pid), "--timeout", "600", "checkpoint",
                                                      "--overwrite", a]),
                "probe checkpoint --concurrent": measured(target, [probe, str(target.pid), "--timeout", "600",
                                                                   "checkpoint", "--overwrite", "--concurrent", c]),
                "torch.save via probe eval": measured(target, [probe, str(target.pid), "--timeout", "600", "eval",
                                                               "--eval-timeout", "300", code]),
            }
            results: Dict[str, List[Tuple[float, float]]] = {name: [] for name in runners}
            for name in runners:
                runners[name]()  # warm-up
            for i in range(args.runs):
                for name in (list(runners) if i % 2 == 0 else list(runners)[::-1]):
                    results[name].append(runners[name]())
            sizes = {name: os.path.getsize(path) for name, path in (("probe checkpoint", a),
                                                                   ("probe checkpoint --concurrent", c),
                                                                   ("torch.save via probe eval", b))}
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    rows = []
    for name, values in results.items():
        took, paused = Summary.of(v[0] for v in values), Summary.of(v[1] for v in values)
        rows.append([name, str(took.n), "%.0f MB" % (sizes[name] / 1e6),
                     "%.2f [%.2f-%.2f] (%.2f-%.2f)" % (took.median, took.q1, took.q3, took.low, took.high),
                     "%.1f [%.1f-%.1f] (%.1f-%.1f)" % (paused.median, paused.q1, paused.q3, paused.low, paused.high)])
    print(table(rows, ["what", "n", "file", "command s: median [IQR] (min-max)",
                       "longest pause ms: median [IQR] (min-max)"]))
    probe_took = Summary.of(v[0] for v in results["probe checkpoint"]).median
    eval_took = Summary.of(v[0] for v in results["torch.save via probe eval"]).median
    print("ratio of medians, probe checkpoint / torch.save via eval: time %.2fx" % (probe_took / eval_took))
    peer = "torch.save via probe eval"
    for name, values in results.items():
        if name != peer:
            figure("%s, command time" % name, [v[0] for v in values], peer=peer, unit="s", scale=1.0,
                   peer_values=[v[0] for v in results[peer]])
            figure("%s, the training loop's longest pause" % name, [v[1] for v in values], peer=peer, scale=1.0,
                   peer_values=[v[1] for v in results[peer]])
    sys.stdout.flush()


if __name__ == "__main__":
    start = time.time()
    main()
    print("(%.0f s)" % (time.time() - start))
