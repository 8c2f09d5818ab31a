"""How fast and how safely ``probe PID inject`` starts an agent, next to the way before, debugpy and gdb.

    python bench/bench_inject.py [--runs 5] [--robust 50] [--no-torch] [--probe-only] [--baseline DIR]

* injection time (fresh target each run: a second injection would find the agent; the methods
  interleaved, A B C C B A), on a small sleeping process and on one that imported torch: ``probe PID
  inject`` (whole command), ``probe.injector.inject`` (the library call), the same with gdb reading the
  libraries' debug information (``PROBE_GDB_SYMBOLS=full``: as before issue 24's copies without it, with
  gdb's index cache), and with ``--baseline DIR`` the whole command of another checkout of probe (``git
  worktree add DIR <commit>``: the way before, measured in the same rounds). Peers: debugpy's
  ``run_python_code``, plain gdb with every library's symbols loaded doing the classic
  ``PyGILState_Ensure``/``PyRun_SimpleString``/``PyGILState_Release``, and ``gdb -p PID -batch`` (attach
  and detach only: with every library's symbols, and with none, gdb's own floor). The peers that run
  code get sleeping targets only: they crash busy ones.
* the longest pause a busy main loop suffers while probe injects (the loop records its longest gap),
  for each way, interleaved.
* robustness: injections into busy pure-Python loops (fresh targets, and repeated gdb rounds into the
  same one); every target must survive.

Figures: median, IQR (quartiles) and [min-max]; the machine's load average before and after.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TARGETS = os.path.join(REPO, "tests", "targets")
sys.path.insert(0, REPO)

from _common import figure, start_run  # noqa: E402
from probe.injector import inject  # noqa: E402
from probe.injector.bootstrap_line import bootstrap_code, exposure_dir  # noqa: E402
from probe.injector.methods import attach_and_look, plan, run_plan  # noqa: E402
from probe.injector.target import read_target  # noqa: E402

TRIVIAL = "import sys; sys._bench_injected = 1"


class Target:
    """A target script, started, handshaken through its READY line, always killed and reaped."""

    def __init__(self, script: str, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PROBE") and k != "PYTHONPATH"}
        env["OMP_NUM_THREADS"] = "2"
        self.popen = subprocess.Popen([sys.executable, os.path.join(TARGETS, script), *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self._line(60)
        if not line.startswith("READY"):
            self.stop()
            raise RuntimeError("%s did not get ready: %r" % (script, line))
        self.pid = self.popen.pid

    def _line(self, timeout: float) -> str:
        import select

        assert self.popen.stdout is not None
        ready, _, _ = select.select([self.popen.stdout], [], [], timeout)
        return self.popen.stdout.readline() if ready else ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(10)

    def __enter__(self) -> "Target":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


CPU: Dict[str, Dict[str, List[float]]] = {}  # kind -> method -> CPU seconds (user+sys), ours and children's


def timed_once(fn: Callable[[int], None], script: str, cpu: Optional[List[float]] = None) -> float:
    """Wall time of ``fn(pid)``; with ``cpu``, the CPU time it took (this process's and that of the processes
    it started and reaped: the CLI, gdb, objcopy), which the machine's load moves less than wall time."""
    with Target(script) as target:
        time.sleep(0.2)  # let the target settle into its loop
        before = _cpu()
        began = time.perf_counter()
        fn(target.pid)
        elapsed = time.perf_counter() - began
        if cpu is not None:
            cpu.append(_cpu() - before)
        if not target.alive():
            raise RuntimeError("the target died during %s" % fn.__name__)
    return elapsed


def _cpu() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def probe_cli(pid: int) -> None:
    command = [sys.executable, "-c", "import sys; from probe.cli import main; sys.exit(main())", str(pid), "inject"]
    subprocess.run(command, check=True, timeout=60, stdout=subprocess.DEVNULL)


def probe_library(pid: int) -> None:
    inject(pid, timeout=30)


def probe_library_full_symbols(pid: int) -> None:
    """gdb reads libpython's and libc's debug information (with its index cache), as before issue 24's
    copies without it."""
    saved = os.environ.get("PROBE_GDB_SYMBOLS")
    os.environ["PROBE_GDB_SYMBOLS"] = "full"
    try:
        inject(pid, timeout=30)
    finally:
        if saved is None:
            os.environ.pop("PROBE_GDB_SYMBOLS", None)
        else:
            os.environ["PROBE_GDB_SYMBOLS"] = saved


BASELINE: List[str] = []  # the checkout given by --baseline


def baseline_cli(pid: int) -> None:
    """The whole command of the checkout in ``--baseline`` (its own package, imported first)."""
    code = "import sys; sys.path.insert(0, %r); from probe.cli import main; sys.exit(main())" % BASELINE[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROBE_GDB")}
    subprocess.run([sys.executable, "-c", code, str(pid), "inject"], check=True, timeout=60,
                   stdout=subprocess.DEVNULL, env=env)


def debugpy_run_python_code(pid: int) -> None:
    import debugpy

    attach_dir = os.path.join(os.path.dirname(debugpy.__file__), "_vendored", "pydevd", "pydevd_attach_to_process")
    if attach_dir not in sys.path:
        sys.path.insert(0, attach_dir)
    from add_code_to_python_process import run_python_code  # type: ignore[import-not-found]

    run_python_code(pid, TRIVIAL, connect_debugger_tracing=False, show_debug_info=0)


def plain_gdb(pid: int) -> None:
    subprocess.run(["gdb", "-nx", "-q", "-batch", "-iex", "set debuginfod enabled off", "-p", str(pid),
                    "-ex", "call (int)PyGILState_Ensure()",
                    "-ex", 'call (int)PyRun_SimpleString("%s")' % TRIVIAL,
                    "-ex", "call (void)PyGILState_Release($1)"],
                   check=True, timeout=120, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def gdb_attach_detach(pid: int) -> None:
    """``gdb -p PID -batch``: attach, load every library's symbols, detach."""
    subprocess.run(["gdb", "-nx", "-q", "-batch", "-iex", "set debuginfod enabled off", "-p", str(pid)],
                   check=True, timeout=120, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def gdb_attach_detach_bare(pid: int) -> None:
    """The same without any library's symbols: gdb's start, attach and detach alone."""
    subprocess.run(["gdb", "-nx", "-q", "-batch", "-iex", "set debuginfod enabled off", "-iex", "set auto-load off",
                    "-iex", "set auto-solib-add off", "-p", str(pid)],
                   check=True, timeout=120, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def pause_during_injection(runs: int, ways: List[Tuple[str, Callable[[int], None]]]) -> Dict[str, List[float]]:
    """Longest gap (ms) of the busy loop across an injection, fresh target each run, the ways interleaved."""
    gaps: Dict[str, List[float]] = {name: [] for name, _ in ways}
    for i in range(runs):
        for name, fn in (ways if i % 2 == 0 else ways[::-1]):
            gap_file = tempfile.mktemp(prefix="probe-gap-")
            with Target("inject_busy.py", gap_file) as target:
                time.sleep(0.5)
                fn(target.pid)
                time.sleep(0.3)
                with open(gap_file) as handle:
                    gaps[name].append(float(handle.read()))
            os.unlink(gap_file)
    return gaps


def noise_gap(seconds: float = 2.0) -> float:
    """The busy loop's longest gap with nobody injecting: this machine's scheduling noise (ms)."""
    gap_file = tempfile.mktemp(prefix="probe-gap-")
    with Target("inject_busy.py", gap_file) as target:
        time.sleep(seconds)
        with open(gap_file) as handle:
            value = float(handle.read())
        assert target.alive()
    os.unlink(gap_file)
    return value


def robustness(total: int, per_target: int = 5) -> Dict[str, int]:
    """``total`` injections into busy loops: the first per target through inject(), the rest as raw gdb rounds."""
    done = died = 0
    while done < total:
        with Target("inject_busy.py") as target:
            inject(target.pid, timeout=30)
            done += 1
            info = read_target(target.pid)
            code = bootstrap_code("", exposure_dir(info.uid))
            for _ in range(min(per_target - 1, total - done)):
                session, threads = attach_and_look(info, time.monotonic() + 30)
                run_plan(session, plan(threads, target.pid), code, time.monotonic() + 30)
                done += 1
            time.sleep(0.3)
            died += 0 if target.alive() else 1
    return {"injections": done, "died": died}


def summary(times: List[float], scale: float = 1.0, unit: str = "s", digits: int = 3) -> str:
    """median, IQR (first-third quartile) and [min-max]."""
    values = sorted(t * scale for t in times)
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    fmt = "%%.%df" % digits
    return (fmt + " %s IQR " + fmt + "-" + fmt + " [" + fmt + "-" + fmt + "]") % (
        statistics.median(values), unit, q1, q3, values[0], values[-1])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--robust", type=int, default=50)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--probe-only", action="store_true", help="leave debugpy and gdb out")
    parser.add_argument("--baseline", metavar="DIR", help="another checkout of probe, measured in the same rounds")
    args = parser.parse_args(argv)
    if args.baseline:
        BASELINE.append(os.path.abspath(args.baseline))
    start_run("bench_inject: injection time and pause, probe against debugpy and gdb, fresh targets, interleaved")
    print("load average before: %.2f %.2f %.2f" % os.getloadavg(), flush=True)

    kinds = [("small", "inject_sleeping.py")] + ([] if args.no_torch else [("torch", "inject_torch.py")])
    methods: List[Tuple[str, Callable[[int], None]]] = [
        ("probe PID inject (CLI)", probe_cli), ("probe.injector.inject()", probe_library),
        ("inject(), debug info read", probe_library_full_symbols)]
    if args.baseline:
        methods.append(("baseline CLI", baseline_cli))
    if not args.probe_only:
        methods += [("debugpy run_python_code", debugpy_run_python_code), ("plain gdb, all symbols", plain_gdb),
                    ("gdb -p PID -batch", gdb_attach_detach), ("gdb -p PID -batch, no libs", gdb_attach_detach_bare)]
    results: Dict[str, Dict[str, List[float]]] = {}
    for kind, script in kinds:
        results[kind] = {name: [] for name, _ in methods}
        CPU[kind] = {name: [] for name, _ in methods}
        for i in range(args.runs):  # interleaved: A B C ... then ... C B A
            for name, fn in (methods if i % 2 == 0 else methods[::-1]):
                results[kind][name].append(timed_once(fn, script, CPU[kind][name]))
        for name, _ in methods:
            print("  measured %-6s %-27s %s" % (kind, name, summary(results[kind][name])), flush=True)

    print("\ninjection time over %d fresh targets, interleaved: median, IQR [min-max]; ratio = way / probe CLI"
          % args.runs)
    for kind, _ in kinds:
        print("%s:" % kind)
        cli = statistics.median(results[kind]["probe PID inject (CLI)"])
        for name, _ in methods:
            times = results[kind][name]
            print("  %-27s %s  x%.2f" % (name, summary(times), statistics.median(times) / cli))
            figure("%s, %s target" % (name, kind), times, peer="probe PID inject (CLI)", unit="s", scale=1.0,
                   peer_values=results[kind]["probe PID inject (CLI)"])

    print("\nCPU time (user+sys) of each way, its children included (the CLI, gdb, objcopy): median, IQR [min-max]")
    for kind, _ in kinds:
        print("%s:" % kind)
        cli = statistics.median(CPU[kind]["probe PID inject (CLI)"])
        for name, _ in methods:
            print("  %-27s %s  x%.2f" % (name, summary(CPU[kind][name]), statistics.median(CPU[kind][name]) / cli))
            figure("%s, %s target, CPU time" % (name, kind), CPU[kind][name], peer="probe PID inject (CLI)", unit="s",
                   scale=1.0, peer_values=CPU[kind]["probe PID inject (CLI)"])

    noise = noise_gap()
    ways = [("probe.injector.inject()", probe_library), ("inject(), debug info read", probe_library_full_symbols)]
    if args.baseline:
        ways.append(("baseline CLI", baseline_cli))
    gaps = pause_during_injection(args.runs, ways)
    print("\nlongest pause of a busy main loop during an injection (same loop, nobody injecting: %.1f ms):" % noise)
    for name, _ in ways:
        print("  %-27s %s" % (name, summary(gaps[name], unit="ms", digits=1)))
        figure("longest busy-loop pause during an injection, %s" % name, gaps[name], unit="ms", scale=1.0)

    robust = robustness(args.robust)
    print("robustness: %d injections into busy pure-Python loops, %d targets died" % (robust["injections"],
                                                                                      robust["died"]))
    print("load average after: %.2f %.2f %.2f" % os.getloadavg())
    return 1 if robust["died"] else 0

if __name__ == "__main__":
    sys.exit(main())
