"""Metrics (issue 36 items 1 and 3): a real 2-rank torchrun job with ``PROBE_METRICS_PORT``; its node helper's
``/metrics`` read directly and by a real Prometheus (Debian's ``prometheus``) that scrapes it every second
with the shipped rules loaded; the rules checked by ``promtool``; every query of the Grafana dashboard run
against that Prometheus. One job for the module."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from typing import Any, Dict, Iterator, List

import pytest

from procs import REPO, TARGETS, Proc, run_cli, scaled, target_env
from torch_job import ready_lines

TORCHRUN = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
RULES = os.path.join(REPO, "deploy", "prometheus", "probe-rules.yml")
DASHBOARD = os.path.join(REPO, "deploy", "grafana", "probe.json")
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")

needs_torchrun = pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun (torch) is not installed")
needs_client = pytest.mark.skipif(__import__("importlib").util.find_spec("prometheus_client") is None,
                                  reason="prometheus_client is not installed")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _free_ports(count: int) -> int:
    """p such that p - 1 .. p + count - 1 were free a moment ago (the helper takes p - 1)."""
    for _ in range(100):
        base = _free_port()
        socks = []
        try:
            for port in range(base - 1, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no run of free ports")


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read()


def _until(check, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except OSError as exc:  # not listening yet
            last = exc
        else:
            if last:
                return last
        time.sleep(0.25)
    raise AssertionError("%s within %.0f s; last: %r" % (what, timeout, last))


_SAMPLE = re.compile(r'^(\w+)\{([^}]*)\} (\S+)$')


def _samples(text: str) -> List[Dict[str, Any]]:
    out = []
    for line in text.splitlines():
        found = _SAMPLE.match(line)
        if found:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', found.group(2)))
            out.append({"name": found.group(1), "labels": labels, "value": float(found.group(3))})
    return out


def _audited_reads(pids: Any) -> List[Dict[str, Any]]:
    """The records of the ranks' trails of read requests (``audit-PID-TICKS.reads.jsonl``), begun ones."""
    directory = os.environ["PROBE_RUNTIME_DIR"]
    out = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".reads.jsonl") and any(name.startswith("audit-%d-" % pid) for pid in pids):
            with open(os.path.join(directory, name)) as handle:
                out += [r for r in map(json.loads, handle.read().splitlines()) if r.get("phase") == "start"]
    return out


@pytest.fixture(scope="module")
def job() -> Iterator[Dict[str, Any]]:
    """A 2-rank gloo job on the CPU under torchrun, its helper serving metrics on 127.0.0.1."""
    if not os.path.exists(TORCHRUN):
        pytest.skip("torchrun (torch) is not installed")
    port, metrics = _free_ports(2), _free_port()
    launcher = subprocess.Popen([TORCHRUN, "--nproc-per-node=2", "--master-port=%d" % _free_port(),
                                 os.path.join(TARGETS, "dist_steps.py")], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True,
                                env=target_env(probe=False, PROBE_PORT="127.0.0.1:%d" % port,
                                               PROBE_METRICS_PORT=str(metrics), STEP_SLEEP="0.05",
                                               PROBE_AUDIT_READS="1", PROBE_METRICS_EVERY="2",
                                               PROBE_STACK_EVERY="0"))  # the stack history asks ranks too
    output = Proc(launcher, "torchrun dist_steps.py")
    try:
        ranks = {int(w[2]): int(w[1]) for w in ready_lines(output, 2, time.monotonic() + scaled(90))}
        yield {"ranks": ranks, "url": "http://127.0.0.1:%d/metrics" % metrics, "metrics_port": metrics}
    finally:
        from probe.reader.proc import children

        for pid in children(launcher.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        launcher.wait(20)
        for stream in (launcher.stdout, launcher.stderr):
            if stream:
                stream.close()


@needs_client
@needs_torchrun
def test_the_helper_serves_every_ranks_metrics_without_asking_them(job: Dict[str, Any]) -> None:
    def both_stepping() -> List[Dict[str, Any]]:
        samples = _samples(_get(job["url"]).decode("utf-8"))
        steps = [s for s in samples if s["name"] == "probe_steps_total" and s["value"] >= 3]
        return samples if {s["labels"]["rank"] for s in steps} == {"0", "1"} else []

    samples = _until(both_stepping, scaled(30), "probe_steps_total for ranks 0 and 1")
    steps = {s["labels"]["rank"]: s for s in samples if s["name"] == "probe_steps_total"}
    assert steps["1"]["labels"]["local_rank"] == "1" and steps["0"]["labels"]["node"] == "0"
    assert steps["0"]["labels"]["job"] == steps["1"]["labels"]["job"] != ""
    states = {s["labels"]["rank"]: s["labels"]["state"] for s in samples
              if s["name"] == "probe_rank_state" and s["value"] == 1}
    assert set(states) == {"0", "1"} and set(states.values()) <= {"running", "silent"}, states  # silent: a loaded box
    for name in ("probe_rank_rss_bytes", "probe_step_time_seconds", "probe_last_step_age_seconds"):
        assert {s["labels"]["rank"] for s in samples if s["name"] == name and s["value"] > 0} == {"0", "1"}, name
    verdict = [s["value"] for s in samples if s["name"] == "probe_verdict"]
    assert verdict == [0.0], samples  # stepping, by the stall watch
    assert [s["value"] for s in samples if s["name"] == "probe_records_total"] == [0.0]
    # Every request an agent takes is in its trail (PROBE_AUDIT_READS=1). The only ones the helper sends are the
    # framework reader's (a table read a rank, at most every PROBE_METRICS_EVERY=2 s): none per scrape.
    before = len(_audited_reads(job["ranks"].values()))
    start = time.monotonic()
    for _ in range(30):
        _get(job["url"])
    elapsed = time.monotonic() - start
    new = _audited_reads(job["ranks"].values())[before:]
    assert len(new) <= 2 * (elapsed / 2 + 2), (elapsed, new)  # 2 ranks, a read each, per 2 s (+ one begun)
    assert {(r["command"], r["detail"]["table"]) for r in new} <= {("reading a table", "torch.trainer")}, new
    assert run_cli(str(job["ranks"][0]), "health").code == 0
    assert any(r["command"] != "reading a table" for r in _audited_reads(job["ranks"].values())[before:])  # a request shows

    def read_times() -> List[Dict[str, Any]]:  # the framework reader asked both (their loss: none, no framework)
        took = [s for s in _samples(_get(job["url"]).decode("utf-8")) if s["name"] == "probe_framework_read_seconds"]
        return took if {s["labels"]["rank"] for s in took} == {"0", "1"} else []

    took = _until(read_times, scaled(30), "probe_framework_read_seconds of both ranks")
    assert all(0 < s["value"] < 60 for s in took), took
    assert b"probe_loss{" not in _get(job["url"])  # a plain loop: no framework logged a loss
    _until(lambda: all(s["value"] > steps[s["labels"]["rank"]]["value"]
                       for s in _samples(_get(job["url"]).decode("utf-8")) if s["name"] == "probe_steps_total"),
           scaled(20), "the step counters advancing between scrapes")


def test_promtool_passes_the_shipped_rules() -> None:
    if PROMTOOL is None:
        pytest.skip("promtool (Debian's prometheus) is not installed")
    done = subprocess.run([PROMTOOL, "check", "rules", RULES], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def _dashboard_queries() -> List[str]:
    with open(DASHBOARD) as handle:
        dashboard = json.load(handle)
    assert dashboard["uid"] and dashboard["panels"]
    return [t["expr"].replace("$job", ".*") for p in dashboard["panels"] for t in p["targets"]]


@needs_client
@needs_torchrun
def test_a_real_prometheus_scrapes_both_ranks_and_runs_the_rules_and_dashboard(job: Dict[str, Any]) -> None:
    if PROMETHEUS is None:
        pytest.skip("prometheus (Debian's package) is not installed")
    home = tempfile.mkdtemp(prefix="probe-prom-")
    web = _free_port()
    with open(os.path.join(home, "prometheus.yml"), "w") as handle:
        handle.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                     "rule_files:\n  - %s\n"
                     "scrape_configs:\n  - job_name: probe\n    honor_labels: true\n"
                     "    static_configs:\n      - targets: ['127.0.0.1:%d']\n" % (RULES, job["metrics_port"]))
    server = subprocess.Popen([PROMETHEUS, "--config.file=" + os.path.join(home, "prometheus.yml"),
                               "--storage.tsdb.path=" + os.path.join(home, "data"),
                               "--web.listen-address=127.0.0.1:%d" % web], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, start_new_session=True)
    api = "http://127.0.0.1:%d/api/v1/" % web

    def query(expr: str) -> Dict[str, Any]:
        return json.loads(_get(api + "query?" + urllib.parse.urlencode({"query": expr})))

    def steps(rank: str) -> float:
        result = query('probe_steps_total{rank="%s"}' % rank)["data"]["result"]
        return float(result[0]["value"][1]) if result else 0.0

    try:
        first = _until(lambda: (steps("0"), steps("1")) if steps("0") and steps("1") else None, scaled(60),
                       "Prometheus scraping probe_steps_total of ranks 0 and 1")
        _until(lambda: steps("0") > first[0] and steps("1") > first[1], scaled(30),
               "the step counters advancing in Prometheus")
        series = query('probe_steps_total{rank="1"}')["data"]["result"][0]["metric"]
        assert series["job"] != "probe" and series["local_rank"] == "1"  # the job's id, kept (honor_labels)

        def rules_evaluated() -> List[Dict[str, Any]]:
            groups = json.loads(_get(api + "rules"))["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            return rules if rules and all(r.get("lastEvaluation", "").startswith("2") and
                                          not r["lastEvaluation"].startswith("0001") for r in rules) else []

        rules = _until(rules_evaluated, scaled(30), "every shipped rule evaluated")
        assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
        firing = [r["name"] for r in rules if r.get("state") == "firing"]
        assert not {"ProbeStallRecorded", "ProbeRankDead"} & set(firing), firing  # a healthy job
        for expr in _dashboard_queries():
            answer = query(expr)
            assert answer["status"] == "success", (expr, answer)
        with open(DASHBOARD) as handle:
            heatmap = next(p for p in json.load(handle)["panels"] if p["type"] == "heatmap")
        heat = query(heatmap["targets"][0]["expr"].replace("$job", ".*"))["data"]["result"]
        assert {r["metric"]["rank"] for r in heat} == {"0", "1"}
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait(20)
        if server.stderr:
            server.stderr.close()
        shutil.rmtree(home, ignore_errors=True)
