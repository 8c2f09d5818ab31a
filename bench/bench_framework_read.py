"""The framework reader's read of one rank (issue 36): what the node helper asks of a rank every
``PROBE_METRICS_EVERY`` seconds (default 15) for ``probe_loss``, ``probe_framework_lr``, ``probe_grad_norm`` and
the loss-spike alert.

    python bench/bench_framework_read.py [--reads 200] [--pause 0.05]

Two real training ranks, each with probe's agent (``PROBE=1``), training on the CPU while they are read:
a Hugging Face Trainer (tests/targets/hf_loss_spike.py: a tiny GPT-2, logging every step, so its log history
grows) and a Lightning Trainer (tests/targets/lightning_lr.py: a LearningRateMonitor and a CSV logger, the
loss and grad norm logged each step). Each is read ``--reads`` times by ``probe.host.framework``'s own
``FrameworkReader.read`` (``torch.trainer``'s loss, lr, grad_norm, logged_step, loss_from, over the agent's
unix socket, a new client a read), interleaved with its peer, the read the helper made before (the loss
alone, a new client a read too; the agent's table computes every column either way). Figures: the
wall time of one read (what it holds the rank's agent, GIL included), the CPU the rank's own threads spent
on it (its agent's threads, ``probe-*``, from /proc: clock ticks, over blocks of reads back to back, the
two kinds in A B B A order), and the share
of the rank's time at one read in 15 s.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_RUN = tempfile.mkdtemp(prefix="probe-bench-framework-")
os.chmod(_RUN, 0o700)
os.environ["PROBE_RUNTIME_DIR"] = _RUN  # before probe is imported: the ranks' sockets are found here

from _common import REPO, Summary, clean_env, figure, header, table  # noqa: E402

TESTS_TARGETS = os.path.join(REPO, "tests", "targets")
_TICK = os.sysconf("SC_CLK_TCK")
BLOCKS = 4


def _agent_cpu(pid: int) -> float:
    """Seconds of CPU the rank's agent threads (named ``probe-*``) have used."""
    total = 0
    for task in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/stat" % (pid, task), "rb") as handle:
                raw = handle.read()
        except OSError:
            continue
        name = raw[raw.index(b"(") + 1:raw.rindex(b")")]
        if name.startswith(b"probe"):
            fields = raw[raw.rindex(b")") + 2:].split()
            total += int(fields[11]) + int(fields[12])
    return total / _TICK


def _start(argv: List[str]) -> subprocess.Popen:
    env = clean_env(True)
    env.update(PYTHONPATH=REPO, PROBE_RUNTIME_DIR=_RUN, TMPDIR=_RUN)
    popen = subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    assert popen.stdout is not None
    while time.monotonic() < deadline:
        line = popen.stdout.readline()
        if not line:
            raise RuntimeError("%s ended before READY" % argv[0])
        if line.startswith("READY"):
            return popen
    raise RuntimeError("%s: no READY in 300 s" % argv[0])


def _stop(popen: subprocess.Popen) -> None:
    if popen.poll() is None:
        popen.kill()
    popen.wait(20)
    if popen.stdout:
        popen.stdout.close()


def measure(name: str, pid: int, reads: int, pause: float) -> List[List[str]]:
    from probe.client.client import Client
    from probe.client.targets import parse_target
    from probe.host.framework import FrameworkReader

    reader = FrameworkReader(15.0)
    got: Dict[str, object] = {}

    def now() -> None:
        got["values"] = reader.read(pid)

    def before() -> None:
        Client(parse_target(str(pid)), None, 10.0).table_rows("torch.trainer", 8, ["loss"])  # a client a read, as before

    runners = {"now": now, "before": before}
    results: Dict[str, List[float]] = {"now": [], "before": []}
    cpu: Dict[str, float] = {"now": 0.0, "before": 0.0}
    for warm in runners.values():
        warm()
    for block in range(BLOCKS):  # A B B A: each kind in blocks of reads back to back, its CPU by block
        for kind in (("now", "before") if block % 2 == 0 else ("before", "now")):
            used = _agent_cpu(pid)
            for _ in range(reads // BLOCKS):
                start = time.perf_counter()
                runners[kind]()
                results[kind].append(time.perf_counter() - start)
                time.sleep(pause)
            cpu[kind] += _agent_cpu(pid) - used
    reads = len(results["now"])
    values = got.get("values") or {}
    print("%s: the last values read: %s" % (name, {k: v for k, v in dict(values).items() if k != "at"}))  # type: ignore
    s, p = Summary.of(results["now"]), Summary.of(results["before"])
    figure("%s: one read of loss, lr, grad norm, step" % name, results["now"], unit="ms",
           peer="the loss alone (the read before)", peer_values=results["before"])
    figure("%s: the rank's agent CPU a read" % name, value=cpu["now"] / reads * 1e3, unit="ms",
           peer="the loss alone", ratio=(cpu["now"] / cpu["before"]) if cpu["before"] else None)
    print("SUMMARY %s: one read %.1f ms median (IQR %.1f-%.1f), the loss alone %.1f ms; the agent's CPU %.2f ms a "
          "read; at one read in 15 s: %.3f %% of the rank's time" % (
              name, s.median * 1e3, s.q1 * 1e3, s.q3 * 1e3, p.median * 1e3, cpu["now"] / reads * 1e3,
              100.0 * s.median / 15.0))
    return [[name, "%.1f (%.1f-%.1f)" % (s.median * 1e3, s.q1 * 1e3, s.q3 * 1e3),
             "%.1f (%.1f-%.1f)" % (p.median * 1e3, p.q1 * 1e3, p.q3 * 1e3), "%.2f" % (cpu["now"] / reads * 1e3),
             "%.2f" % (cpu["before"] / reads * 1e3), "%.3f" % (100.0 * s.median / 15.0)]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reads", type=int, default=200)
    parser.add_argument("--pause", type=float, default=0.05, help="seconds between two reads: each lands at "
                        "another point of the rank's step (0: back to back)")
    args = parser.parse_args()
    header("The framework reader's read of a rank (issue 36): HF Trainer and Lightning, training on the CPU", [
        "each rank read %d times by probe.host.framework.FrameworkReader.read, and as often by the loss-only "
        "read it replaced, in blocks (A B B A), %g s apart" % (args.reads, args.pause)])
    rows: List[List[str]] = []
    for name, argv in (("HF Trainer", [os.path.join(TESTS_TARGETS, "hf_loss_spike.py"), "--spike-steps", "0",
                                       "--sleep", "0.05"]),
                       ("Lightning", [os.path.join(TESTS_TARGETS, "lightning_lr.py"), os.path.join(_RUN, "logs"),
                                      "--sleep", "0.05"])):
        popen = _start(argv)
        try:
            rows += measure(name, popen.pid, args.reads, args.pause)
        finally:
            _stop(popen)
    print()
    print(table(rows, ["rank", "read ms median (IQR)", "loss alone ms", "agent CPU ms/read", "loss alone",
                       "% of the rank at 1 read/15 s"]))


if __name__ == "__main__":
    main()
