"""The host helper against node reports from a token holder who is buggy or hostile: every field checked,
the whole bounded in the launcher's memory, reports that are not renewed forgotten, and no bad report ever
makes a later `ranks` or `--all-ranks` end in a traceback.

The launcher is a stand-in (tests/targets/launcher/torchrun): the start-up hook takes it for torchrun's,
so the real host helper runs in it, over real TCP on loopback; no torch is needed."""

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterator, Tuple

import hmac_auth
from procs import TARGETS, Proc, run_cli, scaled, stop, target_env

TOKEN = "host-helper-input-token"
MAX_MEMBERS = 1024  # ranks in one node's report (probe.host.helper.MAX_MEMBERS)
LAUNCHER = os.path.join(TARGETS, "launcher", "torchrun")


def _free_base_port() -> int:
    """A port p with p - 1 and p free a moment ago (the helper listens on p - 1)."""
    for _ in range(100):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            base = sock.getsockname()[1]
        if base < 2000 or base > 65000:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", base - 1))
                b.bind(("127.0.0.1", base))
            return base
        except OSError:
            continue
    raise RuntimeError("no two free ports")


@contextmanager
def launcher(world: int = 4, **extra: str) -> Iterator[Tuple[int, int]]:
    """(PROBE_PORT, launcher pid) of a stand-in launcher whose helper serves on 127.0.0.1:PROBE_PORT-1."""
    port = _free_base_port()
    env = target_env(probe=False, PROBE_PORT=str(port), PROBE_HOST="127.0.0.1", PROBE_TOKEN=TOKEN, **extra)
    popen = subprocess.Popen([sys.executable, LAUNCHER, str(world)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=env)
    rank = None
    try:
        words = Proc(popen, "launcher").read_line(30).split()
        assert words[0] == "READY", words
        rank = int(words[2])
        yield port, popen.pid
    finally:
        stop(popen)
        if rank is not None:
            try:
                os.kill(rank, 9)
            except ProcessLookupError:
                pass


def _post(port: int, body: Any) -> Tuple[int, Dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode("utf-8")
    conn = http.client.HTTPConnection("127.0.0.1", port - 1, timeout=scaled(10))
    try:
        conn.request("POST", "/v1/nodes", data, {"Authorization": hmac_auth.authorization(port - 1, TOKEN, "POST",
                                                                                        "/v1/nodes", data),
                                                 "Content-Type": "application/json"})
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read() or b"{}")
    finally:
        conn.close()


def _get_ranks(port: int) -> Dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port - 1, timeout=scaled(30))
    try:
        conn.request("GET", "/v1/ranks", headers={"Authorization": hmac_auth.authorization(port - 1, TOKEN, "GET",
                                                                                           "/v1/ranks")})
        answer = conn.getresponse()
        assert answer.status == 200, answer.status
        return json.loads(answer.read())
    finally:
        conn.close()


def _member(base: int, number: int, node: int = 1, **changes: Any) -> Dict[str, Any]:
    """Rank ``number`` of node ``node`` of the job with PROBE_PORT ``base``, as its node's helper reports it;
    ``changes`` replace fields."""
    member = {"rank": number, "local_rank": number % 8, "world_size": 4, "node": node, "host": "127.0.0.2",
              "port": base + number % 8, "pid": 1000 + number, "state": "running", "restarts": 0,
              "heartbeat_age": 0.1, "helper": "127.0.0.2:%d" % (base - 1)}
    member.update(changes)
    return member


def _report(port: int, members: Any, node: int = 1, **changes: Any) -> Dict[str, Any]:
    report = {"node": node, "host": "127.0.0.2", "helper": "127.0.0.2:%d" % (port - 1), "members": members}
    report.update(changes)
    return report


def _ranks(port: int) -> list:
    out = run_cli("127.0.0.1:%d" % port, "ranks", "-f", "json", env=target_env(probe=False, PROBE_TOKEN=TOKEN))
    assert "Traceback" not in out.err, out.err
    # 7: the listing lacks ranks of the world size the members report (these jobs are made of reports)
    assert out.code == 0 or (out.code == 7 and "not listed by its helpers" in out.err), (out.code, out.err)
    return json.loads(out.out)


def _rss_kb(pid: int, key: str = "VmRSS") -> int:
    with open("/proc/%d/status" % pid) as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise AssertionError("no %s for %d" % (key, pid))


def test_every_field_of_a_node_report_is_checked_and_a_bad_one_breaks_no_later_ranks():
    with launcher(world=4) as (port, _):
        good = _member(port, 1)
        hostile = [
            _report(port, [good], node=10 ** 4000), _report(port, [good], node=-1), _report(port, [good], node="1"),
            _report(port, [good], node=True), _report(port, [good], node=1.5), _report(port, [good], node=4),
            _report(port, [good], helper="not-a-host-port"), _report(port, [good], helper="127.0.0.2:0"),
            _report(port, [good], helper="127.0.0.2:99999"), _report(port, [good], helper=7),
            _report(port, [good], helper="127.0.0.2:80 ; rm -rf"), _report(port, [good], host="a b"),
            _report(port, [good], host="x" * 300), _report(port, {"0": good}),
            _report(port, [_member(port, 1, helper="x")]), _report(port, [_member(port, 1, rank=10 ** 4000)]),
            _report(port, [_member(port, 1, rank=-5)]), _report(port, [_member(port, 1, rank=4)]),
            _report(port, [_member(port, 1, rank="1")]), _report(port, [_member(port, 1, port=0)]),
            _report(port, [_member(port, 1, port=70000)]), _report(port, [_member(port, 1, pid=10 ** 30)]),
            _report(port, [_member(port, 1, state="exploded")]), _report(port, [_member(port, 1, heartbeat_age=1e300)]),
            _report(port, [_member(port, 1, heartbeat_age="soon")]), _report(port, [_member(port, 1, world_size=5)]),
            _report(port, [_member(port, 1, host="127.0.0.9")]), _report(port, [_member(port, 1, node=2)]),
            _report(port, [good, good]), _report(port, [good] * 1025), _report(port, ["rank 1"]),
            {"node": 1}, [good],
        ]
        for report in hostile:
            status, answer = _post(port, report)
            assert status in (400, 403), (status, answer, str(report)[:200])
            assert answer["error"]["message"], answer
        assert [m["rank"] for m in _ranks(port)] == [0]  # none of them was taken

        status, answer = _post(port, _report(port, [good]))
        assert status == 200, answer
        listed = _ranks(port)
        assert [(m["rank"], m["host"], m["node"], m["port"], m["state"]) for m in listed] == [
            (0, "127.0.0.1", 0, port, "starting"), (1, "127.0.0.2", 1, port + 1, "running")]
        asked = run_cli("127.0.0.1:%d" % port, "--all-ranks", "--timeout", "3", "health",
                        env=target_env(probe=False, PROBE_TOKEN=TOKEN))
        assert "Traceback" not in asked.err, asked.err


def test_node_reports_are_bounded_as_a_whole_in_the_launchers_memory():
    """Hostile nodes each report 1024 ranks until refused: what the launcher keeps stays bounded (the old
    helper took every node up to 4096 of them, about 1.8 kB a rank)."""
    with launcher(world=10 ** 6) as (port, pid):
        _ranks(port)  # the helper has answered once: its own start-up is behind us
        before = _rss_kb(pid)
        accepted = refused = 0
        node = 1
        deadline = time.monotonic() + scaled(120)
        while refused < 3 and node < 200 and time.monotonic() < deadline:
            members = [_member(port, node * MAX_MEMBERS + i, node=node, world_size=10 ** 6, local_rank=i)
                       for i in range(MAX_MEMBERS)]
            status, answer = _post(port, _report(port, members, node=node))
            if status == 200:
                accepted += 1
            else:
                assert status == 403, (status, answer)
                refused += 1
            node += 1
        assert accepted * MAX_MEMBERS <= 1 << 17 and refused == 3, (accepted, refused)  # MAX_RANKS
        grown_mb = (_rss_kb(pid) - before) / 1024
        assert len(_get_ranks(port)["members"]) == 1 + accepted * MAX_MEMBERS
        assert len(_ranks(port)) == 1 + accepted * MAX_MEMBERS  # the client lists them all (it refuses past 2**18)
        peak_mb = (_rss_kb(pid, "VmHWM") - before) / 1024
        assert grown_mb < 25, "the launcher grew by %.0f MB keeping %d ranks" % (grown_mb, accepted * MAX_MEMBERS)
        assert peak_mb < 80, "the launcher peaked %.0f MB above its start" % peak_mb


def test_a_node_that_stops_reporting_is_forgotten():
    with launcher(world=4, PROBE_HELPER_FORGET_S="2") as (port, _):
        status, answer = _post(port, _report(port, [_member(port, 1)]))
        assert status == 200, answer
        assert [m["rank"] for m in _ranks(port)] == [0, 1]
        deadline = time.monotonic() + scaled(20)
        while [m["rank"] for m in _ranks(port)] != [0]:
            assert time.monotonic() < deadline, "node 1's ranks still listed long after its last report"
            time.sleep(0.5)


def test_a_ranks_note_on_another_node_reaches_ranks_and_a_note_not_fit_to_print_is_dropped():
    """A rank of another node whose port was taken: its node's helper reports whose the port is, and the
    master's helper passes the note on to `probe ranks` (bounded words; control characters dropped)."""
    with launcher(world=4) as (port, _):
        taken = "port %d taken by uid 65534; serving on 40001 instead" % (port + 1)
        status, answer = _post(port, _report(port, [_member(port, 1, note=taken),
                                                    _member(port, 2, note="\x1b]52;c;aGk=\x07 evil"),
                                                    _member(port, 3, note="x" * 301)]))
        assert status == 200, answer
        members = {m["rank"]: m for m in _get_ranks(port)["members"]}
        assert members[1]["note"] == taken and "note" not in members[2] and "note" not in members[3], members
        out = run_cli("127.0.0.1:%d" % port, "ranks", env=target_env(probe=False, PROBE_TOKEN=TOKEN))
        assert "probe: rank 1: %s" % taken in out.err and "evil" not in out.err, out
