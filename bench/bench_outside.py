"""``probe PID backtrace`` on a process whose GIL is held by a C call, next to ``py-spy dump``.

    python bench/bench_outside.py [--runs 11]

The target (bench/targets/gil.py, ``PROBE=1``) holds the GIL in libc ``sleep()`` called through
``ctypes.PyDLL``: its agent cannot run. Four commands are timed whole (spawn to exit):

* ``probe PID backtrace`` right after the GIL was taken (the first look: the agent's heartbeat is still
  fresh, so the client sends its request, and decides once the kernel shows the agent's accept thread
  waiting for the GIL while the holder never lets go: ``probe.client.outside``);
* a later look, 0.6-1.9 s after the agent's last heartbeat (decided before sending: the holder has made
  no voluntary switch since the first look saw it keep the GIL, and the agent has not beaten);
* a look once the heartbeat is older than 2.5 s (decided at once, by one read from outside);
* ``py-spy dump --pid PID``, in each round right after each later look (not before it: py-spy's dump
  stops the process, a voluntary switch of the holder, after which a look watches the holder again);
* ``probe PID eval 1`` on a second fresh target of the round, as soon as its holder is in its sleep: a
  request that fails where the agent is called blocked (exit 5 here), so it is decided on the evidence
  of the rule the quick one replaced (0.3 s, a heartbeat 0.45 s stale, a 0.35 s watch), not the quick
  rule's (for information: no goal).

The first look needs a fresh target each round, so each round starts one and times the first look as
soon as the holder thread is in its sleep. Ratios are of the medians, against py-spy's in the same run.
DESIGN: first look <= 0.4 s, later looks <= 0.15 s.
"""

import argparse
import os
import subprocess
import time
from typing import Dict, List

from _common import Summary, Target, clean_env, figure, header, summary_table, time_command, tool, verdict

FIRST_S, LATER_S = 0.4, 0.15
EVAL = "probe PID eval 1, first look (exit 5)"
FIRST, LATER, STALE, PYSPY = ("probe PID backtrace, first look", "probe PID backtrace, later look (heartbeat 0.6-1.9 s)",
                              "probe PID backtrace, heartbeat > 2.5 s", "py-spy dump --pid PID")


def in_sleep(pid: int) -> bool:
    try:
        with open("/proc/%d/task/%d/syscall" % (pid, pid)) as handle:
            return handle.read().split()[0] in ("35", "230")
    except (OSError, IndexError):
        return False


def _age(path: str) -> float:
    return time.time() - os.stat(path).st_mtime


def _time_refused(argv: List[str]) -> float:
    """Wall time of a command that must exit 5 (the agent cannot answer)."""
    start = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60, env=clean_env())
    elapsed = time.perf_counter() - start
    if done.returncode != 5:
        raise RuntimeError("%s: rc %d, not 5: %s" % (" ".join(argv), done.returncode, done.stderr.decode()[-300:]))
    return elapsed


def measure(runs: int) -> Dict[str, List[float]]:
    probe, pyspy = tool("probe"), tool("py-spy")
    results: Dict[str, List[float]] = {FIRST: [], LATER: [], STALE: [], PYSPY: [], EVAL: []}
    for _ in range(runs):
        with Target("gil.py") as target:
            deadline = time.monotonic() + 10
            while not in_sleep(target.pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            results[EVAL].append(_time_refused([probe, str(target.pid), "eval", "1"]))
        with Target("gil.py") as target:
            deadline = time.monotonic() + 10
            while not in_sleep(target.pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            pid = str(target.pid)
            results[FIRST].append(time_command([probe, pid, "backtrace"]))
            for name, low, high in ((LATER, 0.6, 1.9), (STALE, 2.5, 60.0)):
                # probe's look first, then py-spy: py-spy's dump stops the process (ptrace), which wakes the
                # holder out of its sleep for a moment, a voluntary switch; the next look then cannot take
                # the first one's word that the holder kept the GIL since, and watches again (0.2 s).
                for which in (name, PYSPY):
                    while _age(target.socket) < low:
                        time.sleep(0.02)
                    if which == PYSPY:
                        results[PYSPY].append(time_command([pyspy, "dump", "--pid", pid]))
                        continue
                    if _age(target.socket) > high:  # a slow py-spy run took the window: this round has none
                        continue
                    results[name].append(time_command([probe, pid, "backtrace"]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=11)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    header("Backtrace of a process whose GIL a C call holds: probe (read from outside) vs py-spy",
           ["%d rounds, a fresh target each; whole commands" % args.runs,
            "DESIGN: first look <= %.2f s, later looks <= %.2f s" % (FIRST_S, LATER_S)])
    results = measure(args.runs)
    print("load average (1 min) %.1f before, %.1f after, on %d cores" % (load, os.getloadavg()[0], os.cpu_count()))
    print(summary_table(results))
    pyspy = Summary.of(results[PYSPY]).median
    for name, goal in ((FIRST, FIRST_S), (LATER, LATER_S), (STALE, LATER_S)):
        s = Summary.of(results[name])
        figure(name, results[name], peer=PYSPY, peer_values=results[PYSPY], goal="<= %.2f s" % goal,
               met=s.median <= goal)
        print("%s: median %.0f ms (IQR %.0f-%.0f), %.1fx py-spy; <= %.2f s: %s"
              % (name, s.median * 1000, s.q1 * 1000, s.q3 * 1000, s.median / pyspy, goal, verdict(s.median <= goal)))


if __name__ == "__main__":
    main()
