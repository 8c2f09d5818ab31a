"""Shared helpers for the benchmarks: spawning targets, timing commands, statistics and tables.

Every benchmark measures peers side by side in the same run, interleaved, and reports medians with
their spread (min-max and IQR): the machine is small (2 cores), shared and noisy, so a single
absolute time means little. Every child process is killed and reaped, and every wait is bounded.
"""

import os
import select
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TARGETS = os.path.join(HERE, "targets")
BIN = os.path.dirname(sys.executable)

if REPO not in sys.path:
    sys.path.insert(0, REPO)

from probe import _paths  # noqa: E402


def tool(name: str) -> str:
    """A console script from the same bin dir as ``sys.executable`` (not a pyenv shim)."""
    path = os.path.join(BIN, name)
    if not os.access(path, os.X_OK):
        raise SystemExit("%s not found next to %s" % (name, sys.executable))
    return path


def clean_env(probe: bool = False) -> Dict[str, str]:
    """This process's environment without any PROBE* variable; with ``PROBE=1`` when ``probe``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROBE")}
    if probe:
        env["PROBE"] = "1"
    return env


# -- targets ---------------------------------------------------------------------------------------


class Target:
    """A script of bench/targets/ started as a child, handshaken through its ``READY <pid>`` line.

    Use as a context manager: the child is always killed and reaped on exit. With ``probe=True`` the
    child runs with ``PROBE=1`` and :meth:`wait_socket` waits for its agent's unix socket.
    """

    def __init__(self, script: str, *args: str, probe: bool = True, ready_timeout: float = 60.0) -> None:
        self.script = script
        self.popen = subprocess.Popen([sys.executable, os.path.join(TARGETS, script), *args],
                                      env=clean_env(probe), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True, bufsize=1)
        self.pid = self.popen.pid
        try:
            line = self.read_line(ready_timeout)
            if line.split()[:2] != ["READY", str(self.pid)]:
                raise RuntimeError("%s did not get ready: %r" % (script, line))
            if probe:
                self.wait_socket()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "Target":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def socket(self) -> str:
        return _paths.socket_path(self.pid)

    def wait_socket(self, timeout: float = 30.0) -> None:
        """Wait (bounded) until the agent's unix socket exists."""
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.socket):
            if self.popen.poll() is not None:
                raise RuntimeError("%s exited (rc %s) before its agent listened" % (self.script, self.popen.returncode))
            if time.monotonic() > deadline:
                raise RuntimeError("no agent socket %s after %.0f s" % (self.socket, timeout))
            time.sleep(0.01)

    def read_line(self, timeout: float) -> str:
        """One line of the child's stdout, or ``""`` when none comes within ``timeout`` seconds."""
        assert self.popen.stdout is not None
        ready, _, _ = select.select([self.popen.stdout], [], [], timeout)
        return self.popen.stdout.readline().strip() if ready else ""

    def send(self, line: str) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()

    def rss_kb(self) -> int:
        """VmRSS of the child, in kB, from /proc/PID/status."""
        with open("/proc/%d/status" % self.pid) as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise RuntimeError("no VmRSS for pid %d" % self.pid)

    def close(self) -> None:
        """Kill and reap the child (bounded), and remove its socket if it left one."""
        if self.popen.poll() is None:
            self.popen.kill()
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.popen.stdin, self.popen.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        for path in (self.socket, _paths.token_path(self.pid)):
            try:
                os.unlink(path)
            except OSError:
                pass


# -- timing ----------------------------------------------------------------------------------------


def time_command(argv: Sequence[str], timeout: float = 30.0, env: Optional[Dict[str, str]] = None) -> float:
    """Wall time in seconds of one whole command (start to exit); raises if it fails or times out."""
    start = time.perf_counter()
    done = subprocess.run(list(argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout,
                          env=env if env is not None else clean_env(), check=False)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError("%s failed (rc %d): %s" % (" ".join(argv), done.returncode,
                                                     done.stderr.decode(errors="replace")[-500:]))
    return elapsed


def interleave(runners: Dict[str, Callable[[], float]], runs: int, warmup: int = 1) -> Dict[str, List[float]]:
    """Run every runner ``runs`` times, interleaved (A B A B ..., the order alternating each round).

    ``warmup`` rounds are run first and thrown away. Each runner returns one measurement.
    """
    names = list(runners)
    for _ in range(warmup):
        for name in names:
            runners[name]()
    results: Dict[str, List[float]] = {name: [] for name in names}
    for i in range(runs):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            results[name].append(runners[name]())
    return results


# -- statistics and output -------------------------------------------------------------------------


@dataclass(frozen=True)
class Summary:
    n: int
    median: float
    q1: float
    q3: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Iterable[float]) -> "Summary":
        data = sorted(values)
        if not data:
            raise ValueError("no measurements")
        if len(data) >= 2:
            q1, _, q3 = statistics.quantiles(data, n=4, method="inclusive")
        else:
            q1 = q3 = data[0]
        return cls(len(data), statistics.median(data), q1, q3, data[0], data[-1])


def ms(seconds: float) -> str:
    return "%.1f" % (seconds * 1000.0)


def table(rows: List[List[str]], header: List[str]) -> str:
    """A plain left-aligned text table."""
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def summary_table(results: Dict[str, List[float]], scale: float = 1000.0, unit: str = "ms") -> str:
    """Median, IQR and min-max of each series, in ``unit`` (values are multiplied by ``scale``)."""
    rows = []
    for name, values in results.items():
        s = Summary.of(values)
        rows.append([name, str(s.n), "%.1f" % (s.median * scale), "%.1f-%.1f" % (s.q1 * scale, s.q3 * scale),
                     "%.1f-%.1f" % (s.low * scale, s.high * scale)])
    return table(rows, ["what", "n", "median %s" % unit, "IQR %s" % unit, "min-max %s" % unit])


def verdict(ok: bool) -> str:
    return "MET" if ok else "NOT MET"


def compile_probe() -> str:
    """Compile probe's modules to bytecode, as installing it does, and say so.

    An installed package has its ``.pyc`` files from the install, and an editable one writes them on its
    first run. This machine sets ``PYTHONDONTWRITEBYTECODE=1``, so without this every ``probe`` command
    of a bench would compile the modules it imports (~15 ms a command here) and time that, which no
    user's command pays twice.
    """
    import compileall

    compileall.compile_dir(os.path.join(REPO, "probe"), quiet=1)
    return "probe's modules compiled to bytecode first, as an install does (PYTHONDONTWRITEBYTECODE=%s here)" % (
        os.environ.get("PYTHONDONTWRITEBYTECODE") or "unset")


def header(title: str, lines: Sequence[str]) -> None:
    """Print what the benchmark compares, and on what machine."""
    print("=" * 78)
    print(title)
    print("=" * 78)
    for line in lines:
        print(line)
    print(compile_probe())
    print("probe at %s" % git_state())
    print("python %s (%s); %d CPUs; load average %s; %s" % (
        sys.version.split()[0], sys.executable, os.cpu_count() or 0,
        " ".join("%.2f" % x for x in os.getloadavg()), time.strftime("%Y-%m-%d %H:%M:%S")))
    print()


def git_state() -> str:
    """The repository's commit, and whether probe/ has uncommitted changes (results depend on both)."""
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=False).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--", "probe"], capture_output=True,
                               text=True, timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown commit"
    return "commit %s%s" % (head or "?", " + uncommitted changes in probe/" if dirty else "")
