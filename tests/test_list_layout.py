"""`probe list` as a person reads it at 80 columns, with real targets: each row names its script first
(not "python…"), says how to reach it in one short command (the TCP address and token file under the
table), and leaves out the dead processes of before this terminal's session unless --all."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, Dict, List

from procs import REPO, die_with_record, run_cli, scaled, spawn, target_env


def list_in_a_new_session(env: Dict[str, str], between: Callable[[], object], *args: str) -> List[str]:
    """The output of ``probe list`` with each tuple of ``args``, run from a new session begun before
    ``between`` ran (as from a terminal opened before it): a shell that leads a new session waits for a
    line, then runs each listing."""
    script = "read line; " + "; echo @@; ".join(
        "%s -m probe list %s" % (sys.executable, " ".join(a)) for a in args)
    shell = subprocess.Popen(["sh", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO, start_new_session=True)
    try:
        between()
        out, _ = shell.communicate("go\n", timeout=scaled(120))
    finally:
        if shell.poll() is None:
            shell.kill()
            shell.communicate()
    return out.split("@@\n")


def test_at_80_columns_each_row_names_its_script_and_one_way_to_reach_it(tmp_path):
    tmp_path.chmod(0o700)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    runtime = dict(target_env(PROBE_RUNTIME_DIR=str(tmp_path)))
    served = spawn("idle.py", ["--name-me"], env=dict(runtime, PROBE_LISTEN="127.0.0.1:%d" % port), wait_socket=False)
    plain = spawn("busy.py", [], probe=False)
    try:
        deadline = time.monotonic() + scaled(10)
        while not (tmp_path / ("%d.sock" % served.pid)).exists():
            assert time.monotonic() < deadline, "no agent socket"
            time.sleep(0.05)
        env = dict(target_env(probe=False, PROBE_RUNTIME_DIR=str(tmp_path)), COLUMNS="80")
        listed = run_cli("list", env=env, timeout=scaled(60))
        assert listed.code == 0, listed.err
        lines = listed.out.splitlines()
        # every line fits, but a path longer than the screen, which stays whole on a line of its own to be copied
        assert all(len(line) <= 80 or " " not in line.strip() for line in lines), listed.out
        assert lines[0].split()[:2] == ["pid", "script"], listed.out
        row = next(line for line in lines if line.startswith("%d " % served.pid))
        assert "idle.py --name-me" in row and row.rstrip().endswith("probe %d ..." % served.pid), listed.out
        assert "%d also: probe 127.0.0.1:%d --token-file" % (served.pid, port) in listed.out, listed.out
        assert str(tmp_path / ("%d.token" % served.pid)) in listed.out, listed.out  # a path kept whole
        other = next(line for line in lines if line.startswith("%d " % plain.pid))
        assert "busy.py" in other and other.rstrip().endswith("probe %d inject" % plain.pid), listed.out
        rows = json.loads(run_cli("list", "--json", env=env, timeout=scaled(60)).out)
        mine = next(r for r in rows if r["pid"] == served.pid)
        assert mine["script"] == "idle.py --name-me" and mine["command"].endswith("tests/targets/idle.py --name-me")
    finally:
        served.kill()
        plain.kill()


def test_the_dead_of_before_this_session_are_left_out_unless_all(tmp_path):
    tmp_path.chmod(0o700)
    before = die_with_record(str(tmp_path), "hung.py", ["segv"]).pid  # a crash, before the session began
    # probe list knows the session's start to one clock tick (10 ms): let the session begin a few ticks later
    later = time.time() + 0.1
    while time.time() < later:
        time.sleep(0.02)
    after: List[int] = []
    env = dict(target_env(probe=False, PROBE_RUNTIME_DIR=str(tmp_path)), COLUMNS="100")
    table, rows, every = list_in_a_new_session(
        env, lambda: after.append(die_with_record(str(tmp_path), "hung.py", ["segv"]).pid),
        ("--agents-only",), ("--agents-only", "--json"), ("--agents-only", "--all", "--json"))
    dead = [r["pid"] for r in json.loads(rows.split("\n", 1)[0]) if r["agent"] == "dead"]
    assert dead == after, (dead, before, rows)
    assert str(after[0]) in table and "%d " % before not in table, table
    assert "1 dead process (from before this session, or stopped on purpose over an hour ago) is not shown: " \
           "probe list --all" in table, table
    assert {r["pid"] for r in json.loads(every) if r["agent"] == "dead"} == {before, after[0]}, every
