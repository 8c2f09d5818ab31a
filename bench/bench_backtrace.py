"""``probe PID backtrace`` (the whole command) next to ``py-spy dump --pid PID``, at 65 and 257 threads.

    python bench/bench_backtrace.py [--runs 17] [--threads 65,257] [--depth 30]

Both tools are run as a user runs them: the console scripts next to ``sys.executable``, as
subprocesses, wall time from spawn to exit. The target (bench/targets/threads.py, started with
``PROBE=1``) has every thread, the main one included, ~30 Python frames deep and then blocked. Runs are
interleaved (probe, py-spy, py-spy, probe, ...) after a warm-up round. Python's own start-up
(``python -c pass``, ``python -c "import click"``, which the command no longer imports), the command's imports (``CLI_IMPORTS``)
and the request the command makes (timed from this process) are measured in the same rounds, for context.
DESIGN targets: probe <= 1.0x py-spy at 65 threads, <= 0.35x at 257.
"""

import argparse
import sys
import time
from typing import Any, Dict, List

from _common import Summary, Target, figure, header, interleave, summary_table, time_command, tool, verdict

TARGET_RATIO = {65: 1.0, 257: 0.35}
CLI_IMPORTS = "import re, probe.cli.fast, probe.cli.commands.backtrace, probe.client.discovery"
"""What ``probe PID backtrace`` imports (re: the console script's own), read without click (probe.cli.fast)."""
CLI_ROW = "python -c 'import the command's modules'"


def measure(threads: int, depth: int, runs: int) -> Dict[str, List[float]]:
    """Interleaved wall times of probe, py-spy and the two Python start-ups against one target."""
    probe, pyspy = tool("probe"), tool("py-spy")
    import probe as probe_lib

    with Target("threads.py", "--threads", str(threads), "--depth", str(depth), "--main", "block") as target:
        pid = str(target.pid)
        client = probe_lib.connect(pid)
        runners = {
            "probe PID backtrace": lambda: time_command([probe, pid, "backtrace"]),
            "py-spy dump --pid PID": lambda: time_command([pyspy, "dump", "--pid", pid]),
            "python -c pass": lambda: time_command([sys.executable, "-c", "pass"]),
            "python -c 'import click'": lambda: time_command([sys.executable, "-c", "import click"]),
            CLI_ROW: lambda: time_command([sys.executable, "-c", CLI_IMPORTS]),
            "in-process: client.backtrace()": lambda: rows_request(client),
        }
        return interleave(runners, runs)


def rows_request(client: Any) -> float:
    """Time of the request the command makes (``client.backtrace()``), from this process."""
    start = time.perf_counter()
    client.backtrace()
    return time.perf_counter() - start


def report(threads: int, results: Dict[str, List[float]]) -> bool:
    """Print the table and the probe/py-spy ratio; True when the DESIGN target is met."""
    print("--- %d threads (main included), ~30 frames each ---" % threads)
    print(summary_table(results))
    probe = Summary.of(results["probe PID backtrace"])
    pyspy = Summary.of(results["py-spy dump --pid PID"])
    start = Summary.of(results["python -c pass"])
    ratio = probe.median / pyspy.median
    paired = sorted(a / b for a, b in zip(results["probe PID backtrace"], results["py-spy dump --pid PID"]))
    target = TARGET_RATIO.get(threads)
    print("ratio probe/py-spy (medians): %.2fx; per-round ratios: median %.2fx, min-max %.2f-%.2fx"
          % (ratio, Summary.of(paired).median, paired[0], paired[-1]))
    cli = Summary.of(results[CLI_ROW])
    rows = Summary.of(results["in-process: client.backtrace()"])
    print("breakdown of the probe command (medians): Python start-up %.1f ms, + the command's imports %.1f ms, "
          "+ the request itself %.1f ms, rest (parse, render, print, exit) %.1f ms"
          % (start.median * 1000, (cli.median - start.median) * 1000, rows.median * 1000,
             (probe.median - cli.median - rows.median) * 1000))
    ok = target is None or ratio <= target
    figure("probe PID backtrace at %d threads" % threads, results["probe PID backtrace"], peer="py-spy dump --pid PID",
           peer_values=results["py-spy dump --pid PID"], goal=None if target is None else "<= %gx" % target,
           met=None if target is None else ok)
    if target is not None:
        print("DESIGN target <= %gx py-spy: %s" % (target, verdict(ok)))
    print()
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=17)
    parser.add_argument("--threads", default="65,257", help="comma-separated thread counts")
    parser.add_argument("--depth", type=int, default=30)
    args = parser.parse_args()
    header("probe PID backtrace vs py-spy dump --pid PID (whole commands, wall time)",
           ["%d interleaved runs per tool and thread count, after 1 warm-up round" % args.runs,
            "DESIGN: <= 1.0x py-spy at 65 threads, <= 0.35x at 257"])
    for threads in (int(t) for t in args.threads.split(",")):
        report(threads, measure(threads, args.depth, args.runs))


if __name__ == "__main__":
    main()
