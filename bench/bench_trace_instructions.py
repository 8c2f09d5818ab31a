"""Tracing overhead on a training step in instructions (valgrind's callgrind), untraced vs traced.

    python bench/bench_trace_instructions.py [--steps 4] [--model mlp|transformer] [--jobs 2]

Wall-clock overhead of a few per cent drowns in the noise of a shared 2-core machine (bench_trace.py's
side-by-side runs spread by about +-10 %). An instruction count does not: callgrind counts the same
total for the same program and inputs, whatever else the machine runs. Each setting runs a child
training loop twice under callgrind, with STEPS and 2 x STEPS measured steps after the same warm-up
(and, when traced, the same trace start); the difference of the two totals divided by STEPS is the
cost of one step, start-up and warm-up cancelled out. Reported: instructions per step and the
overhead against the untraced loop. Instructions are not seconds (cache misses, the GIL and memory
bandwidth are not in them), so this complements the wall-clock figure rather than replacing it.
Needs valgrind (apt-get install valgrind); a setting takes one to three minutes.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SETTINGS = {"untraced": None, "forward, every step": {}, "forward, --every 10": {"every": 10},
            "forward + backward": {"backward": True}}


def child(model: str, setting: str, steps: int) -> None:
    """The measured program: warm up, maybe start the trace, run ``steps`` steps."""
    import torch

    sys.path.insert(0, HERE)
    from bench_trace import models

    make = {"mlp": list(models(torch).values())[0], "transformer": list(models(torch).values())[1]}[model]
    torch.manual_seed(0)
    step = make()
    for _ in range(3):
        step()
    options = SETTINGS[setting]
    if options is not None:
        from probe.tables.torch import trace
        from probe.tables.torch.trace_options import TraceOptions

        trace.start(TraceOptions(**options))
        for _ in range(10):  # the first steps name the modules; a full --every cycle
            step()
    for _ in range(steps):
        step()


def count(model: str, setting: str, steps: int) -> int:
    """Total instructions of one child run under callgrind."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cg.out")
        env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("PROBE", None)
        done = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=" + out, sys.executable,
                               os.path.abspath(__file__), "--child", model, setting, str(steps)],
                              capture_output=True, text=True, env=env, timeout=1800)
        found = re.findall(r"Collected : (\d+)", done.stderr)
        if done.returncode != 0 or not found:
            raise RuntimeError("callgrind run failed (%s, %s, %d): %s" % (model, setting, steps, done.stderr[-1500:]))
        return int(found[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="a multiple of 10, so --every 10 is sampled fairly")
    parser.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    parser.add_argument("--jobs", type=int, default=2, help="callgrind runs at once")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return
    runs: List[Tuple[str, int]] = [(s, n) for s in SETTINGS for n in (args.steps, 2 * args.steps)]
    with ThreadPoolExecutor(args.jobs) as pool:
        totals = dict(zip(runs, pool.map(lambda run: count(args.model, run[0], run[1]), runs)))
    per_step: Dict[str, float] = {s: (totals[(s, 2 * args.steps)] - totals[(s, args.steps)]) / args.steps
                                  for s in SETTINGS}
    base = per_step["untraced"]
    print("model %s, %d and %d measured steps per setting, instructions per step (callgrind):" % (
        args.model, args.steps, 2 * args.steps))
    for setting, value in per_step.items():
        extra = "" if setting == "untraced" else "  overhead %+.3f %%" % ((value / base - 1.0) * 100)
        print("  %-22s %14.0f%s" % (setting, value, extra))


if __name__ == "__main__":
    main()
