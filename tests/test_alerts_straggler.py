"""The persistent-straggler alert (issue 36 item 2): real 2-rank torchrun gloo jobs on the CPU whose launcher
is the node helper, sampling its ranks' stacks every 0.5 s (``PROBE_STACK_EVERY``) and judging windows of
6 s (``PROBE_ALERT_STRAGGLER_MINUTES=0.1``), a webhook on 127.0.0.1 taking the posts.

One job (tests/targets/dist_straggler.py, an all_reduce of the loss each step) is healthy first: no alert
over whole windows; then rank 1 is slow in its DataLoader's dataset: one alert names rank 1 and
``Records.__getitem__``, and no second one while it stays slow; then rank 0 is slow in a helper function
instead: one alert names rank 0 and ``augment``, and the command it gives says the same. Another job
(tests/targets/dist_slow_loader.py, DistributedDataParallel: the rank that waits does so in its backward
pass) with rank 1 slow in its own loading: one alert, in Slack's form too."""

import json
import os
import subprocess
import time
from typing import Any, Dict, List, Tuple

from probe.client import transport
from procs import TARGETS, Proc, run_cli, scaled, target_env
from test_alerts import _log, receiver  # noqa: F401 -- the fixture
from test_snapshot_watch import _until
from test_torchrun import _free_port_pair
from torch_job import TORCHRUN, _free_port, ready_lines, stop_launcher

WATCHED = dict(PROBE_STACK_EVERY="0.5", PROBE_ALERT_STRAGGLER_MINUTES="0.1", PROBE_ALERT_COOLDOWN="0",
               PROBE_HANG_AFTER="600", PROBE_HOST="127.0.0.1")


def _job(tmp_path, script: str, **env: str) -> Tuple[subprocess.Popen, Dict[int, int], int, str]:
    """A 2-rank torchrun job of ``script`` whose launcher is the node's helper: (launcher, rank -> pid, its
    PROBE_PORT, its runtime directory). Started once more on fresh ports where the launcher lost its free
    port at the rendezvous to another process (EADDRINUSE: the suite runs on two workers)."""
    for attempt in (1, 2):
        run = str(tmp_path / ("run%d" % attempt))
        os.makedirs(run, 0o700)
        err_path = str(tmp_path / ("stderr%d" % attempt))
        port = _free_port_pair()
        with open(err_path, "wb") as err:
            launcher = subprocess.Popen([TORCHRUN, "--nproc_per_node=2", "--master_port=%d" % _free_port(),
                                         os.path.join(TARGETS, script)], stdout=subprocess.PIPE, stderr=err,
                                        env=target_env(PROBE_PORT=str(port), PROBE_RUNTIME_DIR=run,
                                                       PROBE_SNAPSHOT_DIR=str(tmp_path / "snaps"), **env),
                                        start_new_session=True)
        try:
            lines = ready_lines(Proc(launcher, "torchrun %s" % script), 2, time.monotonic() + scaled(90))
            return launcher, {int(w[2]): int(w[1]) for w in lines}, port, run
        except AssertionError:
            stop_launcher(launcher)
            with open(err_path, "rb") as handle:
                if attempt == 2 or b"EADDRINUSE" not in handle.read():
                    raise
    raise AssertionError("unreachable")


def _samples(run: str, port: int) -> int:
    """How many samples the node helper's stack history has taken (its straggler rule judges after each)."""
    answer = transport.request(transport.UnixAddress(os.path.join(run, "node-%d.sock" % port)), "GET",
                               "/v1/stack_history", None, {}, scaled(30))
    assert answer.status == 200, bytes(answer.body)[:300]
    return int(json.loads(bytes(answer.body))["samples"])


def _quiet(receiver, run: str, port: int, seconds: float, posts: int = 0) -> None:  # noqa: F811
    """The rule judged ``seconds`` of samples (at PROBE_STACK_EVERY 0.5 s), each over its whole window, and no
    straggler alert came past the first ``posts``. Counted in the helper's samples, not in time: a loaded
    machine's slower sampling takes longer, and a quick one no longer than the samples take."""
    first = _samples(run, port)
    deadline = time.monotonic() + scaled(seconds * 3)
    while _samples(run, port) < first + seconds / 0.5 + 1:  # the one under way at the first count, and as many
        assert len(receiver.of("/hook", "straggler")) == posts, receiver.posts
        assert time.monotonic() < deadline, "the stack history took no %.0f s of samples" % seconds
        time.sleep(0.25)
    assert len(receiver.of("/hook", "straggler")) == posts, receiver.posts


def _judging(run: str) -> str:
    return _until(lambda: [line for line in _log(run).splitlines() if "straggler alert judges" in line], 60,
                  "the straggler rule judging a whole window")[0]


def test_a_rank_slow_in_its_loader_then_the_other_in_a_helper_is_one_alert_each_and_a_healthy_job_none(
        tmp_path, receiver):  # noqa: F811
    control = str(tmp_path / "control")
    # steps mostly asleep on every rank (0.25 s), a slow rank's part far longer (1 s): a healthy rank that a
    # loaded machine delays a little is not the one the others wait for most of the time
    launcher, ranks, port, run = _job(tmp_path, "dist_straggler.py", STRAGGLER_CONTROL=control, STEP_SLEEP="0.25",
                                      SLOW_S="1.0", PROBE_ALERT_WEBHOOK="http://127.0.0.1:%d/hook" % receiver.port, **WATCHED)
    try:
        line = _judging(run)
        assert "last 6 s" in line and "PROBE_STACK_EVERY 0.5 s" in line, line
        _quiet(receiver, run, port, 13)  # two windows and more, every rank quick: nothing
        with open(control, "w") as handle:
            handle.write("slow 1 loader\n")
        first = _until(lambda: receiver.of("/hook", "straggler"), 90, "the straggler alert naming rank 1")
        _quiet(receiver, run, port, 13, posts=1)  # rank 1 still slow: the same episode, no second
        with open(control, "w") as handle:
            handle.write("slow 0 helper\n")
        second = _until(lambda: receiver.of("/hook", "straggler")[1:], 90, "the straggler alert naming rank 0")
        for _ in range(3):  # diagnose samples the ranks' stacks: a look may fall where it cannot tell; look again
            more = run_cli(second[0]["command"].split(" ", 1)[1].rsplit(" ", 1)[0], "diagnose", timeout=120,
                           env=target_env(probe=False, PROBE_RUNTIME_DIR=run))
            if "straggler: rank 0" in more.out:
                break
        with open(control, "w") as handle:
            handle.write("exit\n")
        launcher.wait(scaled(60))
    finally:
        stop_launcher(launcher)
    alert = first[0]
    assert alert["rule"] == "straggler" and alert["culprits"] == [1] and alert["victims"] == [0], alert
    assert alert["where"]["func"] == "Records.__getitem__" and alert["where"]["file"].endswith("dist_straggler.py"), alert
    assert alert["summary"].startswith("straggler: rank 1 has held up rank 0 since "), alert["summary"]
    assert "mostly Records.__getitem__ (" in alert["summary"] and "waited in a collective" in alert["summary"], alert
    assert alert["in_phase"] >= 3 and alert["in_phase"] >= 0.6 * alert["samples"], alert
    assert alert["command"] == "probe 127.0.0.1:%d diagnose" % port and alert["since"] <= alert["time"], alert
    assert len(receiver.of("/hook", "straggler")) == 2, receiver.posts
    alert = second[0]
    assert alert["culprits"] == [0] and alert["where"]["func"] == "augment", alert
    assert "straggler: rank 0" in more.out and "augment" in more.out, more.out + more.err


def test_a_straggler_under_ddp_waited_for_in_the_backward_pass_is_one_alert_in_both_forms(tmp_path, receiver):  # noqa: F811
    control = tmp_path / "loader"
    control.write_text("slow 1\n")
    hooks = "http://127.0.0.1:%d/hook slack+http://127.0.0.1:%d/slack" % (receiver.port, receiver.port)
    launcher, ranks, port, run = _job(tmp_path, "dist_slow_loader.py", LOADER_CONTROL=str(control),
                                      PROBE_ALERT_WEBHOOK=hooks, **WATCHED)
    try:
        generic = _until(lambda: receiver.of("/hook", "straggler"), 90, "the straggler alert")
        slack = _until(lambda: receiver.of("/slack", "straggler"), 30, "the straggler alert in Slack's form")
    finally:
        stop_launcher(launcher)
    alert = generic[0]
    assert alert["culprits"] == [1] and alert["where"]["func"] == "fetch_examples", alert
    assert alert["phase"] == "own code", alert
    text = slack[0]["text"]
    assert "straggler: rank 1 has held up rank 0" in text and "culprit: rank 1 in fetch_examples (" in text, text
    assert "`probe 127.0.0.1:%d diagnose`" % port in text, text
