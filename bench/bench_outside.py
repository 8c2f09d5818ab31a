"""``probe PID backtrace`` on a process whose GIL is held by a C call, next to ``py-spy dump``.

    python bench/bench_outside.py [--runs 11]

The target (bench/targets/gil.py, ``PROBE=1``) holds the GIL in libc ``sleep()`` called through
``ctypes.PyDLL``: its agent cannot run. Three commands are timed whole (spawn to exit), interleaved:

* ``probe PID backtrace`` right after the GIL was taken (the first look: the client waits 0.3 s for
  the agent, reads the process from outside and watches the GIL holder for 0.25 s);
* the same once the agent's heartbeat is stale (every later look: decided before sending);
* ``py-spy dump --pid PID``.

The first look needs a fresh target each round (the heartbeat goes stale after 2.5 s), so each round
starts one and times the first look as soon as the holder thread is in its sleep.
DESIGN: <= 1.5 s, whole command.
"""

import argparse
import time
from typing import Dict, List

from _common import Summary, Target, header, summary_table, time_command, tool, verdict

TARGET_S = 1.5


def in_sleep(pid: int) -> bool:
    try:
        with open("/proc/%d/task/%d/syscall" % (pid, pid)) as handle:
            return handle.read().split()[0] in ("35", "230")
    except (OSError, IndexError):
        return False


def measure(runs: int) -> Dict[str, List[float]]:
    probe, pyspy = tool("probe"), tool("py-spy")
    results: Dict[str, List[float]] = {"probe PID backtrace (first look)": [],
                                       "probe PID backtrace (heartbeat stale)": [], "py-spy dump --pid PID": []}
    for i in range(runs):
        with Target("gil.py") as target:
            deadline = time.monotonic() + 10
            while not in_sleep(target.pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            pid = str(target.pid)
            first = time_command([probe, pid, "backtrace"])
            results["probe PID backtrace (first look)"].append(first)
            while time.time() - _mtime(target.socket) < 3.0:
                time.sleep(0.1)
            order = ["stale", "pyspy"] if i % 2 == 0 else ["pyspy", "stale"]
            for name in order:
                if name == "stale":
                    results["probe PID backtrace (heartbeat stale)"].append(time_command([probe, pid, "backtrace"]))
                else:
                    results["py-spy dump --pid PID"].append(time_command([pyspy, "dump", "--pid", pid]))
    return results


def _mtime(path: str) -> float:
    import os

    return os.stat(path).st_mtime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=11)
    args = parser.parse_args()
    header("Backtrace of a process whose GIL a C call holds: probe (read from outside) vs py-spy",
           ["%d rounds, a fresh target each; whole commands" % args.runs, "DESIGN: <= 1.5 s"])
    results = measure(args.runs)
    print(summary_table(results))
    pyspy = Summary.of(results["py-spy dump --pid PID"]).median
    for name in ("probe PID backtrace (first look)", "probe PID backtrace (heartbeat stale)"):
        s = Summary.of(results[name])
        print("%s: median %.0f ms, %.1fx py-spy; <= %.1f s: %s" % (name, s.median * 1000, s.median / pyspy, TARGET_S,
                                                                  verdict(s.high <= TARGET_S)))


if __name__ == "__main__":
    main()
