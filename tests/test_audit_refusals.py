"""Refusals and reads cannot wash the audit trail (issue 33, item 2): a caller with the read token that
sends refused evals by the thousand, from one address or many, or reads by the hundred where reads are
recorded, leaves the records of what ran in `probe T audit`; refusals are counted per asker and minute;
every file of the trail stays within its bound (README: 4 MB a process by default)."""

import json
import os
import socket
import threading
import time
from typing import List, Optional

import hmac_auth
from procs import running, run_cli, scaled, target_env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _post(port: int, token: str, path: str, body: dict, source: Optional[str] = None) -> int:
    """One request on its own connection, as a client sends it; the HTTP status of the answer."""
    data = json.dumps(body).encode()
    auth = "Authorization: %s\r\n" % hmac_auth.authorization(port, token, "POST", path, data) if token else ""
    head = ("POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\n%sContent-Type: application/json\r\n"
            "Content-Length: %d\r\nConnection: close\r\n\r\n" % (path, auth, len(data))).encode()
    with socket.socket() as sock:
        sock.settimeout(scaled(30))
        if source:
            sock.bind((source, 0))
        sock.connect(("127.0.0.1", port))
        sock.sendall(head + data)
        answer = b""
        while b"\r\n" not in answer:
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
    return int(answer.split(b" ", 2)[1])


def _flood(port: int, token: str, path: str, body: dict, total: int, sources: Optional[List[str]] = None,
           workers: int = 8) -> List[int]:
    """``total`` requests from ``workers`` threads (each from the next source address, if given); their statuses."""
    statuses: List[int] = []
    lock = threading.Lock()
    errors: List[BaseException] = []

    def work(index: int) -> None:
        try:
            for i in range(index, total, workers):
                status = _post(port, token, path, body, sources[i % len(sources)] if sources else None)
                with lock:
                    statuses.append(status)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(scaled(600))
    assert not errors, errors[:3]
    assert not any(t.is_alive() for t in threads), "the flood did not end"
    return statuses


def _trail_files(pid: int) -> List[str]:
    directory = os.environ["PROBE_RUNTIME_DIR"]
    return [os.path.join(directory, n) for n in os.listdir(directory) if n.startswith("audit-%d-" % pid)]


def _audit(target: str, *extra: str) -> list:
    done = run_cli(target, "audit", "--json", *extra)
    assert done.code == 0, done.err
    return [json.loads(line) for line in done.out.splitlines()]


def _token(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text + "\n")
    path.chmod(0o600)
    return str(path)


def test_fifteen_thousand_refused_evals_leave_the_earlier_eval_in_the_trail(tmp_path):
    read = "read-token-of-the-flood"
    port = _free_port()
    env = target_env(PROBE_LISTEN="127.0.0.1:%d" % port, PROBE_READ_TOKEN_FILE=_token(tmp_path, "read", read))
    with running("idle.py", env=env) as proc:
        done = run_cli(str(proc.pid), "eval", "eval_before_the_flood = 17")
        assert done.code == 0, done.err
        statuses = _flood(port, read, "/v1/eval", {"code": "print('nope')"}, 15000)
        assert statuses == [403] * 15000, sorted(set(statuses))
        text = run_cli(str(proc.pid), "audit")
        assert text.code == 0 and "eval_before_the_flood = 17" in text.out, text.out[-2000:]
        actions = _audit(str(proc.pid), "-n", "100000")
        evals = [a for a in actions if a["code"] == "eval_before_the_flood = 17"]
        assert len(evals) == 1 and evals[0]["outcome"] == "ok", evals
        refused = [a for a in actions if a["outcome"] == "refused"]
        # counted, not written one by one: one row per minute the flood lasted (and per 256 windows at most)
        assert sum(a["count"] for a in refused) == 15000, [(a["count"], a["peer"]) for a in refused]
        assert len(refused) <= 10, len(refused)
        assert {a["granted_by"] for a in refused} == {"read token"} and {a["command"] for a in refused} == {"eval"}
        assert all(a["peer"].startswith("127.0.0.1:") for a in refused), refused
        assert sum(os.path.getsize(p) for p in _trail_files(proc.pid)) < 64 * 1024


def test_many_askers_and_recorded_reads_never_push_out_an_eval_and_every_file_stays_bounded(tmp_path):
    """Shaped otherwise: a small trail (4 KB files), refusals from 120 addresses (a window each) and
    recorded reads with the read token, against one eval made with the full token over TCP."""
    full, read = "full-token-of-the-case", "read-token-of-the-case"
    port = _free_port()
    env = target_env(PROBE_LISTEN="127.0.0.1:%d" % port, PROBE_TOKEN_FILE=_token(tmp_path, "full", full),
                     PROBE_READ_TOKEN_FILE=_token(tmp_path, "read", read), PROBE_AUDIT_READS="1",
                     PROBE_AUDIT_MAX_BYTES="4096", PROBE_AUDIT_KEEP="2")
    with running("idle.py", env=env) as proc:
        assert _post(port, full, "/v1/eval", {"code": "kept_eval_31 = 1"}) == 200
        sources = ["127.0.%d.%d" % (i // 200, 2 + i % 200) for i in range(120)]
        assert set(_flood(port, read, "/v1/torch/trace", {"action": "start"}, 600, sources)) == {403}
        assert set(_flood(port, read, "/v1/query", {"sql": "SELECT 'read-%s' AS x" % ("r" * 300)}, 300)) == {200}
        actions = _audit(str(proc.pid), "-n", "100000")
        assert [a["outcome"] for a in actions if a["code"] == "kept_eval_31 = 1"] == ["ok"], actions[:5]
        assert any(a["command"] == "query" for a in actions), "the newest reads are shown too"
        files = _trail_files(proc.pid)
        sizes = {os.path.basename(p): os.path.getsize(p) for p in files}
        assert all(size <= 4096 for size in sizes.values()), sizes
        assert len(files) <= 3 + 2 + 2, sizes  # actions and two older; reads and refusals with one older each
        assert any(".refused." in name for name in sizes) and any(".reads." in name for name in sizes), sizes


def test_requests_without_a_token_we_know_are_counted_in_the_trail_too(tmp_path):
    """A guesser (no token, or wrong ones) is seen in the trail, counted: one row per asker and minute."""
    port = _free_port()
    env = target_env(PROBE_LISTEN="127.0.0.1:%d" % port, PROBE_TOKEN_FILE=_token(tmp_path, "full", "the-real-one"))
    with running("idle.py", env=env) as proc:
        assert set(_flood(port, "guess-%d" % os.getpid(), "/v1/eval", {"code": "1"}, 500)) == {401}
        assert set(_flood(port, "", "/v1/query", {"sql": "SELECT 1"}, 300, workers=4)) == {401}
        refused = [a for a in _audit(str(proc.pid), "-n", "1000") if a["outcome"] == "refused"]
        by = {}
        for action in refused:
            by[(action["granted_by"], action["command"], action["scope"])] = \
                by.get((action["granted_by"], action["command"], action["scope"]), 0) + action["count"]
        assert by == {("a token it does not know", "eval", "eval"): 500, ("no token", "query", "read"): 300}, by
        assert len(refused) <= 6, refused
