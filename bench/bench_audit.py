"""Scopes and the audit trail (issue 22): the unaudited path (a query) is no slower, and what an audited
eval costs.

    python bench/bench_audit.py [--runs 300] [--before COMMIT]

Three idle targets side by side: two run probe as of COMMIT (default: the commit before scopes and the
audit trail came; the pair shows the noise floor), the third the working tree. Interleaved, each round: ``POST /v1/query`` with
``SELECT 1`` over the unix socket (round trip; read scope, not recorded), and ``POST /v1/eval`` of
``1`` (eval scope: recorded twice in the trail by the working tree, not at all by COMMIT), each on a
connection of its own as the client does. Medians with IQR and min-max, in microseconds.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List

from _common import REPO, clean_env, figure, header, interleave, summary_table

from probe.client import transport

TARGET = "import os, time, probe; probe.start(); print('READY', os.getpid(), flush=True); time.sleep(3600)"


def start(tree: str, runtime: str) -> subprocess.Popen:
    env = dict(clean_env(), PYTHONPATH=tree, PROBE_RUNTIME_DIR=runtime)
    popen = subprocess.Popen([sys.executable, "-c", TARGET], env=env, stdout=subprocess.PIPE, text=True, cwd=tree)
    assert popen.stdout is not None
    line = popen.stdout.readline()
    if not line.startswith("READY"):
        popen.kill()
        raise SystemExit("a target did not start: %r" % line)
    deadline = time.monotonic() + 10
    while not os.path.exists(os.path.join(runtime, "%d.sock" % popen.pid)):
        if time.monotonic() > deadline:
            popen.kill()
            raise SystemExit("no socket")
        time.sleep(0.01)
    return popen


def runner(runtime: str, pid: int, path: str, body: Dict[str, str]) -> Callable[[], float]:
    address = transport.UnixAddress(os.path.join(runtime, "%d.sock" % pid))
    data = json.dumps(body).encode()

    def once() -> float:
        began = time.perf_counter()
        answer = transport.request(address, "POST", path, data, {"Content-Type": "application/json"}, 10.0)
        took = time.perf_counter() - began
        if answer.status != 200:
            raise SystemExit("%s answered %d: %s" % (path, answer.status, bytes(answer.body)[:200]))
        transport.release(answer)
        return took

    return once


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--before", default="", help="the commit to compare with (default: before scopes)")
    args = parser.parse_args()
    before = args.before or subprocess.run(
        ["git", "log", "--format=%H", "-n", "1", "--grep", "Scopes on every token", "--", "probe/agent/scopes.py"],
        cwd=REPO, capture_output=True, text=True).stdout.strip() + "^"
    old = tempfile.mkdtemp(prefix="probe-bench-old-")
    archive = subprocess.run(["git", "archive", before], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", old], input=archive, check=True)
    names = ("before", "before again", "now")  # "before again": the A/A pair that shows the noise floor
    runtimes = {name: tempfile.mkdtemp(prefix="probe-bench-%s-" % name.replace(" ", "-")) for name in names}
    for directory in runtimes.values():
        os.chmod(directory, 0o700)
    targets = {name: start(REPO if name == "now" else old, runtimes[name]) for name in names}
    try:
        runners: Dict[str, Callable[[], float]] = {}
        for name, popen in targets.items():
            runners["query, %s" % name] = runner(runtimes[name], popen.pid, "/v1/query", {"sql": "SELECT 1 AS x"})
        for name, popen in targets.items():
            if name != "before again":
                runners["eval, %s" % name] = runner(runtimes[name], popen.pid, "/v1/eval", {"code": "1"})
        results: Dict[str, List[float]] = interleave(runners, args.runs, warmup=5)
        header("bench_audit: POST /v1/query (read, not recorded) and POST /v1/eval (recorded) before and after "
               "scopes and the audit trail", ["before: %s" % before, "runs: %d, interleaved" % args.runs])
        print(summary_table(results, scale=1e6, unit="us"))
        for what in ("query", "eval"):
            figure("POST /v1/%s, now" % what, results["%s, now" % what], peer="the same, before", scale=1e6, unit="us",
                   peer_values=results["%s, before" % what])
        figure("POST /v1/query, before again (the noise floor)", results["query, before again"], scale=1e6, unit="us",
               peer="the same, before", peer_values=results["query, before"])
        trail = [n for n in os.listdir(runtimes["now"]) if n.startswith("audit-")]
        print("\ntrail of the working tree's target: %s" % ", ".join(
            "%s (%d bytes)" % (n, os.path.getsize(os.path.join(runtimes["now"], n))) for n in trail))
    finally:
        for popen in targets.values():
            popen.kill()
            popen.wait(10)


if __name__ == "__main__":
    main()
