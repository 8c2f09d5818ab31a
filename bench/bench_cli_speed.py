"""The whole ``probe`` command, as people run it in loops (issue 24): where its time goes, and how it
compares with its peers measured in the same rounds.

    python bench/bench_cli_speed.py [--runs 21] [--threads 65,257] [--importtime 7] [--no-clean-site]

1. ``probe PID backtrace`` against ``py-spy dump --pid PID`` (both console scripts next to
   ``sys.executable``, as subprocesses, wall time from spawn to exit), on bench/targets/threads.py with
   65 and 257 threads ~30 frames deep and a busy main thread (``--main spin``, ``PROBE=1``); and ``probe PID
   query "SELECT func, file, lineno, depth FROM python.backtrace ORDER BY depth LIMIT 10"`` against that
   65-thread target and against one whose main thread is blocked (idle, the figure checked against the
   goal); ``python -c pass`` in the same rounds; and at 65 threads the backtrace read by click
   (``PROBE_CLI_FAST=0``), as every command was before ``probe.cli.fast``. Interleaved (A B C ... C B A), after a
   warm-up round; medians, IQR, min-max and the per-round ratios.
2. The same commands run by the same interpreter and packages without this machine's ``.pth`` start-up
   hooks in site-packages (``--no-clean-site`` leaves this out): a virtual environment in a temporary
   directory whose only ``.pth`` puts the repository and the site-packages directories on ``sys.path``
   and starts an agent under ``PROBE=1`` as probe's own does. The sandbox this was written on imports
   certifi in a ``.pth`` at every Python start (some 20 ms), which a user's machine does not have and
   py-spy, a Rust binary, never pays.
3. Where each command's time goes: ``backtrace``, ``query``, ``health``, ``list`` and ``ranks`` (a 1-rank
   job of tests/targets/rank_states.py under Slurm's variables, its node helper answering), each whole
   (median of the rounds) next to ``python -c pass`` and its imports (``python -X importtime -m probe
   ...``, the best of ``--importtime`` runs: the modules imported after ``site``, their own time summed),
   the rest being the request, the output and the exit; and which of click, DuckDB, pyarrow and the
   diagnosis the command loaded.

Issue 24's goals: backtrace <= 1.0x py-spy at 65 threads, <= 0.5x at 257; the query command <= 50 ms.
probe's modules are byte-compiled first, as an installed package has them.
"""

import argparse
import contextlib
import json
import os
import re
import select
import shutil
import signal
import site
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from _common import (REPO, Summary, Target, clean_env, figure, header, interleave, summary_table, time_command, tool,
                     verdict)

SQL = "SELECT func, file, lineno, depth FROM python.backtrace ORDER BY depth LIMIT 10"
GOAL_RATIO = {65: 1.0, 257: 0.5}
GOAL_QUERY_MS = 50.0
CLICK = "probe PID backtrace, read by click (PROBE_CLI_FAST=0)"
QUERY_IDLE = "probe PID query SQL (main idle)"
QUERY_BUSY = "probe PID query SQL (main busy)"
HEAVY = ("click", "duckdb", "pyarrow", "probe.diagnose", "probe.cli.group")


# -- a site without this machine's .pth hooks ----------------------------------------------------------


class CleanSite:
    """A virtual environment (no pip) whose python imports the same packages as ``sys.executable``, and a
    ``probe`` console script in it written as pip writes ours; removed on exit."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="probe-clean-site-")
        try:
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", self.root], check=True, timeout=120)
            self.python = os.path.join(self.root, "bin", "python")
            purelib = subprocess.run([self.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                     capture_output=True, text=True, check=True, timeout=60).stdout.strip()
            with open(os.path.join(purelib, "paths.pth"), "w") as handle:
                handle.write("\n".join([REPO] + site.getsitepackages()) + "\n")
            own = os.path.join(REPO, "probe_autostart.pth")  # the hook probe's install adds: PROBE=1 starts an agent
            if os.path.exists(own):
                shutil.copy(own, purelib)
            with open(tool("probe")) as handle:
                script = handle.read().split("\n", 1)[1]
            self.probe = os.path.join(self.root, "bin", "probe")
            with open(self.probe, "w") as handle:
                handle.write("#!%s\n%s" % (self.python, script))
            os.chmod(self.probe, 0o755)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "CleanSite":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- a 1-rank job for `ranks` ---------------------------------------------------------------------------


class OneRankJob:
    """tests/targets/rank_states.py as one Slurm rank (PROBE=1, PROBE_PORT), in a runtime directory of its
    own; its node helper is started by the rank, and waited for (bounded) or killed at the end."""

    def __init__(self) -> None:
        self.runtime = tempfile.mkdtemp(prefix="probe-bench-run-")
        os.chmod(self.runtime, 0o700)
        self.port = _free_port_pair()
        env = dict(clean_env(probe=True), PROBE_PORT="127.0.0.1:%d" % self.port, PROBE_RUNTIME_DIR=self.runtime,
                   PROBE_HELPER_LINGER_S="2", SLURM_NTASKS="1", SLURM_NODEID="0", SLURM_PROCID="0", SLURM_LOCALID="0")
        self.cli_env = dict(clean_env(), PROBE_RUNTIME_DIR=self.runtime)
        self.popen = subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "targets", "rank_states.py")],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            assert self.popen.stdout is not None
            ready, _, _ = select.select([self.popen.stdout], [], [], 60)
            line = self.popen.stdout.readline() if ready else ""
            if not line.startswith("READY"):
                raise RuntimeError("the rank did not get ready: %r" % line)
            deadline = time.monotonic() + 60
            while subprocess.run([tool("probe"), "127.0.0.1:%d" % self.port, "ranks"], env=self.cli_env,
                                 capture_output=True, timeout=30).returncode != 0:
                if time.monotonic() > deadline:
                    raise RuntimeError("the rank's node helper did not list it within 60 s")
                time.sleep(0.2)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "OneRankJob":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def target(self) -> str:
        return "127.0.0.1:%d" % self.port

    def close(self) -> None:
        helper = self._helper_pid()
        if self.popen.poll() is None:
            self.popen.kill()
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        if helper is not None:  # it leaves PROBE_HELPER_LINGER_S after its last rank; not our child
            deadline = time.monotonic() + 15
            while os.path.exists("/proc/%d" % helper) and time.monotonic() < deadline:
                time.sleep(0.1)
            if os.path.exists("/proc/%d" % helper):
                os.kill(helper, signal.SIGKILL)
        shutil.rmtree(self.runtime, ignore_errors=True)

    def _helper_pid(self) -> Optional[int]:
        from probe.client import transport

        try:
            answer = transport.request(transport.UnixAddress(os.path.join(self.runtime, "node-%d.sock" % self.port)),
                                       "GET", "/v1/health", None, {}, 5.0)
            return int(json.loads(bytes(answer.body))["pid"]) if answer.status == 200 else None
        except Exception:
            return None


def _free_port_pair() -> int:
    """A port p with p - 1 free a moment ago too (the node helper takes p - 1)."""
    for _ in range(100):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
        if port < 2000:
            continue
        try:
            with socket.socket() as below, socket.socket() as at:
                below.bind(("127.0.0.1", port - 1))
                at.bind(("127.0.0.1", port))
            return port
        except OSError:
            continue
    raise RuntimeError("no two free ports side by side")


# -- measuring ----------------------------------------------------------------------------------------


def imports(python: str, argv: Sequence[str], env: Dict[str, str], runs: int) -> Tuple[float, List[str]]:
    """The command's own imports, best of ``runs``: the self time (s) of every module imported after
    ``site``, summed; and the heavy modules among them."""
    best = float("inf")
    heavy: List[str] = []
    for _ in range(runs):
        done = subprocess.run([python, "-X", "importtime", "-m", "probe", *argv], capture_output=True, text=True,
                              env=env, timeout=60)
        lines = done.stderr.splitlines()
        after = [i for i, line in enumerate(lines) if line.rstrip().endswith("| site")]
        total = 0
        names = []
        for line in lines[(after[0] + 1) if after else 0:]:
            match = re.match(r"import time:\s+(\d+) \|\s+\d+ \|\s*(\S+)", line)
            if match:
                total += int(match.group(1))
                names.append(match.group(2))
        if total / 1e6 < best:
            best = total / 1e6
            heavy = sorted({h for h in HEAVY for n in names if n == h or n.startswith(h + ".")})
    return best, heavy


def measure_threads(threads: int, depth: int, runs: int, clean: Optional[CleanSite]) -> Dict[str, List[float]]:
    """The rounds against a target of ``threads`` threads with a busy main; at 65 threads also the query,
    against it and against a second target whose main thread is blocked (idle)."""
    probe, pyspy = tool("probe"), tool("py-spy")
    with contextlib.ExitStack() as stack:
        busy = str(stack.enter_context(Target("threads.py", "--threads", str(threads), "--depth", str(depth),
                                              "--main", "spin")).pid)
        runners = {
            "probe PID backtrace": lambda: time_command([probe, busy, "backtrace"]),
            "py-spy dump --pid PID": lambda: time_command([pyspy, "dump", "--pid", busy]),
            "python -c pass": lambda: time_command([sys.executable, "-c", "pass"]),
        }
        if threads == 65:  # the same command read by click, as before probe.cli.fast
            slow = dict(clean_env(), PROBE_CLI_FAST="0")
            runners[CLICK] = lambda: time_command([probe, busy, "backtrace"], env=slow)
        sites = [("", probe, sys.executable)]
        if clean is not None:
            runners["clean site: probe PID backtrace"] = lambda: time_command([clean.probe, busy, "backtrace"])
            runners["clean site: python -c pass"] = lambda: time_command([clean.python, "-c", "pass"])
            sites.append(("clean site: ", clean.probe, clean.python))
        if threads == 65:
            idle = str(stack.enter_context(Target("threads.py", "--threads", str(threads), "--depth", str(depth),
                                                  "--main", "block")).pid)
            for prefix, command, _ in sites:
                runners[prefix + QUERY_IDLE] = lambda c=command: time_command([c, idle, "query", SQL])
                runners[prefix + QUERY_BUSY] = lambda c=command: time_command([c, busy, "query", SQL])
        return interleave(runners, runs)


def ratio_line(results: Dict[str, List[float]], a: str, b: str, goal: Optional[float], threads: int) -> Tuple[float, bool]:
    ratio = Summary.of(results[a]).median / Summary.of(results[b]).median
    paired = sorted(x / y for x, y in zip(results[a], results[b]))
    ok = goal is None or ratio <= goal
    figure("%s at %d threads" % (a, threads), results[a], peer=b, peer_values=results[b],
           goal=None if goal is None else "<= %gx" % goal, met=None if goal is None else ok)
    print("  %s / %s: %.2fx (medians); per round %.2fx, IQR %.2f-%.2fx, min-max %.2f-%.2fx%s"
          % (a, b, ratio, Summary.of(paired).median, Summary.of(paired).q1, Summary.of(paired).q3, paired[0],
             paired[-1], "" if goal is None else "; goal <= %gx: %s" % (goal, verdict(ok))))
    return ratio, ok


def report_threads(threads: int, results: Dict[str, List[float]]) -> Dict[str, Any]:
    print("--- %d threads (main included, busy), ~30 frames each ---" % threads)
    print(summary_table(results))
    out: Dict[str, Any] = {}
    out["ratio"], _ = ratio_line(results, "probe PID backtrace", "py-spy dump --pid PID", GOAL_RATIO.get(threads), threads)
    if CLICK in results:
        ratio_line(results, "probe PID backtrace", CLICK, None, threads)
    if "clean site: probe PID backtrace" in results:
        out["clean_ratio"], _ = ratio_line(results, "clean site: probe PID backtrace", "py-spy dump --pid PID",
                                           GOAL_RATIO.get(threads), threads)
    for prefix in ("", "clean site: "):
        for name in (prefix + QUERY_IDLE, prefix + QUERY_BUSY):
            if name not in results:
                continue
            query = Summary.of(results[name]).median * 1000
            start = Summary.of(results[prefix + "python -c pass"]).median * 1000
            over = Summary.of(a - b for a, b in zip(results[name], results[prefix + "python -c pass"]))
            if name.endswith(QUERY_IDLE):
                out[prefix + "query_ms"] = query
            figure(name, results[name], peer=prefix + "python -c pass", peer_values=results[prefix + "python -c pass"],
                   goal="<= %g ms" % GOAL_QUERY_MS, met=query <= GOAL_QUERY_MS)
            print("  %s: %.1f ms (median); over %spython -c pass (%.1f ms) in the same round: median %.1f ms, IQR "
                  "%.1f-%.1f ms; goal <= %g ms: %s" % (name, query, prefix, start, over.median * 1000, over.q1 * 1000,
                                                      over.q3 * 1000, GOAL_QUERY_MS, verdict(query <= GOAL_QUERY_MS)))
    print()
    return out


def phases(runs: int, importtime_runs: int, clean: Optional[CleanSite]) -> None:
    """Where each looped command's time goes: start-up, imports, the rest."""
    print("--- where the time goes: each command whole, python -c pass, its imports (importtime, best of %d) ---"
          % importtime_runs)
    python = clean.python if clean is not None else sys.executable
    probe = clean.probe if clean is not None else tool("probe")
    print("(%s)" % ("clean site" if clean is not None else "this machine's site"))
    with Target("threads.py", "--threads", "65", "--depth", "30", "--main", "block") as target, OneRankJob() as job:
        pid = str(target.pid)
        commands = {"backtrace": ([pid, "backtrace"], clean_env()), "query": ([pid, "query", SQL], clean_env()),
                    "health": ([pid, "health"], clean_env()), "list": (["list", "--agents-only"], clean_env()),
                    "ranks": ([job.target, "ranks"], job.cli_env)}
        runners = {name: (lambda a=argv, e=env: time_command([probe, *a], env=e)) for name, (argv, env) in commands.items()}
        runners["python -c pass"] = lambda: time_command([python, "-c", "pass"])
        results = interleave(runners, runs)
        start = min(results["python -c pass"])  # the floor of each: under load a median mixes in others' work
        rows = []
        for name, (argv, env) in commands.items():
            whole = min(results[name])
            took, heavy = imports(python, argv, env, importtime_runs)
            rows.append([name, "%.1f" % (whole * 1000), "%.1f" % (start * 1000), "%.1f" % (took * 1000),
                         "%.1f" % ((whole - start - took) * 1000), ", ".join(heavy) or "none"])
        from _common import table

        print(table(rows, ["command", "whole ms (min)", "python -c pass ms (min)", "imports ms", "the rest ms",
                           "heavy modules loaded"]))
    print("(the floors: the least of the rounds, as noise only adds; imports: -X importtime's own times, which"
          " add a little of their own; the rest: the request and its answer, the output, the exit; the target's main"
          " thread blocked;"
          " list: 1 agent of ours among the machine's processes; ranks: a 1-rank job through its node helper)")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--threads", default="65,257", help="comma-separated thread counts")
    parser.add_argument("--depth", type=int, default=30)
    parser.add_argument("--importtime", type=int, default=7, help="importtime runs per command (the best is kept)")
    parser.add_argument("--no-clean-site", action="store_true", help="only this machine's site")
    args = parser.parse_args()
    header("The probe command's speed: backtrace vs py-spy dump, query vs python -c pass, where the time goes",
           ["%d interleaved rounds per figure, after 1 warm-up round" % args.runs,
            "issue 24: backtrace <= 1.0x py-spy at 65 threads, <= 0.5x at 257; query command <= %g ms" % GOAL_QUERY_MS])
    clean = None if args.no_clean_site else CleanSite()
    try:
        figures = {}
        for threads in (int(t) for t in args.threads.split(",")):
            figures[threads] = report_threads(threads, measure_threads(threads, args.depth, args.runs, clean))
        phases(max(5, args.runs // 2), args.importtime, clean)
        if clean is not None:
            phases(max(5, args.runs // 2), args.importtime, None)
        summary = ["backtrace %.2fx py-spy at %d threads" % (f["ratio"], t) for t, f in figures.items()]
        if 65 in figures and "query_ms" in figures[65]:
            summary.append("query %.1f ms (main idle)" % figures[65]["query_ms"])
        clean_summary = ["backtrace %.2fx py-spy at %d threads" % (f["clean_ratio"], t) for t, f in figures.items()
                         if "clean_ratio" in f]
        if 65 in figures and "clean site: query_ms" in figures[65]:
            clean_summary.append("query %.1f ms (main idle)" % figures[65]["clean site: query_ms"])
        print("SUMMARY: " + "; ".join(summary))
        if clean_summary:
            print("SUMMARY, clean site: " + "; ".join(clean_summary))
    finally:
        if clean is not None:
            clean.close()


if __name__ == "__main__":
    main()
