"""The small case (issue 37 item 5): ``probe PID backtrace`` of a process of one to a few threads, next to
``py-spy dump --pid PID``, with the agent answering and read from outside.

    python bench/bench_small.py [--runs 15] [--threads 1,3] [--work sleep] [--no-site] [--importtime 5]

Targets: bench/targets/nested.py, shaped like py-spy's own test scripts (each thread loops over three nested
calls that sleep 10 ms, ``sleep``, or count in Python, ``spin``: two spinning targets take both cores of a
2-core machine, so ``spin`` is not run by default), in pairs: one with an agent (``PROBE=1``) and one without,
which probe reads from outside (no agent answers: probe reads its stacks from its memory, ``probe.reader.memory``,
or where it cannot, with py-spy, and says which on stderr). Each (threads, work) group runs alone, its two targets started for it and killed after; within a
group every command runs once a round, interleaved (A B C ... C B A), after a warm-up round:

* ``probe PID backtrace`` against each target, run by a console script in a virtual environment without
  this machine's ``.pth`` start-up hooks (``bench_cli_speed.CleanSite``: the sandbox this was written on
  imports certifi at every Python start, some 20 ms a user's machine does not pay). Two scripts: the one
  current installers write (pip >= 25.0 and uv: ``import sys``, the entry point, nothing else), which the
  goal is held to, and the one this machine's pip 23.2 wrote, whose first line is ``import re`` (some 5 ms
  of start-up that no code of probe's can avoid); unless ``--no-site``, also the ``probe`` installed here;
* ``py-spy dump --pid PID`` against the same two targets;
* ``python -c pass`` of the clean site: the interpreter's own start, which no Python tool avoids.

With ``--debian`` (the default where ``/usr/bin/python3`` is CPython 3.11), a third target without agent run by
that interpreter (Debian's, libpython linked into the executable: probe's reader finds its symbols there),
read by ``probe PID backtrace`` and by py-spy in the same rounds.

py-spy is linked into the clean site's bin, where ``pip install`` puts it (else the client would find this
machine's pyenv shim on PATH, a shell script that costs tens of ms). Medians, IQR and min-max of the wall
time from spawn to exit; ratios of the medians to py-spy's on the same target, and the spread of the
per-round ratios; and of the same runs' CPU time (user and system, the command's and its children's, from
``wait4``), the work done, which a machine loaded by others stretches far less than the wall time. Goal: <= 2x py-spy, with the agent and from outside. The load average is printed before
and after each group (the machine is shared). After each group, the imports of each probe command
(``python -X importtime -m probe``, best of ``--importtime`` runs: the self time of every module imported
after ``site``, summed), for where the time goes.
"""

import argparse
import contextlib
import os
import subprocess
import sys
import time
from typing import Callable, Dict, List, Sequence

from _common import REPO, Summary, Target, clean_env, figure, header, interleave, summary_table, tool, verdict
from bench_cli_speed import CleanSite, imports

GOAL = 2.0


def _load() -> str:
    return " ".join("%.2f" % x for x in os.getloadavg())


OLD = "pip 23 script: "
"""The prefix of the figures of the script this machine's pip wrote (``import re`` first)."""
_SCRIPT = """#!%s
# -*- coding: utf-8 -*-
import sys
from probe.cli import main
if __name__ == "__main__":
    for tail in ("-script.pyw", ".exe"):
        if sys.argv[0].endswith(tail):
            sys.argv[0] = sys.argv[0][:-len(tail)]
    sys.exit(main())
"""


def current_script(clean: CleanSite) -> str:
    """A ``probe`` console script in the clean site as pip >= 25.0 and uv write it (no ``import re``)."""
    path = os.path.join(os.path.dirname(clean.python), "probe-current")
    with open(path, "w") as handle:
        handle.write(_SCRIPT % clean.python)
    os.chmod(path, 0o755)
    return path


CPU: Dict[str, List[float]] = {}
"""The CPU time (user and system, the command and its children: py-spy's, where probe runs it) of each run of
the last :func:`timed` commands, by the runner's name: work done, which a loaded machine stretches far less
than the wall time."""


READER: Dict[str, List[str]] = {}
"""Which reader answered each run of a command read from outside (``probe`` or ``py-spy``), by the note on stderr."""


def timed(argv: Sequence[str], name: str = "") -> float:
    """Wall time in seconds of one whole command (spawn to exit), as ``_common.time_command`` times it; its CPU
    time goes to ``CPU[name]``. Raises where the command fails."""
    start = time.perf_counter()
    child = subprocess.Popen(list(argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert child.stderr is not None
    errors = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    elapsed = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    child.stderr.close()
    if child.returncode != 0:
        raise RuntimeError("%s failed (rc %d): %s" % (" ".join(argv), child.returncode, errors.decode(errors="replace")[-500:]))
    CPU.setdefault(name, []).append(usage.ru_utime + usage.ru_stime)
    if b"stacks read from outside" in errors:  # which reader answered: probe's own, or py-spy where it could not
        READER.setdefault(name, []).append("probe" if b"by probe," in errors else "py-spy")
    return elapsed


DEBIAN = "/usr/bin/python3"
DEBIAN_OUTSIDE = "probe PID backtrace, outside, Debian python"
DEBIAN_PEER = "py-spy dump, Debian python's target"
PAIRS = (("probe PID backtrace, agent", "py-spy dump, agent's target"),
         ("probe PID backtrace, outside", "py-spy dump, target without agent"),
         (DEBIAN_OUTSIDE, DEBIAN_PEER))
"""Each probe command (its clean-site name) and the py-spy read of the same target."""


def debian_python() -> bool:
    """Whether ``DEBIAN`` is CPython 3.11 (the version probe's reader reads)."""
    try:
        done = subprocess.run([DEBIAN, "-c", "import sys; print(sys.implementation.name, *sys.version_info[:2])"],
                              capture_output=True, text=True, timeout=30)
    except OSError:
        return False
    return done.stdout.split() == ["cpython", "3", "11"]


def measure(threads: int, work: str, runs: int, clean: CleanSite, site: bool, debian: bool) -> Dict[str, List[float]]:
    pyspy, current = tool("py-spy"), current_script(clean)
    args = ("--threads", str(threads), "--work", work)
    with contextlib.ExitStack() as stack:
        agent = str(stack.enter_context(Target("nested.py", *args)).pid)
        plain = str(stack.enter_context(Target("nested.py", *args, probe=False)).pid)
        system = str(stack.enter_context(Target("nested.py", *args, probe=False, python=DEBIAN)).pid) if debian else ""
        commands = {
            "probe PID backtrace, agent": [current, agent, "backtrace"],
            "py-spy dump, agent's target": [pyspy, "dump", "--pid", agent],
            "probe PID backtrace, outside": [current, plain, "backtrace"],
            "py-spy dump, target without agent": [pyspy, "dump", "--pid", plain],
            "python -c pass": [clean.python, "-c", "pass"],
            OLD + "probe PID backtrace, agent": [clean.probe, agent, "backtrace"],
            OLD + "probe PID backtrace, outside": [clean.probe, plain, "backtrace"],
        }
        if debian:
            commands[DEBIAN_OUTSIDE] = [current, system, "backtrace"]
            commands[DEBIAN_PEER] = [pyspy, "dump", "--pid", system]
        if site:
            commands["this site: probe PID backtrace, agent"] = [tool("probe"), agent, "backtrace"]
            commands["this site: probe PID backtrace, outside"] = [tool("probe"), plain, "backtrace"]
        runners: Dict[str, Callable[[], float]] = {
            name: (lambda argv=argv, name=name: timed(argv, name)) for name, argv in commands.items()}
        CPU.clear()
        READER.clear()
        results = interleave(runners, runs)
        for name in CPU:  # the warm-up round's are not figures
            CPU[name] = CPU[name][-runs:]
        for name in READER:
            READER[name] = READER[name][-runs:]
        return results


def report(threads: int, work: str, results: Dict[str, List[float]]) -> None:
    print(summary_table(results))
    print("CPU time (user + system, with children), the same runs:")
    print(summary_table({"CPU: " + name: values for name, values in CPU.items()}))
    group = "%d thread%s, %s" % (threads, "" if threads == 1 else "s", work)
    for base, peer in PAIRS:
        for prefix in ("", OLD, "this site: "):
            name = prefix + base
            if name not in results:
                continue
            ratio = Summary.of(results[name]).median / Summary.of(results[peer]).median
            paired = Summary.of(a / b for a, b in zip(results[name], results[peer]))
            goal = not prefix and base != DEBIAN_OUTSIDE  # the clean site's, by the script current installers write
            figure("%s: %s" % (group, name), results[name], peer=peer, peer_values=results[peer],
                   goal="<= %gx" % GOAL if goal else None, met=(ratio <= GOAL) if goal else None)
            print("  %s / py-spy: %.2fx (medians); per round %.2fx, IQR %.2f-%.2fx, min-max %.2f-%.2fx%s"
                  % (name, ratio, paired.median, paired.q1, paired.q3, paired.low, paired.high,
                     "; goal <= %gx: %s" % (GOAL, verdict(ratio <= GOAL)) if goal else ""))
            if name in READER:
                print("    read from outside by probe's own reader in %d of %d runs (else py-spy)"
                      % (READER[name].count("probe"), len(READER[name])))
            cpu = Summary.of(CPU[name]).median / Summary.of(CPU[peer]).median
            figure("%s: CPU time of %s" % (group, name), CPU[name], peer=peer, peer_values=CPU[peer])
            print("    CPU time: %.1f ms vs py-spy's %.1f ms (medians): %.2fx"
                  % (Summary.of(CPU[name]).median * 1000, Summary.of(CPU[peer]).median * 1000, cpu))
    start = Summary.of(results["python -c pass"]).median
    print("  the interpreter's own start (python -c pass, clean site): %.1f ms" % (start * 1000))
    for name in ("probe PID backtrace, agent", OLD + "probe PID backtrace, agent", "probe PID backtrace, outside"):
        over = Summary.of(a - b for a, b in zip(results[name], results["python -c pass"]))
        print("  %s over python -c pass in the same round: median %.1f ms, IQR %.1f-%.1f ms"
              % (name, over.median * 1000, over.q1 * 1000, over.q3 * 1000))


def where(threads: int, work: str, clean: CleanSite, runs: int) -> None:
    """The imports of each probe command (clean site), against fresh targets of the group."""
    args = ("--threads", str(threads), "--work", work)
    with contextlib.ExitStack() as stack:
        agent = str(stack.enter_context(Target("nested.py", *args)).pid)
        plain = str(stack.enter_context(Target("nested.py", *args, probe=False)).pid)
        for mode, pid in (("agent", agent), ("outside", plain)):
            seconds, heavy = imports(clean.python, [pid, "backtrace"], clean_env(), runs)
            print("  imports of probe PID backtrace, %s (python -X importtime -m probe, best of %d): %.1f ms%s"
                  % (mode, runs, seconds * 1000, "; loads " + ", ".join(heavy) if heavy else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--threads", default="1,3")
    parser.add_argument("--work", default="sleep")
    parser.add_argument("--no-site", action="store_true", help="leave out the probe installed on this machine")
    parser.add_argument("--importtime", type=int, default=5)
    parser.add_argument("--debian", action=argparse.BooleanOptionalAction, default=None,
                        help="a target run by %s too (default: where it is CPython 3.11)" % DEBIAN)
    args = parser.parse_args()
    debian = debian_python() if args.debian is None else args.debian
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    header("The small case: probe PID backtrace vs py-spy dump, with the agent and from outside",
           ["%d rounds a group, interleaved, after a warm-up round; whole commands, spawn to exit" % args.runs,
            "targets: bench/targets/nested.py (%s threads; work %s); goal <= %gx py-spy (clean site)"
            % (args.threads, args.work, GOAL)])
    with CleanSite() as clean:
        os.symlink(tool("py-spy"), os.path.join(os.path.dirname(clean.python), "py-spy"))
        for threads in [int(t) for t in args.threads.split(",")]:
            for work in args.work.split(","):
                print("--- %d thread%s, %s (load average %s) ---" % (threads, "" if threads == 1 else "s", work, _load()))
                results = measure(threads, work, args.runs, clean, not args.no_site, debian)
                report(threads, work, results)
                if args.importtime:
                    where(threads, work, clean, args.importtime)
                print("  load average after: %s" % _load())
                print()
                sys.stdout.flush()


if __name__ == "__main__":
    main()
