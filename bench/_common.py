"""Shared helpers for the benchmarks: spawning targets, timing commands, statistics and tables.

Every benchmark measures peers side by side in the same run, interleaved, and reports medians with
their spread (min-max and IQR): the machine is small (2 cores), shared and noisy, so a single
absolute time means little. Every child process is killed and reaped, and every wait is bounded.
"""

import atexit
import json
import os
import select
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, TextIO

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TARGETS = os.path.join(HERE, "targets")
RESULTS = os.path.join(HERE, "results")
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

    def __init__(self, script: str, *args: str, probe: bool = True, ready_timeout: float = 60.0,
                 python: str = sys.executable) -> None:
        self.script = script
        self.popen = subprocess.Popen([python, os.path.join(TARGETS, script), *args],
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
        if RUN is not None:
            RUN.rows.append({"what": name, "unit": unit, **spread(s, scale)})
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
    """Print what the benchmark compares, and on what machine; the run's record starts here (see :class:`Run`)."""
    start_run(title)
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


# -- records: each run as a JSON file under bench/results/ (bench/report.py makes RESULTS.md of them) ----------


def spread(s: Summary, scale: float = 1.0) -> Dict[str, Any]:
    """A summary's median and spread as a record holds them, in the unit printed."""
    return {"n": s.n, "median": round(s.median * scale, 6), "iqr": [round(s.q1 * scale, 6), round(s.q3 * scale, 6)],
            "range": [round(s.low * scale, 6), round(s.high * scale, 6)]}


def machine() -> Dict[str, Any]:
    """What the figures ran on: CPU count and model (from /proc/cpuinfo), Python."""
    model = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "model": model, "python": sys.version.split()[0], "platform": sys.platform}


def commit() -> Dict[str, Any]:
    """The repository's full commit (None outside git), and whether probe/ had uncommitted changes."""
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              check=False).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--", "probe"], capture_output=True,
                               text=True, timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    return {"commit": head or None, "dirty": bool(dirty) if head else None}


class _Tee:
    """stdout that also keeps what was printed: the record holds the run's printed tables as they were."""

    def __init__(self, stream: TextIO, kept: List[str]) -> None:
        self._stream = stream
        self._kept = kept

    def write(self, text: str) -> int:
        self._kept.append(text)
        return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class Run:
    """One run of a bench: its figures (peer, ratio, medians and spread), the tables and lines it printed.

    :func:`header` starts it; at exit it is written to ``bench/results/DATE_TIME_BENCH.json`` (or under
    ``$BENCH_RESULTS``), unless an exception ended the run or ``BENCH_RECORD=0`` (smoke runs: ``run_all.py
    --quick``).
    """

    def __init__(self, title: str) -> None:
        self.bench = os.path.splitext(os.path.basename(sys.argv[0]))[0] or "bench"
        self.titles = [title]
        self.argv = sys.argv[1:]
        self.started = time.time()
        self.load_start = [round(x, 2) for x in os.getloadavg()]
        self.figures: List[Dict[str, Any]] = []
        self.rows: List[Dict[str, Any]] = []
        self.printed: List[str] = []
        self.failed = False

    def record(self) -> Dict[str, Any]:
        output = "".join(self.printed).splitlines()
        return {
            "schema": 1, "bench": self.bench, "title": self.titles[0], "argv": self.argv,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
            "seconds": round(time.time() - self.started, 1), "machine": machine(),
            "load": {"start": self.load_start, "end": [round(x, 2) for x in os.getloadavg()]}, **commit(),
            "figures": self.figures, "summary": [line for line in output if line.startswith("SUMMARY")],
            "rows": self.rows, "output": output, "notes": "; ".join(self.titles[1:]),
        }

    def write(self, directory: str = RESULTS) -> str:
        os.makedirs(directory, exist_ok=True)
        stamp = time.strftime("%Y-%m-%d_%H%M%S", time.gmtime(self.started))
        path = os.path.join(directory, "%s_%s.json" % (stamp, self.bench))
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.record(), handle, indent=1, ensure_ascii=False)
            handle.write("\n")
        return path


RUN: Optional[Run] = None
"""The run of this process, once :func:`header` started it."""


def start_run(title: str) -> Run:
    """Start this process's run (a second header adds its title to the same run)."""
    global RUN
    if RUN is not None:
        RUN.titles.append(title)
        return RUN
    RUN = Run(title)
    sys.stdout = _Tee(sys.stdout, RUN.printed)  # type: ignore[assignment]
    previous = sys.excepthook

    def failed(*exc: Any) -> None:
        if RUN is not None:
            RUN.failed = True
        previous(*exc)

    sys.excepthook = failed
    atexit.register(_write_run)
    return RUN


def _write_run() -> None:
    if RUN is None or RUN.failed or os.environ.get("BENCH_RECORD", "1") == "0":
        return
    path = RUN.write(os.environ.get("BENCH_RESULTS") or RESULTS)
    shown = os.path.relpath(path, REPO) if path.startswith(REPO + os.sep) else path
    print("record: %s (python bench/report.py makes bench/RESULTS.md of the records)" % shown)
    sys.stdout.flush()


def figure(name: str, values: Optional[Sequence[float]] = None, *, peer: Optional[str] = None,
           peer_values: Optional[Sequence[float]] = None, unit: str = "ms", scale: float = 1000.0,
           value: Optional[float] = None, ratio: Optional[float] = None, goal: Optional[str] = None,
           met: Optional[bool] = None) -> Dict[str, Any]:
    """Add a figure to this run's record: the measured series (median, IQR, min-max in ``unit``) and its peer's,
    measured in the same rounds, with the ratio of the medians and the spread of the per-round ratios.

    ``value`` stands for a figure that is one number, not a series; ``ratio`` for one computed elsewhere.
    """
    entry: Dict[str, Any] = {"figure": name, "peer": peer, "unit": unit}
    if values is not None:
        entry.update(spread(Summary.of(values), scale))
    elif value is not None:
        entry["median"] = round(value, 6)
    if peer_values is not None:
        peer_summary = Summary.of(peer_values)
        entry["peer_median"] = round(peer_summary.median * scale, 6)
        if values is not None and ratio is None:
            ratio = Summary.of(values).median / peer_summary.median
            if len(values) == len(peer_values) and all(peer_values):
                entry["per_round_ratio"] = spread(Summary.of(a / b for a, b in zip(values, peer_values)))
    entry["ratio"] = None if ratio is None else round(ratio, 4)
    entry["goal"] = goal
    entry["met"] = met
    if RUN is not None:
        RUN.figures.append(entry)
    return entry
