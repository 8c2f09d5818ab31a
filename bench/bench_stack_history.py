"""What the stack history (``cluster.stack_history``, issue 36 item 4) costs a rank, and its node helper.

    python bench/bench_stack_history.py [--rounds 6] [--window 4] [--every 0.05] [--threads 9] [--depth 30]

A rank stand-in (``bench/targets/threads.py``: ``--threads`` threads, the main one included, each ``--depth``
frames deep, blocked) with its agent. Windows of ``--window`` seconds alternate (A B B A ...): in one,
``probe.host.history.History`` (the helper's own sampler, here in the bench process) samples the rank every
``--every`` seconds, as at ``PROBE_STACK_EVERY=--every``; in the other nothing asks it. The rank's CPU time
(utime + stime of /proc/PID/stat) over each window, minus the mean of the quiet windows beside it, divided
by the samples taken, is what one sample costs the rank: the agent's thread serving ``GET /v1/backtrace``,
the time it holds the rank's GIL at most. At the default (one sample every 30 s) the share of the rank's
time, and so of any step, is that cost / 30 s. Beside it the helper's side: its wall and CPU time a sample.

The peers (``--peer-rounds``, 0 to skip): a rank that trains (``bench/targets/stacks_loop.py``: a small MLP,
one thread, a one-rank gloo group) with probe's agent and torch's debug server both in it
(``torch.distributed.debug.start_debug_server``: its worker server answers ``dump_traceback``). Windows of
``--peer-window`` seconds rotate among: nothing asked; probe's stack history sampling it every
``--peer-every`` seconds (``History.sample``, as the node helper does); torch's own periodic dumper
(``torch.distributed.debug._frontend.PeriodicDumper`` with torch's ``StacksHandler``, what the debug
server's frontend runs every ``dump_interval`` when given a ``dump_dir``, here in the bench process so that it
can be switched on and off by window) at the same period, each dump written to a file. Per window the rank
reports its median step and its CPU a step (all its threads: the agent's, torch's worker server's); that CPU
a step over the quiet windows' median, times the steps, by the samples or dumps taken, is what one costs it. (A rank that computes without pause takes whatever CPU it
is given: on a loaded machine the step times say more than the CPU.) torch's frontend needs ``jinja2`` and ``tabulate``
(``aiohttp`` where present); where they are missing the peer rows are skipped, and said.
"""

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import REPO, TARGETS, Summary, Target, clean_env, figure, header, table  # noqa: E402

DEFAULT_EVERY_S = 30.0
GOAL_SHARE = 0.05 / 100  # of a step, at the default (issue 36)


def _cpu(pid: int) -> float:
    with open("/proc/%d/stat" % pid, "rb") as handle:
        fields = handle.read().rpartition(b")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Helper:
    """What the sampler needs of a node helper: its ranks."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def local_members(self) -> List[Dict[str, Any]]:
        return [{"rank": 0, "pid": self.pid, "state": "running"}]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--window", type=float, default=4.0)
    parser.add_argument("--every", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=9)
    parser.add_argument("--depth", type=int, default=30)
    parser.add_argument("--peer-rounds", type=int, default=4, help="rotations of the three windows; 0: no peers")
    parser.add_argument("--peer-window", type=float, default=5.0)
    parser.add_argument("--peer-every", type=float, default=0.25)
    args = parser.parse_args()
    from probe.host.history import History

    header("The stack history: what one sample costs a rank (its agent's backtrace) and the node helper",
           ["a rank stand-in of %d threads %d frames deep, blocked; %d rounds of %.0f s windows sampled every "
            "%.2f s / not sampled, interleaved (A B B A)" % (args.threads, args.depth, args.rounds, args.window,
                                                              args.every)])
    with Target("threads.py", "--threads", str(args.threads), "--depth", str(args.depth), "--main", "block") as rank:
        history = History(_Helper(rank.pid), args.every)
        history.sample()  # warm: the first request starts what the agent keeps
        per_sample: List[float] = []
        quiet: List[float] = []
        helper_wall: List[float] = []
        helper_cpu: List[float] = []
        rows = 0
        for i in range(args.rounds):
            order = ("quiet", "sampled", "sampled", "quiet") if i % 2 == 0 else ("sampled", "quiet", "quiet", "sampled")
            got: Dict[str, List[float]] = {"quiet": [], "sampled": []}
            samples = 0
            for what in order:
                before, end = _cpu(rank.pid), time.monotonic() + args.window
                while time.monotonic() < end:
                    if what == "sampled":
                        wall, cpu = time.perf_counter(), time.process_time()
                        rows += history.sample()
                        helper_wall.append(time.perf_counter() - wall)
                        helper_cpu.append(time.process_time() - cpu)
                        samples += 1
                    time.sleep(args.every)
                got[what].append(_cpu(rank.pid) - before)
            base = statistics.mean(got["quiet"])
            quiet += got["quiet"]
            per_sample.append(max(0.0, sum(got["sampled"]) - 2 * base) / max(samples, 1))
        kept = history.answer()
    s, w, c = Summary.of(per_sample), Summary.of(helper_wall), Summary.of(helper_cpu)
    print(table([["the rank's CPU a sample", str(s.n), "%.3f" % (s.median * 1e3), "%.3f-%.3f" % (s.q1 * 1e3, s.q3 * 1e3)],
                 ["the helper's wall a sample", str(w.n), "%.3f" % (w.median * 1e3), "%.3f-%.3f" % (w.q1 * 1e3, w.q3 * 1e3)],
                 ["the helper's CPU a sample", str(c.n), "%.3f" % (c.median * 1e3), "%.3f-%.3f" % (c.q1 * 1e3, c.q3 * 1e3)]],
                ["", "n", "median ms", "IQR ms"]))
    quiet_rate = statistics.mean(quiet) / args.window
    share = s.median / DEFAULT_EVERY_S
    bound = w.median / DEFAULT_EVERY_S
    print()
    print("the rank's CPU when not sampled: %.3f ms a second (its own threads)" % (quiet_rate * 1e3))
    print("kept: %d rows referring to %d distinct stacks (%d samples of %d threads)" % (
        len(kept["rows"]), len(kept["stacks"]), history.samples, args.threads))
    print("SUMMARY at PROBE_STACK_EVERY=30: one sample every 30 s costs the rank %.3f ms of CPU: %.4f %% of its time, "
          "and so of a step (goal < %.2f %%); were the helper's whole wall time a sample (%.3f ms, load %.1f) lost "
          "by the rank, %.4f %%" % (s.median * 1e3, share * 100, GOAL_SHARE * 100, w.median * 1e3, os.getloadavg()[0],
                                   bound * 100))
    figure("the rank's CPU a sample", per_sample, unit="ms")
    figure("the helper's wall a sample", helper_wall, unit="ms")
    figure("the helper's CPU a sample", helper_cpu, unit="ms")
    figure("share of a rank's time at PROBE_STACK_EVERY=30", value=share * 100, unit="%", goal="< 0.05 %",
           met=share < GOAL_SHARE)
    if args.peer_rounds:
        print()
        peers(args.peer_rounds, args.peer_window, args.peer_every)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _Loop:
    """stacks_loop.py, killed and reaped (its process group: the debug server's frontend too) at close."""

    def __init__(self, env: Dict[str, str]) -> None:
        import select

        self._select = select.select
        full = clean_env(True)
        full.update(PYTHONPATH=REPO, PYTHONUNBUFFERED="1", **env)
        self.popen = subprocess.Popen([sys.executable, os.path.join(TARGETS, "stacks_loop.py")], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=full, text=True,
                                      bufsize=1, start_new_session=True)
        words = self.line(300).split()
        if words[:1] != ["READY"]:
            self.close()
            raise RuntimeError("stacks_loop.py did not get ready: %r" % words)
        self.pid = int(words[1])

    def line(self, timeout: float) -> str:
        assert self.popen.stdout is not None
        if not self._select([self.popen.stdout], [], [], timeout)[0]:
            raise TimeoutError("no line from stacks_loop.py in %.0f s" % timeout)
        return self.popen.stdout.readline().strip()

    def report(self) -> List[float]:
        assert self.popen.stdin is not None
        self.popen.stdin.write("report\n")
        self.popen.stdin.flush()
        words = self.line(60).split()
        assert words[:1] == ["TIMES"], words
        return [float(words[2]), float(words[3]), float(words[1])]

    def close(self) -> None:
        try:
            os.killpg(self.popen.pid, 9)
        except ProcessLookupError:
            pass
        self.popen.wait(20)
        for stream in (self.popen.stdin, self.popen.stdout):
            if stream is not None:
                stream.close()


def _torch_dumper() -> Optional[Any]:
    """torch's periodic dumper class and its stacks handler, or None where the frontend's imports are missing."""
    try:
        from torch.distributed.debug._debug_handlers import StacksHandler
        from torch.distributed.debug._frontend import PeriodicDumper
    except ImportError as exc:
        print("torch's debug server frontend cannot be imported here (%s): no peer rows" % exc)
        return None
    return PeriodicDumper, StacksHandler


def peers(rounds: int, window: float, every: float) -> None:
    """A training rank's step and CPU: quiet, probe's history sampling it, torch's periodic stack dumps."""
    from probe.host.history import History

    found = _torch_dumper()
    if found is None:
        return
    PeriodicDumper, StacksHandler = found
    header("The peers: a training rank under probe's stack history and under torch's debug server's periodic "
           "stack dumps", ["a one-rank gloo MLP loop with both in it; %d rotations of %.0f s windows: quiet, "
                           "probe sampling / torch dumping every %.2f s" % (rounds, window, every)])
    master = _free_port()
    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master),
               DEBUG_PORT=str(_free_port()))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master), WORLD_SIZE="1", RANK="0")
    dumps_dir = tempfile.mkdtemp(prefix="probe-bench-torch-dumps-")
    taken = {"probe": 0, "torch": 0}

    class Stacks(StacksHandler):  # type: ignore[misc,valid-type]
        def dump(self) -> Any:
            taken["torch"] += 1
            return super().dump()

    loop = _Loop(env)
    kept: Dict[str, List[List[float]]] = {"quiet": [], "probe": [], "torch": []}
    try:
        history = History(_Helper(loop.pid), every)
        history.sample()
        Stacks().dump()  # warm both: the first request starts what each keeps
        loop.report()
        orders = (("quiet", "probe", "torch"), ("torch", "quiet", "probe"), ("probe", "torch", "quiet"))
        for i in range(rounds):
            for what in orders[i % 3]:
                samples = taken[what] if what != "quiet" else 0
                if what == "torch":
                    dumper = PeriodicDumper([Stacks()], dumps_dir, every)
                    dumper.start()
                    time.sleep(window)
                    dumper.stop()
                elif what == "probe":
                    end = time.monotonic() + window
                    while time.monotonic() < end:
                        history.sample()
                        taken["probe"] += 1
                        time.sleep(every)
                else:
                    time.sleep(window)
                step, cpu_step, steps = loop.report()
                kept[what].append([step, cpu_step, steps, (taken[what] - samples) if what != "quiet" else 0])
    finally:
        loop.close()
    quiet_cpu = statistics.median(k[1] for k in kept["quiet"])  # a step's, the rank's own threads and the agent's
    q_step = statistics.median(k[0] for k in kept["quiet"])
    rows = []
    for what, name in (("quiet", "nothing asked"), ("probe", "probe's stack history"),
                       ("torch", "torch's debug server, periodic stacks dumps")):
        steps = [k[0] for k in kept[what]]
        per = [max(0.0, k[1] - quiet_cpu) * k[2] / k[3] for k in kept[what] if k[3]]
        rows.append([name, "%d" % sum(k[3] for k in kept[what]), "%.3f" % (statistics.median(steps) * 1e3),
                     "%.3f" % (statistics.median(steps) / q_step),
                     "%.1f" % (statistics.median(k[1] for k in kept[what]) * 1e6),
                     "%.3f" % (statistics.median(per) * 1e3) if per else "-"])
        if what != "quiet":
            figure("%s: a training rank's median step, every %.2f s" % (name, every), steps, unit="ms",
                   peer="nothing asked", peer_values=[k[0] for k in kept["quiet"]])
            if per:
                figure("%s: the rank's CPU a sample" % name, per, unit="ms")
    print(table(rows, ["the rank under", "samples", "median step ms", "vs quiet", "CPU us a step",
                       "rank CPU ms a sample"]))
    print()
    print("SUMMARY a training rank sampled every %.2f s: probe's stack history %s ms of its CPU a sample, torch's "
          "debug server's periodic stacks dump %s ms a dump; median step %s / %s of the quiet one" % (
              every, rows[1][5], rows[2][5], rows[1][3], rows[2][3]))


if __name__ == "__main__":
    main()
