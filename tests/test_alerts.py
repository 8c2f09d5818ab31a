"""Alerts from the node helper's watch (issue 36 item 2): a real 2-rank torchrun gloo job on the CPU
(tests/targets/snap_train.py) whose launcher is the node helper, with PROBE_ALERT_WEBHOOK naming small HTTP
servers this test runs on 127.0.0.1: one that takes the posts, one that never answers, and a URL of a
scheme that is refused. Rank 1 stops issuing its all_reduce: one alert names it stuck, with the snapshot
that holds it; killed then, one alert says its death. In a second job rank 1 keeps more memory at every step: one memory alert names it; killed
by SIGKILL, it is one death alert naming the signal."""

import json
import os
import signal
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from probe.snapshot import store
from test_snapshot_watch import _dirs, _recorded, _stderr, _torchrun_stepping, _until
from procs import scaled
from torch_job import stop_launcher

SECRET = "T0KEN-in-the-path"


class _Receiver:
    """An HTTP server on 127.0.0.1 that keeps every POST's path and JSON body."""

    def __init__(self) -> None:
        posts: List[Tuple[str, Dict[str, Any]]] = []
        self.posts = posts

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 -- http.server's name
                length = int(self.headers.get("Content-Length") or 0)
                posts.append((self.path, json.loads(self.rfile.read(length))))
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def of(self, path: str, rule: str) -> List[Dict[str, Any]]:
        return [body for at, body in self.posts if at.startswith(path) and
                (body.get("rule") == rule or rule in str(body.get("text", "")).split("\n")[0])]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[_Receiver]:
    server = _Receiver()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that takes connections (the kernel's backlog) and never answers a request."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield sock.getsockname()[1]
    finally:
        sock.close()


def _log(run: str) -> str:
    names = [n for n in os.listdir(run) if n.startswith("node-") and n.endswith(".log")]
    if not names:
        return ""
    with open(os.path.join(run, names[0])) as handle:
        return handle.read()


def test_a_stall_is_one_alert_naming_the_rank_and_its_snapshot_and_a_webhook_that_hangs_delays_nothing(
        tmp_path, receiver, silent_port):
    run, snaps, control = _dirs(tmp_path, "stall")
    hooks = ("http://127.0.0.1:%d/never?token=%s, ftp://127.0.0.1/x http://127.0.0.1:%d/json/%s "
             "slack+http://127.0.0.1:%d/slack/%s" % (silent_port, SECRET, receiver.port, SECRET, receiver.port, SECRET))
    launcher, output, ranks = _torchrun_stepping(tmp_path, "stall", run, PROBE_SNAPSHOT_DIR=snaps, PROBE_HANG_AFTER="3",
                                                 PROBE_HANG_MIN="600", SNAP_CONTROL=control, PROBE_ALERT_WEBHOOK=hooks,
                                                 PROBE_ALERT_TIMEOUT_S="2")
    try:
        assert not receiver.posts, receiver.posts
        with open(control, "w") as handle:
            handle.write("skip 1\n")
        # the record comes whatever the webhook that never answers does; the alert after it
        snap = _until(lambda: [s for s in _recorded(snaps) if s.complete], 60, "the stall recorded")[0]
        generic = _until(lambda: receiver.of("/json/", "stall"), 60, "the stall's alert")
        slack = _until(lambda: receiver.of("/slack/", "stall"), 10, "the stall's alert in Slack's form")
        # the webhook that never answers: its tries (2 s each, pauses of 1 s and 2 s) said in the log; and, over
        # that wait and 4 s at least, no second alert for the same stall: the watch goes on looking at the
        # stalled ranks meanwhile (one wait for both, not 4 s more after the log line)
        watched, failed = time.monotonic(), []
        deadline = watched + scaled(60)
        while not failed or time.monotonic() - watched < 4:
            assert len(receiver.of("/json/", "stall")) == 1 and len(receiver.of("/slack/", "stall")) == 1, \
                receiver.posts
            failed = failed or [line for line in _log(run).splitlines() if "failed after 3 tries" in line]
            assert failed or time.monotonic() < deadline, "the failed webhook said in the log within %.0f s" % (
                scaled(60))
            time.sleep(0.5)
        assert launcher.poll() is None, _stderr(tmp_path, "stall")
        # rank 1, stalled, is killed: one death alert; rank 0, which its launcher ends then, is no news
        os.kill(ranks[1], signal.SIGKILL)
        launcher.wait(scaled(60))
        death = _until(lambda: receiver.of("/json/", "death"), 10, "the death's alert")
    finally:
        stop_launcher(launcher)
    assert len(death) == 1 and death[0]["ranks"] == [1] and death[0]["pid"] == ranks[1], death
    assert "SIGKILL" in death[0]["summary"] and death[0]["snapshot_id"] == snap.id, death

    alert = generic[0]
    assert alert["source"] == "probe" and alert.get("culprits") == [1], json.dumps(alert)
    assert alert["snapshot_id"] == snap.id and alert["snapshot"] == snap.path, (alert, snap)
    assert alert["command"] == "probe snapshot:%s diagnose" % snap.path, alert
    assert alert["verdict"] == "collective_hang" and "rank 1 did not" in alert["verdict_lines"][0], alert
    assert alert["where"]["called_from"]["func"] == "load_next_batch", alert  # its own frame, below threading's
    assert "called from load_next_batch (" in alert["where_text"], alert
    assert alert["reason"].startswith("stall: no step for") and "rank 1" in alert["summary"], alert
    text = slack[0]["text"]
    assert set(slack[0]) == {"text"}, slack[0]
    assert "rank 1 did not" in text and "culprit: rank 1 in Condition.wait" in text, text
    assert "called from load_next_batch" in text, text
    assert "`probe snapshot:%s diagnose`" % snap.path in text and snap.id in text, text

    log = _log(run)
    assert "http://127.0.0.1:%d/… failed after 3 tries" % silent_port in failed[0], failed
    assert "ftp://127.0.0.1/… is not an http:// or https:// URL" in log, log
    assert "alerts go to http://127.0.0.1:%d/…, http://127.0.0.1:%d/…" % (silent_port, receiver.port) in log, log
    assert SECRET not in log and SECRET not in _stderr(tmp_path, "stall"), log
    assert len(store.list_snapshots(snaps)) == 1


def test_a_rank_whose_memory_rises_then_is_killed_is_one_memory_alert_then_one_death_alert(tmp_path, receiver):
    run, snaps, control = _dirs(tmp_path, "kill")
    # RSS read at each look of the watch (once a second); 6 readings in a row, rising by 150 MiB at least
    launcher, output, ranks = _torchrun_stepping(
        tmp_path, "kill", run, PROBE_SNAPSHOT_DIR=snaps, PROBE_HANG_AFTER="600", SNAP_CONTROL=control,
        PROBE_ALERT_WEBHOOK="http://127.0.0.1:%d/hook" % receiver.port, PROBE_ALERT_RSS_EVERY_S="0.5",
        PROBE_ALERT_RSS_SAMPLES="6", PROBE_ALERT_RSS_MIN_MB="150", PROBE_ALERT_RSS_RISE="0.05")
    try:
        with open(control, "w") as handle:
            handle.write("grow 1\n")
        memory = _until(lambda: receiver.of("/hook", "memory"), 60, "the memory alert")
        with open(control, "w") as handle:
            handle.write("")
        assert memory[0]["culprits"] == [1] and memory[0]["pid"] == ranks[1], memory[0]["summary"]
        assert memory[0]["rss_bytes"] - memory[0]["rss_from_bytes"] >= 150 << 20, memory
        assert memory[0]["summary"].startswith("rank 1's RSS rose"), memory
        os.kill(ranks[1], signal.SIGKILL)
        code = launcher.wait(scaled(60))  # torchrun ends the job; its exit waits for the alert queued
    finally:
        stop_launcher(launcher)
    assert code != 0
    snap = _until(lambda: [s for s in _recorded(snaps) if s.complete], 10, "the death recorded")[0]
    alerts = _until(lambda: receiver.of("/hook", "death"), 10, "the death's alert")
    assert [body["rule"] for _, body in receiver.posts] == ["memory", "death"], receiver.posts
    alert = alerts[0]
    assert alert["culprits"] == [1] and alert["reason"].startswith("rank 1 died: killed by SIGKILL"), alert
    assert alert["snapshot_id"] == snap.id, (alert, snap)
