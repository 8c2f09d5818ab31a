"""Rank start -> listed: how long after a rank process starts its node's helper lists it (issue 18).

    python bench/bench_rank_listed.py [--rounds 10]

Each round starts, in a runtime directory of its own, one rank as srun starts it (SLURM_PROCID,
SLURM_LOCALID; ``PROBE=1 PROBE_PORT=...``; no torch), which finds no helper and starts one, then a second
rank, which registers with that helper. From each rank's ``Popen`` it times, polling every 5 ms: its
agent's unix socket appearing (the peer: an agent ready, which a rank pays with or without the helper),
and the rank appearing as ``running`` in the helper's member list (``GET /v1/ranks`` over the node's unix
socket). The difference is what registering adds. Processes are killed and reaped, and the helper is
waited for (it leaves a second after its ranks: PROBE_HELPER_LINGER_S=1).
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

from _common import REPO, Summary, clean_env, header, table

from probe.client import transport  # noqa: E402

RANK = ("import os, sys, threading\nprint('READY', os.getpid(), flush=True)\nthreading.Event().wait(600)\n")


def _free_pair() -> int:
    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
        try:
            with socket.socket() as b, socket.socket() as c, socket.socket() as d:
                b.bind(("127.0.0.1", port - 1))
                c.bind(("127.0.0.1", port + 1))
                d.bind(("127.0.0.1", port))
            return port
        except OSError:
            continue
    raise SystemExit("no free ports")


def _listed(node_socket: str) -> List[int]:
    """The pids the helper lists as running; [] where it does not answer yet."""
    if not os.path.exists(node_socket):
        return []
    try:
        answer = transport.request(transport.UnixAddress(node_socket), "GET", "/v1/ranks", None, {}, 2.0)
    except Exception:
        return []
    if answer.status != 200:
        return []
    return [m["pid"] for m in json.loads(bytes(answer.body))["members"] if m["state"] == "running"]


def one_rank(runtime: str, port: int, rank: int, deadline_s: float = 60.0) -> Dict[str, float]:
    env = dict(clean_env(probe=True), PROBE_PORT="127.0.0.1:%d" % port, PROBE_RUNTIME_DIR=runtime,
               PROBE_HELPER_LINGER_S="1", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS="2",
               PYTHONPATH=REPO)
    start = time.monotonic()
    popen = subprocess.Popen([sys.executable, "-c", RANK], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    sock = os.path.join(runtime, "%d.sock" % popen.pid)
    node = os.path.join(runtime, "node-%d.sock" % port)
    seen: Dict[str, float] = {}
    while "listed" not in seen:
        now = time.monotonic()
        if now - start > deadline_s:
            popen.kill()
            raise SystemExit("rank %d not listed within %.0f s" % (rank, deadline_s))
        if "agent" not in seen and os.path.exists(sock):
            seen["agent"] = now - start
        if "agent" in seen and popen.pid in _listed(node):
            seen["listed"] = time.monotonic() - start
        time.sleep(0.005)
    seen["popen"] = popen  # type: ignore[assignment]
    return seen


def _helper_pid(runtime: str, port: int) -> Optional[int]:
    try:
        answer = transport.request(transport.UnixAddress(os.path.join(runtime, "node-%d.sock" % port)), "GET",
                                   "/v1/health", None, {}, 2.0)
        return int(json.loads(bytes(answer.body))["pid"])
    except Exception:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    header("Rank start -> listed by its node helper (first rank starts the helper; second registers)",
           ["two plain rank processes per round, srun's variables, no torch; the peer is the agent's socket"])
    series: Dict[str, List[float]] = {k: [] for k in ("first: agent ready", "first: listed", "second: agent ready",
                                                      "second: listed")}
    for _ in range(args.rounds):
        runtime = tempfile.mkdtemp(prefix="probe-bench-listed-")
        os.chmod(runtime, 0o700)
        port = _free_pair()
        procs = []
        try:
            for rank, name in ((0, "first"), (1, "second")):
                seen = one_rank(runtime, port, rank)
                procs.append(seen.pop("popen"))
                series["%s: agent ready" % name].append(seen["agent"])
                series["%s: listed" % name].append(seen["listed"])
            helper = _helper_pid(runtime, port)
        finally:
            for popen in procs:
                popen.kill()  # type: ignore[attr-defined]
                popen.wait(10)  # type: ignore[attr-defined]
        deadline = time.monotonic() + 30
        while helper and os.path.exists("/proc/%d" % helper) and time.monotonic() < deadline:
            time.sleep(0.1)
        shutil.rmtree(runtime, ignore_errors=True)
    rows = []
    for name, values in series.items():
        s = Summary.of(values)
        rows.append([name, str(s.n), "%.0f" % (s.median * 1000), "%.0f-%.0f" % (s.q1 * 1000, s.q3 * 1000),
                     "%.0f-%.0f" % (s.low * 1000, s.high * 1000)])
    print(table(rows, ["from Popen", "n", "median ms", "IQR ms", "min-max ms"]))
    for name in ("first", "second"):
        added = [b - a for a, b in zip(series["%s: agent ready" % name], series["%s: listed" % name])]
        s = Summary.of(added)
        print("%s rank: listed %.0f ms (median; IQR %.0f-%.0f) after its agent was ready" % (
            name, s.median * 1000, s.q1 * 1000, s.q3 * 1000))


if __name__ == "__main__":
    main()
