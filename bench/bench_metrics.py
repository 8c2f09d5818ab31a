"""Prometheus metrics from the node helper (issue 36 items 1 and 5): what one scrape costs at the helper, and
what scrapes cost a rank, beside the peer (a hand-written ``prometheus_client`` exporter in the loop).

    python bench/bench_metrics.py [--scrapes 50] [--rounds 4] [--window 5] [--rate 20]

1. One scrape at the helper. A real ``probe.host.helper.Helper`` with its real collector
   (``probe.host.metrics``) and HTTP server, and a real stall watch (not started: looked once), over
   SIMULATED ranks: ``sleep`` processes registered as ranks, each with a progress file written in the step
   counter's format and a file at its agent's socket path (fresh: "running"); a rank's RSS is read from
   /proc as for a real one. Cases: a node of 8 ranks; the master's node of a simulated 1,024-rank job on
   128 nodes (8 ranks here, 127 other nodes' reports held, as bench_fanout_helpers.py sends them); a
   dense node of 64 ranks. Figures: the wall time of ``GET /metrics`` from this process (over TCP on
   127.0.0.1), and the collector's CPU for one scrape (``generate_latest`` in this process). Goal: < 50 ms.
2. What scrapes cost a rank. Two real training loops at once (``bench/targets/metrics_loop.py``, a small
   MLP, one thread): one with probe (``PROBE_PORT``, an agent and the step counter, its node helper serving
   ``PROBE_METRICS_PORT``), one with a hand-written exporter in the loop (a counter and two gauges set each
   step, ``prometheus_client``'s server in the rank). Windows with no scrape and windows with ``--rate``
   scrapes a second of each (far more than Prometheus's usual one in 15 s, so that a cost shows),
   interleaved (A B B A); each loop reports its median step and its CPU a step per window. The probe rank
   records every request its agent takes (``PROBE_AUDIT_READS=1``): the requests counted in its trail
   during the scraped windows are the scrapes' cost in requests (0 expected; ``PROBE_METRICS_EVERY=0``, the
   framework reader off); the exporter serves every scrape itself. Then the framework reader's read
   (``torch.trainer``'s loss, from this process, 20 times): what it asks of the rank every
   ``PROBE_METRICS_EVERY`` seconds.
"""

import argparse
import os
import select
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_RUN = tempfile.mkdtemp(prefix="probe-bench-metrics-")
os.chmod(_RUN, 0o700)
os.environ["PROBE_RUNTIME_DIR"] = _RUN  # before probe is imported: the simulated ranks' files go here

from _common import REPO, TARGETS, Summary, clean_env, figure, header, table, verdict  # noqa: E402

GOAL_MS = 50.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read()


# -- 1. one scrape at the helper ---------------------------------------------------------------------


class Node:
    """A real helper over simulated ranks (sleep processes with progress and socket files)."""

    def __init__(self, ranks: int, other_nodes: int = 0, per_node: int = 8) -> None:
        from probe.host.helper import Helper
        from probe.host.watch import Watch

        self.base = _free_port()
        self.procs = [subprocess.Popen(["sleep", "600"]) for _ in range(ranks)]
        os.environ["PROBE_METRICS_PORT"] = str(_free_port())
        self.helper = Helper(self.base, "bench-metrics-token", None, kind="node")
        world = ranks + other_nodes * per_node
        for local, proc in enumerate(self.procs):
            self.helper._take_registration({"pid": proc.pid, "rank": local, "local_rank": local, "world_size": world,
                                            "node": 0, "port": self.base + local, "source": "torchrun"})
        for node in range(1, other_nodes + 1):
            members = [{"rank": node * per_node + i, "local_rank": i, "world_size": world, "port": 9700 + i,
                        "pid": 100000 + node * per_node + i, "state": "running", "restarts": 0,
                        "heartbeat_age": 0.5} for i in range(per_node)]
            self.helper._take_report({"node": node, "host": "node%d" % node, "helper": "node%d:9699" % node,
                                      "members": members})
        self.step(1)
        from probe.host import metrics

        self.server = metrics.start(self.helper, "127.0.0.1")
        assert self.server is not None, "no metrics server"
        self.url = "http://127.0.0.1:%s/metrics" % os.environ["PROBE_METRICS_PORT"]
        self.helper.watch = Watch(self.helper)
        self.helper.watch.look()

    def step(self, steps: int) -> None:
        """Each rank made ``steps`` steps, the last just now: its progress file and its agent's heartbeat."""
        from probe import _paths
        from probe.tables.torch import steps as counter

        now = time.monotonic()
        for proc in self.procs:
            ticks = _paths.process_start_ticks(str(proc.pid))
            raw = counter.PROGRESS.pack(counter.PROGRESS_MAGIC, counter.PROGRESS_VERSION, proc.pid, steps, now, 0.25,
                                        now - steps * 0.25, ticks)
            with open(_paths.progress_path(proc.pid), "wb") as handle:
                handle.write(raw)
            with open(_paths.socket_path(proc.pid), "a"):
                os.utime(_paths.socket_path(proc.pid))

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for proc in self.procs:
            proc.kill()
            proc.wait(10)
        os.environ.pop("PROBE_METRICS_PORT", None)


def scrape_costs(scrapes: int) -> Dict[str, Any]:
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from probe.host.metrics import NodeCollector

    out: Dict[str, Any] = {}
    rows = []
    for name, ranks, others, goal in (("node of 8 ranks", 8, 0, True),
                                      ("master of 1,024 ranks / 128 nodes (8 here)", 8, 127, True),
                                      ("node of 64 ranks (no goal)", 64, 0, False)):
        node = Node(ranks, others)
        try:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(NodeCollector(node.helper))
            walls, cpus, size = [], [], 0
            for i in range(scrapes + 3):
                node.step(10 + i)
                start = time.perf_counter()
                body = _get(node.url)
                wall = time.perf_counter() - start
                begin = time.thread_time()
                generate_latest(registry)
                cpu = time.thread_time() - begin
                if i >= 3:  # the first scrapes read /proc's environ of each rank once (the job's id)
                    walls.append(wall)
                    cpus.append(cpu)
                size = len(body)
            assert body.count(b"probe_steps_total{") == ranks, body[:400]
        finally:
            node.close()
        w, c = Summary.of(walls), Summary.of(cpus)
        rows.append([name, str(w.n), "%.2f" % (w.median * 1e3), "%.2f-%.2f" % (w.q1 * 1e3, w.q3 * 1e3),
                     "%.2f-%.2f" % (w.low * 1e3, w.high * 1e3), "%.2f" % (c.median * 1e3), "%d" % size])
        figure("GET /metrics at the helper, %s" % name, walls, unit="ms", goal="< %.0f ms" % GOAL_MS if goal else None,
               met=w.median * 1e3 < GOAL_MS if goal else None)
        figure("collector CPU a scrape, %s" % name, cpus, unit="ms")
        if goal:
            out[name] = w.median * 1e3
    print(table(rows, ["scrape", "n", "wall median ms", "IQR", "min-max", "CPU median ms", "bytes"]))
    worst = max(out.values())
    print()
    print("SUMMARY one scrape at a node's helper (8 ranks; the master of 1,024): median %.2f ms at worst "
          "(goal < %.0f ms): %s"
          % (worst, GOAL_MS, verdict(worst < GOAL_MS)))
    return out


# -- 2. the cost on a rank -------------------------------------------------------------------------


class Loop:
    """metrics_loop.py in one of its modes; killed and reaped at close."""

    def __init__(self, mode: str, env: Dict[str, str], args: Tuple[str, ...] = ()) -> None:
        full = clean_env(False)
        full.update(PYTHONPATH=REPO, PYTHONUNBUFFERED="1", **env)
        self.popen = subprocess.Popen([sys.executable, os.path.join(TARGETS, "metrics_loop.py"), mode, *args],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      env=full, text=True, bufsize=1, start_new_session=True)
        self.mode = mode
        words = self.line(300).split()
        if words[:1] != ["READY"]:
            self.close()
            raise RuntimeError("metrics_loop.py %s did not get ready: %r" % (mode, words))
        self.pid = int(words[1])

    def line(self, timeout: float) -> str:
        assert self.popen.stdout is not None
        ready, _, _ = select.select([self.popen.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError("no line from metrics_loop.py %s in %.0f s" % (self.mode, timeout))
        return self.popen.stdout.readline().strip()

    def report(self) -> Tuple[int, float, float]:
        assert self.popen.stdin is not None
        self.popen.stdin.write("report\n")
        self.popen.stdin.flush()
        words = self.line(60).split()
        assert words[:1] == ["TIMES"], words
        return int(words[1]), float(words[2]), float(words[3])

    def close(self) -> None:
        try:
            os.killpg(self.popen.pid, 9)
        except ProcessLookupError:
            pass
        self.popen.wait(20)
        for stream in (self.popen.stdin, self.popen.stdout):
            if stream is not None:
                stream.close()


def _reads(pid: int, run: str) -> int:
    """Requests recorded in the rank's trail of reads (``PROBE_AUDIT_READS=1``)."""
    total = 0
    for name in os.listdir(run):
        if name.startswith("audit-%d-" % pid) and ".reads.jsonl" in name:
            with open(os.path.join(run, name), "rb") as handle:
                total += handle.read().count(b"\n")
    return total


def rank_cost(rounds: int, window: float, rate: float) -> None:
    run = tempfile.mkdtemp(prefix="probe-bench-metrics-rank-")
    os.chmod(run, 0o700)
    probe_port, helper_metrics, exporter_port = _free_port(), _free_port(), _free_port()
    probe = exporter = None
    try:
        probe = Loop("probe", {"PROBE": "1", "PROBE_PORT": "127.0.0.1:%d" % probe_port, "PROBE_RUNTIME_DIR": run,
                               "PROBE_METRICS_PORT": str(helper_metrics), "PROBE_AUDIT_READS": "1",
                               "PROBE_SNAPSHOT": "1", "PROBE_METRICS_EVERY": "0", "RANK": "0", "LOCAL_RANK": "0",
                               "WORLD_SIZE": "1"})
        exporter = Loop("exporter", {"RANK": "0", "LOCAL_RANK": "0"}, (str(exporter_port),))
        urls = {"probe": "http://127.0.0.1:%d/metrics" % helper_metrics,
                "exporter": "http://127.0.0.1:%d/metrics" % exporter_port}
        deadline = time.monotonic() + 120
        while b'probe_steps_total{' not in _safe_get(urls["probe"]):
            if time.monotonic() > deadline:
                raise RuntimeError("the probe rank's helper serves no probe_steps_total at %s" % urls["probe"])
            time.sleep(0.5)
        loops = {"probe": probe, "exporter": exporter}
        kept: Dict[Tuple[str, bool], List[Tuple[float, float]]] = {(k, s): [] for k in loops for s in (False, True)}
        reads_before = _reads(probe.pid, run)
        scraped_count = {"probe": 0, "exporter": 0}
        for loop in loops.values():
            loop.report()  # start the first window clean
        for i in range(rounds * 2):
            scraping = (i % 4) in (1, 2)  # A B B A
            stop = threading.Event()
            threads = []
            if scraping:
                for name, url in urls.items():
                    def scrape(name: str = name, url: str = url) -> None:
                        while not stop.wait(1.0 / rate):
                            _get(url)
                            scraped_count[name] += 1
                    threads.append(threading.Thread(target=scrape, daemon=True))
                    threads[-1].start()
            time.sleep(window)
            stop.set()
            for thread in threads:
                thread.join(10)
            for name, loop in loops.items():
                steps, median, cpu = loop.report()
                kept[(name, scraping)].append((median, cpu))
        reads = _reads(probe.pid, run) - reads_before
        framework = _framework_reads(probe.pid, run, 20)
    finally:
        for loop in (probe, exporter):
            if loop is not None:
                loop.close()
        _stop_helper(run)
    rows = []
    for name in ("probe", "exporter"):
        quiet, busy = kept[(name, False)], kept[(name, True)]
        q_step, b_step = statistics.median(m for m, _ in quiet), statistics.median(m for m, _ in busy)
        q_cpu, b_cpu = statistics.median(c for _, c in quiet), statistics.median(c for _, c in busy)
        rows.append([name, "%.3f" % (q_step * 1e3), "%.3f" % (b_step * 1e3), "%.3f" % (b_step / q_step),
                     "%.1f" % (q_cpu * 1e6), "%.1f" % (b_cpu * 1e6), "%.3f" % (b_cpu / q_cpu)])
        figure("%s: median step, scraped %g/s" % (name, rate), [m for m, _ in busy], unit="ms",
               peer="not scraped", peer_values=[m for m, _ in quiet], ratio=b_step / q_step)
        figure("%s: rank CPU a step, scraped %g/s" % (name, rate), [c for _, c in busy], unit="us", scale=1e6,
               peer="not scraped", peer_values=[c for _, c in quiet], ratio=b_cpu / q_cpu)
    print(table(rows, ["rank counted by", "step ms quiet", "step ms scraped", "ratio", "CPU us/step quiet",
                       "CPU us/step scraped", "ratio"]))
    figure("requests to the probe rank's agent during %d scrapes" % scraped_count["probe"], value=reads, unit="requests")
    print()
    print("scrapes: probe's helper %d, the exporter %d (served inside its rank)" % (
        scraped_count["probe"], scraped_count["exporter"]))
    print("SUMMARY requests to the probe rank during %d scrapes: %d (the exporter's rank served %d itself)"
          % (scraped_count["probe"], reads, scraped_count["exporter"]))
    f = Summary.of(framework)
    figure("the framework reader's read of a rank (its logged loss)", framework, unit="ms")
    print("SUMMARY the framework's loss read from the rank: median %.1f ms (IQR %.1f-%.1f), "
          "once every PROBE_METRICS_EVERY (15 s): %.3f %% of the rank's time" % (
              f.median * 1e3, f.q1 * 1e3, f.q3 * 1e3, 100.0 * f.median / 15.0))


def _framework_reads(pid: int, run: str, count: int) -> List[float]:
    """Wall time of the framework reader's table read (``probe.host.framework``; the loss alone) from the rank,
    ``count`` times: what it asks of the rank every ``PROBE_METRICS_EVERY`` seconds."""
    from probe.client.client import Client
    from probe.client.targets import parse_target

    saved = os.environ["PROBE_RUNTIME_DIR"]
    os.environ["PROBE_RUNTIME_DIR"] = run
    try:
        client = Client(parse_target(str(pid)), None, 10.0)
        out = []
        for _ in range(count):
            start = time.perf_counter()
            client.table_rows("torch.trainer", 8, ["loss"])
            out.append(time.perf_counter() - start)
            time.sleep(0.1)
        return out
    finally:
        os.environ["PROBE_RUNTIME_DIR"] = saved


def _safe_get(url: str) -> bytes:
    try:
        return _get(url)
    except OSError:
        return b""


def _stop_helper(run: str) -> None:
    """The node helper the probe rank started (``python -m probe.host``): it would linger 30 s; end it."""
    for name in os.listdir(run):
        if name.startswith("host-") and name.endswith(".sock"):
            try:
                os.kill(int(name[len("host-"):-len(".sock")]), 9)
            except (ValueError, ProcessLookupError, PermissionError):
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=4, help="A B B A groups of windows: quiet and scraped")
    parser.add_argument("--window", type=float, default=5.0, help="seconds a window")
    parser.add_argument("--rate", type=float, default=20.0, help="scrapes a second of each rank in a scraped window")
    parser.add_argument("--skip-rank", action="store_true", help="part 1 only")
    args = parser.parse_args()
    header("Prometheus metrics from the node helper (issue 36)", [
        "1: GET /metrics at a real helper over simulated ranks (8; 1,024 on 128 nodes at the master; 64)",
        "2: a rank's step and CPU, scraped %g/s vs not, probe's helper vs a hand-written exporter in the loop"
        % args.rate])
    scrape_costs(args.scrapes)
    if not args.skip_rank:
        print()
        rank_cost(args.rounds, args.window, args.rate)


if __name__ == "__main__":
    main()
