"""What the framework logged, served and alerted on by the node helper (issue 36): the loss, learning rate and
grad norm a real Hugging Face Trainer and a real Lightning Trainer log, read by the helper's framework reader
(probe.host.framework) from each rank's agent at most every PROBE_METRICS_EVERY s, served as
probe_loss / probe_framework_lr / probe_grad_norm, and judged by the loss-spike alert (probe.host.alert_loss).

Each job runs under torchrun (one rank; the launcher is the node helper, with PROBE_METRICS_PORT and
PROBE_ALERT_WEBHOOK naming an HTTP server this test runs on 127.0.0.1). The HF job's logged loss is 50 times
itself for a dozen steps (tests/targets/hf_loss_spike.py): one loss_spike alert names rank 0 and a step of the
spike, and none follows, with no cooldown to hide a second (PROBE_ALERT_COOLDOWN=0)."""

import json
import math
import os
import shutil
import subprocess
import sys
import time
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from procs import TARGETS, Proc, run_cli, scaled, target_env
from test_alerts import _Receiver
from test_metrics import _free_port, _free_ports, _get, _samples
from torch_job import ready_lines, stop_launcher

TORCHRUN = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
pytestmark = [pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun (torch) is not installed"),
              pytest.mark.skipif(__import__("importlib").util.find_spec("prometheus_client") is None,
                                 reason="prometheus_client is not installed")]


def _until(check, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + scaled(timeout)
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except OSError as exc:  # the metrics port not bound yet
            last = exc
        else:
            if last:
                return last
        time.sleep(0.25)
    raise AssertionError("%s within %.0f s; last: %r" % (what, scaled(timeout), last))


@pytest.fixture
def receiver() -> Iterator[_Receiver]:
    server = _Receiver()
    try:
        yield server
    finally:
        server.close()


def _job(tmp_path, script: str, args: List[str], **env: str) -> Tuple[subprocess.Popen, Proc, int, str, Dict[str, str]]:
    """torchrun of one rank of ``script``, its launcher the node helper serving metrics; (launcher, its output,
    the rank's pid, the metrics URL, the environment a CLI call needs). Started once more on fresh ports where
    the launcher lost its free port to another process at rendezvous (EADDRINUSE)."""
    run = str(tmp_path / "run")
    os.makedirs(run, 0o700, exist_ok=True)
    for attempt in (1, 2):
        metrics = _free_port()
        full = target_env(probe=False, PROBE_PORT="127.0.0.1:%d" % _free_ports(1), PROBE_RUNTIME_DIR=run,
                          PROBE_METRICS_PORT=str(metrics), PROBE_METRICS_EVERY="1", PROBE_HANG_AFTER="600",
                          PROBE_SNAPSHOT_DIR=str(tmp_path / "snaps"), TMPDIR=str(tmp_path), **env)
        with open(str(tmp_path / "stderr"), "wb") as err:
            launcher = subprocess.Popen([TORCHRUN, "--nproc-per-node=1", "--master-port=%d" % _free_port(),
                                         os.path.join(TARGETS, script), *args], stdout=subprocess.PIPE, stderr=err,
                                        env=full, start_new_session=True)
        output = Proc(launcher, "torchrun %s" % script)
        try:
            pid = int(ready_lines(output, 1, time.monotonic() + scaled(120))[0][1])
            return launcher, output, pid, "http://127.0.0.1:%d/metrics" % metrics, target_env(
                probe=False, PROBE_RUNTIME_DIR=run)
        except AssertionError as failed:
            stop_launcher(launcher)
            with open(str(tmp_path / "stderr"), "rb") as handle:
                said = handle.read()
            if attempt == 2 or b"EADDRINUSE" not in said:
                raise AssertionError("%s; the launcher's stderr ends: %r" % (failed, said[-3000:])) from None
    raise AssertionError("unreachable")


def _values(url: str, pid_rank: str = "0") -> Dict[str, float]:
    """The rank's framework series, by name."""
    return {s["name"]: s["value"] for s in _samples(_get(url).decode("utf-8"))
            if s["name"].startswith(("probe_loss", "probe_framework_", "probe_grad_norm"))
            and s["labels"].get("rank") == pid_rank}


def _stderr(tmp_path) -> str:
    with open(str(tmp_path / "stderr"), "rb") as handle:
        return handle.read().decode("utf-8", "replace")[-3000:]


def test_hf_trainer_lr_and_grad_norm_are_served_and_its_loss_spike_is_one_alert(tmp_path, receiver):
    launcher, output, pid, url, env = _job(
        tmp_path, "hf_loss_spike.py", ["--spike-at", "30", "--spike-steps", "12", "--sleep", "0.25"],
        PROBE_ALERT_WEBHOOK="http://127.0.0.1:%d/hook" % receiver.port, PROBE_ALERT_COOLDOWN="0",
        PROBE_ALERT_LOSS_MIN_POINTS="3")
    try:
        first, last = map(int, next(line for line in iter(lambda: output.read_line(30), None)
                                    if line.startswith("SPIKE")).split()[1:])
        # the metrics: the values HF Trainer logged at each step (logging_steps=1), read every second
        served = _until(lambda: (lambda v: v if {"probe_loss", "probe_framework_lr", "probe_grad_norm"} <= set(v)
                                 else None)(_values(url)), 60, "probe_loss, probe_framework_lr and probe_grad_norm")
        assert 0 < served["probe_framework_lr"] <= 1e-3, served  # linear decay from 1e-3
        assert served["probe_grad_norm"] > 0 and served["probe_loss"] > 0, served
        assert served["probe_framework_read_seconds"] > 0 and served["probe_framework_logged_step"] >= 1, served
        table = run_cli(str(pid), "query", "SELECT kind, lr, lr_from, grad_norm, grad_norm_from, logged_step "
                        "FROM torch.trainer", "--json", env=env, timeout=scaled(60))
        assert table.code == 0, (table.out, table.err)
        row = json.loads(table.out)[0]
        assert row["kind"] == "transformers" and 0 < row["lr"] <= 1e-3 and row["grad_norm"] > 0, row
        assert "state.log_history[-1]['learning_rate'] at step " in row["lr_from"], row
        assert "state.log_history[-1]['grad_norm'] at step " in row["grad_norm_from"], row

        # the spike: one alert, naming the rank and a step of it
        alerts = _until(lambda: receiver.of("/hook", "loss_spike"), 90, "the loss_spike alert")
        # then the loss falls back and the job logs on well past the spike: no second alert
        _until(lambda: _values(url).get("probe_framework_logged_step", 0) >= last + 12, 90,
               "steps logged well past the spike")
        assert launcher.poll() is None, _stderr(tmp_path)
    finally:
        stop_launcher(launcher)
    assert len(receiver.of("/hook", "loss_spike")) == 1, receiver.posts
    alert = alerts[0]
    assert alert["culprits"] == [0] and alert["pid"] == pid and first <= alert["step"] <= last, alert
    assert alert["factor"] > 3 and alert["loss"] > 3 * alert["median"], alert
    assert alert["summary"].startswith("rank 0's logged loss spiked to ") and "at step %d" % alert["step"] in \
        alert["summary"], alert
    assert "log_history" in alert["loss_from"], alert
    assert not receiver.of("/hook", "nan"), receiver.posts


def test_lightning_lr_from_its_learning_rate_monitor_and_its_logged_grad_norm_are_served(tmp_path):
    launcher, output, pid, url, env = _job(tmp_path, "lightning_lr.py", [str(tmp_path / "logs")])
    try:
        served = _until(lambda: (lambda v: v if {"probe_loss", "probe_framework_lr", "probe_grad_norm"} <= set(v)
                                 else None)(_values(url)), 60, "probe_loss, probe_framework_lr and probe_grad_norm")
        halvings = math.log2(0.1 / served["probe_framework_lr"])  # StepLR: 0.1, halved every 5 steps
        assert abs(halvings - round(halvings)) < 1e-3, served
        assert served["probe_grad_norm"] >= 0 and served["probe_loss"] >= 0, served
        table = run_cli(str(pid), "query", "SELECT kind, lr, lr_from, grad_norm_from, logged_step FROM torch.trainer",
                        "--json", env=env, timeout=scaled(60))
        assert table.code == 0, (table.out, table.err)
        row = json.loads(table.out)[0]
        assert row["kind"] == "lightning" and row["logged_step"] >= 1, row
        assert "['lr-SGD']" in row["lr_from"], row  # LearningRateMonitor's key
        assert "['grad_norm'] at global step " in row["grad_norm_from"], row
        assert launcher.poll() is None, _stderr(tmp_path)
    finally:
        stop_launcher(launcher)


def test_a_nan_loss_lightning_logs_step_after_step_is_one_nan_alert(tmp_path, receiver):
    """tests/targets/lightning_nan_loss.py logs train_loss nan at every step (3 s steps) and keeps stepping:
    no stall, so only the logged loss can tell; one nan alert, not one a step (no cooldown to hide them)."""
    launcher, output, pid, url, env = _job(tmp_path, "lightning_nan_loss.py", [],
                                           PROBE_ALERT_WEBHOOK="http://127.0.0.1:%d/hook" % receiver.port,
                                           PROBE_ALERT_COOLDOWN="0")
    try:
        alerts = _until(lambda: receiver.of("/hook", "nan"), 60, "the nan alert")
        step = alerts[0]["step"]
        _until(lambda: _values(url).get("probe_framework_logged_step", 0) >= step + 3, 60,
               "three more steps logged, each read")
        assert launcher.poll() is None, _stderr(tmp_path)
    finally:
        stop_launcher(launcher)
    assert len(receiver.of("/hook", "nan")) == 1 and not receiver.of("/hook", "loss_spike"), receiver.posts
    alert = alerts[0]
    assert alert["culprits"] == [0] and alert["pid"] == pid and alert["loss"] == "nan", alert
    assert "callback_metrics['train_loss']" in alert["loss_from"], alert
    assert alert["summary"].startswith("rank 0's framework logged a loss of nan at step "), alert
