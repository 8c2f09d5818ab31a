"""probe's own scenario set: hangs and faults shaped as users' jobs, each run for real and diagnosed, scored.

    python tests/scenarios.py [--only NAME,...] [--json]

Each scenario starts a real job (2 ranks under torchrun on the CPU with gloo, or one process), puts it in
the state it is about (a mismatched collective, a rank slow in its own data loading, NaN weights, a
deadlock, a SIGKILLed rank, ...), runs ``probe ... diagnose`` as a user would, and compares what probe
said (its first line and exit status) with what was expected. It prints a table (scenario, expected,
said) and the score; docs/hung.md quotes the table of the last run. Every scenario's code is a target
under ``tests/targets`` (or ``examples``) written for probe's tests, not taken from a bug report. The
unit tests assert the same verdicts in more detail; this file is for the score, run by hand (~5 min).
Run it from a checkout whose path has a folder named ``probe`` to check that no verdict depends on it.
"""

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("PROBE_RUNTIME_DIR", tempfile.mkdtemp(prefix="probe-scenarios-"))
os.chmod(os.environ["PROBE_RUNTIME_DIR"], 0o700)

from procs import REPO, TARGETS, CliResult, run_cli, scaled, spawn, target_env  # noqa: E402

HEALTHY, DEGRADED, STUCK, DEAD = 0, 10, 11, 12


class Outcome(NamedTuple):
    name: str
    expected: str  # in words, with the exit status
    said: str  # probe's first line
    code: int
    right: bool


def _diagnose(target: str, env: Optional[Dict[str, str]] = None) -> CliResult:
    return run_cli(target, "diagnose", timeout=scaled(90), env=env)


def _until(target: str, code: int, words: Tuple[str, ...], env: Optional[Dict[str, str]] = None,
           within: float = 90.0) -> CliResult:
    """Diagnose until the verdict is the one expected or the time is up (a fault takes a few steps to show,
    a first look at a loaded box can outlast its deadline); the last answer either way."""
    deadline = time.monotonic() + scaled(within)
    result = _diagnose(target, env)
    while not (result.code == code and all(w in result.out for w in words)) and time.monotonic() < deadline:
        time.sleep(1.0)
        result = _diagnose(target, env)
    return result


def _outcome(name: str, expected: str, code: int, words: Tuple[str, ...], result: CliResult) -> Outcome:
    first = (result.out.splitlines() or result.err.splitlines() or [""])[0].strip()
    return Outcome(name, "%s (exit %d)" % (expected, code), first, result.code,
                   result.code == code and all(w in result.out for w in words))


@contextlib.contextmanager
def _torchrun(script: str, **env: str) -> Iterator[str]:
    from test_cluster import torchrun_job

    with torchrun_job(script, 2, timeout=240, **env) as (port, _):
        yield "127.0.0.1:%d" % port


def _control(folder: str, name: str) -> str:
    path = os.path.join(folder, name)
    with open(path, "w"):
        pass
    return path


def _write(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def healthy(folder: str) -> Outcome:
    with _torchrun("ddp_schedule.py") as master:
        words = ("HEALTHY",)
        return _outcome("a healthy 2-rank DDP job, 50 ms steps", "HEALTHY", HEALTHY, words,
                        _until(master, HEALTHY, words))


def mismatch(folder: str) -> Outcome:
    control = _control(folder, "mismatch")
    with _torchrun("dist_metrics_mismatch.py", MISMATCH_CONTROL=control, TORCH_FR_BUFFER_SIZE="2000") as master:
        _write(control, "bcast 1\n")
        words = ("collective mismatch", "all_reduce", "broadcast")
        return _outcome("rank 1 broadcasts where rank 0 all_reduces (same sequence number)",
                        "STUCK: collective mismatch, both ops named", STUCK, words, _until(master, STUCK, words))


def straggler(folder: str) -> Outcome:
    control = _control(folder, "loader")
    with _torchrun("dist_slow_loader.py", LOADER_CONTROL=control) as master:
        _write(control, "slow 1\n")
        words = ("straggler: rank 1", "fetch_examples")
        return _outcome("rank 1 slow in its own data loading (outside forward)",
                        "DEGRADED: straggler rank 1, its function named", DEGRADED, words,
                        _until(master, DEGRADED, words))


def nan(folder: str) -> Outcome:
    control = _control(folder, "diverge")
    with _torchrun("dist_diverge.py", DIVERGE_CONTROL=control) as master:
        _write(control, "blowup 1\n")
        words = ("numerical: NaN",)
        return _outcome("weights turn NaN on every rank, no opt-in check", "DEGRADED: NaN named, with the step",
                        DEGRADED, words, _until(master, DEGRADED, words))


def deadlock(folder: str) -> Outcome:
    job = os.path.join(folder, "probe", "job")
    os.makedirs(job)
    shutil.copy(os.path.join(TARGETS, "lock_shapes.py"), job)
    proc = spawn(os.path.join(job, "lock_shapes.py"), ["cycle"], timeout=60)
    try:
        words = ("deadlock", " a", " b")
        return _outcome("two threads take locks `a` and `b` in opposite orders, comments on the lines, in a "
                        "folder named probe", "STUCK: deadlock, both holders named", STUCK, words,
                        _until(str(proc.pid), STUCK, words))
    finally:
        proc.kill()


def demo(folder: str) -> Outcome:
    import subprocess

    from procs import Proc

    popen = subprocess.Popen([sys.executable, os.path.join(REPO, "examples", "stuck.py")], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=target_env())
    proc = Proc(popen, "stuck.py")
    try:
        while not proc.read_line(60).startswith("READY"):
            pass
        words = ("deadlock",)
        return _outcome("the demo's hung training (examples/stuck.py)", "STUCK: deadlock", STUCK, words,
                        _until(str(popen.pid), STUCK, words))
    finally:
        proc.kill()


def sigkill(folder: str) -> Outcome:
    from test_snapshot_runs import _cli_env, _job
    from test_snapshot_watch import _stepping_and_watched
    from test_torchrun import _free_port_pair
    from torch_job import stop_launcher

    import pathlib

    snaps = os.path.join(folder, "snaps")
    port = _free_port_pair()
    launcher, output, run = _job(pathlib.Path(folder), "kill", port, PROBE_SNAPSHOT_DIR=snaps, PROBE_HANG_AFTER="600",
                                 SNAP_CONTROL=os.path.join(folder, "snap-control"))
    try:
        ranks = _stepping_and_watched(run, output)
        os.kill(ranks[1], signal.SIGKILL)
        launcher.wait(scaled(60))
    finally:
        stop_launcher(launcher)
    words = ("DEAD: rank 1", "SIGKILL")
    env = _cli_env(run, PROBE_SNAPSHOT_DIR=snaps)
    result = _until("127.0.0.1:%d" % port, DEAD, words, env=env, within=30)
    outcome = _outcome("rank 1 SIGKILLed under torchrun; diagnose at the job's address once torchrun ended it",
                       "DEAD: rank 1, SIGKILL, from the job's record", DEAD, words, result)
    verdict = next((line for line in result.out.splitlines() if line.startswith("DEAD: ")), outcome.said)
    return outcome._replace(said=verdict)


SCENARIOS: Dict[str, Callable[[str], Outcome]] = {
    "healthy": healthy, "mismatch": mismatch, "straggler": straggler, "nan": nan, "deadlock": deadlock,
    "demo": demo, "sigkill": sigkill,
}


def _cell(text: str, width: int = 150) -> str:
    text = text.replace("|", "\\|")
    return text if len(text) <= width else text[:width - 3] + "..."


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated scenario names (%s)" % ", ".join(SCENARIOS))
    parser.add_argument("--json", action="store_true", help="one JSON object per scenario instead of the table")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(SCENARIOS)
    outcomes = []
    for name in names:
        with tempfile.TemporaryDirectory(prefix="scenario-") as folder:
            started = time.monotonic()
            try:
                outcome = SCENARIOS[name](folder)
            except Exception as exc:  # a scenario that could not run is scored wrong, with why
                outcome = Outcome(name, "(setup)", "could not run: %s: %s" % (type(exc).__name__, exc), -1, False)
            print("%s: %s in %.0f s" % (name, "right" if outcome.right else "WRONG", time.monotonic() - started),
                  file=sys.stderr, flush=True)
            outcomes.append(outcome)
    if args.json:
        for outcome in outcomes:
            print(json.dumps(outcome._asdict()))
    else:
        print("| scenario | expected | said (first line; exit) | right |")
        print("| --- | --- | --- | --- |")
        for o in outcomes:
            print("| %s | %s | `%s` (exit %d) | %s |" % (_cell(o.name), _cell(o.expected), _cell(o.said), o.code,
                                                      "yes" if o.right else "**no**"))
        print("\n%d of %d right" % (sum(o.right for o in outcomes), len(outcomes)))
    return 0 if all(o.right for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
