"""Run every benchmark of this directory in turn, with its default number of runs.

    python bench/run_all.py [--quick]

``--quick`` passes a small ``--runs`` to each (a smoke run, not figures to report: no record is written).
Each benchmark runs as its own process, bounded in time; the output goes to stdout as it comes, and each
writes its run's record under bench/results/ (see bench/report.py).
"""

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = ["bench_backtrace.py", "bench_pause.py", "bench_query.py", "bench_memory.py"]
QUICK_RUNS = {"bench_backtrace.py": 3, "bench_pause.py": 3, "bench_query.py": 3, "bench_memory.py": 2}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few runs each: a smoke test")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds allowed to each benchmark")
    args = parser.parse_args()
    failed = []
    for script in SCRIPTS:
        argv = [sys.executable, os.path.join(HERE, script)]
        if args.quick:
            argv += ["--runs", str(QUICK_RUNS[script])]
        sys.stdout.flush()
        env = dict(os.environ, BENCH_RECORD="0") if args.quick else None  # a smoke run is no figure to keep
        try:
            if subprocess.run(argv, timeout=args.timeout, check=False, env=env).returncode != 0:
                failed.append(script)
        except subprocess.TimeoutExpired:
            print("%s: timed out after %.0f s" % (script, args.timeout))
            failed.append(script)
        print()
    if failed:
        print("failed: %s" % ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
