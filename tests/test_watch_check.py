"""Issue 36's "How it will be checked", whole, in one job: a 2-rank torchrun gloo job on the CPU
(tests/targets/snap_train.py) started with ``PROBE_METRICS_PORT`` and ``PROBE_ALERT_WEBHOOK``; a real
Prometheus (Debian's ``prometheus``) scrapes its node helper and holds ``probe_*`` series of both ranks, the
step counter advancing; rank 1 then stops issuing its all_reduce, and the webhook (a server of this test on
127.0.0.1) receives the stall's verdict naming rank 1 stuck."""

import json
import os
import shutil
import signal
import subprocess
import tempfile
import urllib.parse
from typing import Any, Dict

import pytest

from test_alerts import receiver  # noqa: F401 -- the fixture
from test_metrics import PROMETHEUS, _free_port, _get, _until as _until_up
from test_snapshot_watch import _dirs, _recorded, _torchrun_stepping, _until
from procs import scaled
from torch_job import stop_launcher


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus (Debian's package) is not installed")
def test_prometheus_sees_both_ranks_step_and_the_webhook_gets_the_verdict_naming_rank_1_stuck(
        tmp_path, receiver):  # noqa: F811
    run, snaps, control = _dirs(tmp_path, "check")
    metrics = _free_port()
    launcher, output, ranks = _torchrun_stepping(
        tmp_path, "check", run, PROBE_SNAPSHOT_DIR=snaps, PROBE_HANG_AFTER="3", PROBE_HANG_MIN="600",
        SNAP_CONTROL=control, PROBE_METRICS_PORT=str(metrics), STEP_SLEEP="0.05",
        PROBE_ALERT_WEBHOOK="http://127.0.0.1:%d/hook" % receiver.port)
    home = tempfile.mkdtemp(prefix="probe-prom-")
    web = _free_port()
    with open(os.path.join(home, "prometheus.yml"), "w") as handle:
        handle.write("global:\n  scrape_interval: 1s\n"
                     "scrape_configs:\n  - job_name: probe\n    honor_labels: true\n"
                     "    static_configs:\n      - targets: ['127.0.0.1:%d']\n" % metrics)
    server = subprocess.Popen([PROMETHEUS, "--config.file=" + os.path.join(home, "prometheus.yml"),
                               "--storage.tsdb.path=" + os.path.join(home, "data"),
                               "--web.listen-address=127.0.0.1:%d" % web], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    api = "http://127.0.0.1:%d/api/v1/" % web

    def query(expr: str) -> Dict[str, Any]:
        return json.loads(_get(api + "query?" + urllib.parse.urlencode({"query": expr})))["data"]["result"]

    def steps() -> Dict[str, float]:
        return {r["metric"]["rank"]: float(r["value"][1]) for r in query("probe_steps_total")}

    try:
        first = _until_up(lambda: steps() if set(steps()) == {"0", "1"} else None, scaled(60),
                          "Prometheus scraping probe_steps_total of ranks 0 and 1")
        _until_up(lambda: all(steps()[r] > first[r] for r in ("0", "1")), scaled(30),
                  "the step counters advancing in Prometheus")
        names = {r["metric"]["__name__"] for r in query('{__name__=~"probe_.+", rank="1"}')}
        assert {"probe_steps_total", "probe_rank_state", "probe_rank_rss_bytes"} <= names, names
        assert not receiver.posts, receiver.posts  # stepping: nothing to say
        with open(control, "w") as handle:
            handle.write("skip 1\n")
        alert = _until(lambda: receiver.of("/hook", "stall"), 90, "the stall's alert")[0]
        snap = _until(lambda: [s for s in _recorded(snaps) if s.complete], 30, "the stall recorded")[0]
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait(20)
        shutil.rmtree(home, ignore_errors=True)
        stop_launcher(launcher)
    assert alert["culprits"] == [1] and alert["status"] == "stuck", alert
    assert alert["verdict"] == "collective_hang" and "rank 1 did not" in alert["verdict_lines"][0], alert
    assert alert["snapshot_id"] == snap.id and alert["command"] == "probe snapshot:%s diagnose" % snap.path, alert
