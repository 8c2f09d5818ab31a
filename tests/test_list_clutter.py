"""`probe list` without clutter: a process that died before this terminal's session began, or was stopped
on purpose (SIGTERM, Ctrl-C: a demo, a test) over an hour ago, is left out unless --all; and on a narrow
terminal the column that says how to reach a process is the last to be cut."""

import json
import os
import signal
import time

from procs import die_with_record, run_cli, scaled, spawn, target_env


def _die(tmp_path, script: str, args, how=None) -> int:
    """The pid of ``script``, ended as ``how`` says with its crash record left (see procs.die_with_record)."""
    return die_with_record(str(tmp_path), script, args, how).pid


def _age(tmp_path, pid: int, seconds: float) -> None:
    """Make ``pid``'s crash record read as written ``seconds`` ago (when its process died)."""
    name = [n for n in os.listdir(tmp_path) if n.startswith("%d-" % pid) and n.endswith(".crash")][0]
    when = time.time() - seconds
    os.utime(os.path.join(tmp_path, name), (when, when))


def test_the_dead_of_before_this_session_and_those_stopped_over_an_hour_ago_leave_the_list(tmp_path):
    """Run from a session begun after three deaths (aged two hours: a SIGTERM, a Ctrl-C, a crash) and before
    a fourth: only the fourth is listed; --all lists all four, and their stacks are still read."""
    from test_list_layout import list_in_a_new_session

    tmp_path.chmod(0o700)
    terminated = _die(tmp_path, "idle.py", [], signal.SIGTERM)
    interrupted = _die(tmp_path, "idle.py", [], signal.SIGINT)  # Ctrl-C: an uncaught KeyboardInterrupt
    crashed = _die(tmp_path, "hung.py", ["segv"])
    for pid in (terminated, interrupted, crashed):
        _age(tmp_path, pid, 2 * 3600)
    env = dict(target_env(probe=False, PROBE_RUNTIME_DIR=str(tmp_path)), COLUMNS="200")
    fresh: list = []
    rows, table, every = list_in_a_new_session(
        env, lambda: fresh.append(_die(tmp_path, "idle.py", [], signal.SIGTERM)),
        ("--agents-only", "--json"), ("--agents-only",), ("--agents-only", "--all", "--json"))
    dead = {r["pid"]: r["state"] for r in json.loads(rows.split("\n", 1)[0]) if r["agent"] == "dead"}
    assert set(dead) == set(fresh) and "SIGTERM" in dead[fresh[0]], (dead, rows)
    assert str(terminated) not in table and str(crashed) not in table and str(fresh[0]) in table, table
    assert "3 dead processes (from before this session, or stopped on purpose over an hour ago) are not shown: " \
           "probe list --all" in table, table

    causes = {r["pid"]: r["state"] for r in json.loads(every) if r["agent"] == "dead"}
    assert set(causes) == {terminated, interrupted, crashed, fresh[0]}, causes
    assert "KeyboardInterrupt" in causes[interrupted] and "SIGSEGV" in causes[crashed]
    # Still on disk: its last stacks are there for `probe PID backtrace`.
    assert run_cli(str(terminated), "backtrace", env=env).code == 0


def test_on_a_narrow_terminal_the_command_gives_way_before_how_to_reach(tmp_path):
    tmp_path.chmod(0o700)
    env = target_env(PROBE_RUNTIME_DIR=str(tmp_path))
    proc = spawn("idle.py", [], env=env, wait_socket=False)
    try:
        deadline = time.monotonic() + scaled(10)
        while not (tmp_path / ("%d.sock" % proc.pid)).exists():
            assert time.monotonic() < deadline, "no agent socket"
            time.sleep(0.05)
        for columns in ("60", "80"):
            listed = run_cli("list", "--agents-only", env=dict(target_env(probe=False, PROBE_RUNTIME_DIR=str(tmp_path)),
                                                               COLUMNS=columns))
            assert listed.code == 0, listed.err
            line = next(ln for ln in listed.out.splitlines() if ln.startswith(str(proc.pid)))
            assert line.rstrip().endswith("probe %d ..." % proc.pid), listed.out  # whole
            assert "idle.py" in line or "…" in line, listed.out  # the command, shortened or cut
            assert all(len(ln) <= int(columns) for ln in listed.out.splitlines()), listed.out
    finally:
        proc.kill()
