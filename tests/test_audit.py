"""The audit trail (issue 22): every eval snippet, checkpoint, debug stop and trace change is recorded in
the target before it runs and with its outcome after (ok, error, interrupted), refused requests too, in an
owner-only append-only file beside the socket, bounded and rotated; read back with `probe T audit` (also
after the process died) and as the table probe.audit."""

import hashlib
import json
import os
import socket
import stat
import time

import pytest

import probe
from procs import running, run_cli, scaled, target_env
from terminal import run_in_pty


def _trail_path(pid: int, kind: str = "") -> str:
    """The file of one kind of record: the actions (""), "reads" or "refused"."""
    directory = os.environ["PROBE_RUNTIME_DIR"]
    names = [n for n in os.listdir(directory) if n.startswith("audit-%d-" % pid) and n.endswith(".jsonl")
             and n.count(".") == (2 if kind else 1) and (not kind or ".%s." % kind in n)]
    assert len(names) == 1, names
    return os.path.join(directory, names[0])


def _trail(pid: int, kind: str = "") -> list:
    with open(_trail_path(pid, kind)) as handle:
        return [json.loads(line) for line in handle]


def _audit_json(target: str, *extra: str, env=None) -> list:
    done = run_cli(target, "audit", "--json", *extra, env=env)
    assert done.code == 0, done.err
    return [json.loads(line) for line in done.out.splitlines()]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def idle(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    read = directory / "read.token"
    read.write_text("read-token-for-audit\n")
    read.chmod(0o600)
    port = _free_port()
    env = target_env(PROBE_LISTEN="127.0.0.1:%d" % port, PROBE_READ_TOKEN_FILE=str(read))
    with running("idle.py", env=env) as proc:
        proc.port, proc.read_file = port, str(read)
        yield proc


def test_an_eval_is_recorded_before_it_runs_and_with_its_outcome_after(idle):
    # The snippet looks for its own start record in the trail: it is there before the snippet runs.
    code = ("import glob, os\n"
            "names = glob.glob(os.path.join(os.environ['PROBE_RUNTIME_DIR'], 'audit-%d-*.jsonl' % os.getpid()))\n"
            "print('seen-before' if 'marker-4711' in open(names[0]).read() else 'absent')")
    done = run_cli(str(idle.pid), "eval", code)
    assert done.out.strip() == "seen-before", (done.out, done.err)
    raised = run_cli(str(idle.pid), "eval", "raise ValueError('boom-17')")
    assert raised.code == 1
    records = _trail(idle.pid)
    starts = [r for r in records if r["phase"] == "start" and "marker-4711" in r.get("code", "")]
    assert len(starts) == 1
    start = starts[0]
    assert start["command"] == "eval" and start["scope"] == "eval" and start["by"] == "unix socket owner"
    assert start["peer"].startswith("uid %d pid " % os.getuid())
    assert start["code_sha256"] == hashlib.sha256(code.encode()).hexdigest() and start["code_bytes"] == len(code)
    end = [r for r in records if r["phase"] == "end" and r["seq"] == start["seq"]]
    assert len(end) == 1 and end[0]["outcome"] == "ok" and end[0]["time"] >= start["time"]
    boom = [r for r in records if "boom-17" in r.get("code", "")][0]
    boom_end = [r for r in records if r["phase"] == "end" and r["seq"] == boom["seq"]][0]
    assert boom_end["outcome"] == "error" and "ValueError: boom-17" in boom_end["error"]
    assert stat.S_IMODE(os.stat(_trail_path(idle.pid)).st_mode) == 0o600


def test_a_snippet_interrupted_by_ctrl_c_is_recorded_interrupted(idle, tmp_path):
    started = tmp_path / "started"
    code = "import time\nopen(%r, 'w').close()\nwhile True: time.sleep(0.02)  # ctrl-c-case" % str(started)
    status, out, _ = run_in_pty([str(idle.pid), "eval", code], when=lambda _: started.exists())
    assert status == 130, out
    deadline = time.monotonic() + scaled(10)
    while True:
        actions = [a for a in _audit_json(str(idle.pid)) if "ctrl-c-case" in (a.get("code") or "")]
        if actions and actions[0]["outcome"]:
            break
        assert time.monotonic() < deadline, actions
        time.sleep(0.05)
    assert actions[0]["outcome"] == "interrupted", actions
    interrupts = [a for a in _audit_json(str(idle.pid)) if a["command"] == "interrupting a snippet"]
    assert interrupts and interrupts[-1]["scope"] == "control", interrupts


def test_a_refused_request_is_recorded_with_its_peer_and_the_table_shows_the_trail(idle):
    refused = run_cli("127.0.0.1:%d" % idle.port, "--token-file", idle.read_file, "eval", "print('nope-55')")
    assert refused.code == 4
    entries = [a for a in _audit_json(str(idle.pid)) if a["outcome"] == "refused"]
    assert entries and entries[-1]["command"] == "eval" and entries[-1]["granted_by"] == "read token"
    assert entries[-1]["peer"].startswith("127.0.0.1:") and "needs the eval scope" in entries[-1]["error"]
    assert entries[-1]["code"] is None  # a refused snippet is not kept
    rows = run_cli(str(idle.pid), "query", "SELECT command, outcome, scope, granted_by FROM probe.audit "
                   "WHERE outcome = 'refused'", "-f", "json")
    assert rows.code == 0 and {"command": "eval", "outcome": "refused", "scope": "eval",
                               "granted_by": "read token"} in json.loads(rows.out), rows.out
    # Reads are not recorded unless the target asks for it.
    run_cli(str(idle.pid), "query", "SELECT 'read-case-9' AS x")
    assert not [r for r in _trail(idle.pid) if "read-case-9" in json.dumps(r)]
    # the text form: one line per action, with its code
    text = run_cli(str(idle.pid), "audit", "-n", "3")
    assert text.code == 0 and "refused" in text.out and "[eval]" in text.out, text.out


def test_repl_input_is_recorded_as_repl(idle):
    done = run_cli(str(idle.pid), "repl", input="repl_case_31 = 6 * 7\nrepl_case_31\n")
    assert "42" in done.out, done.out
    actions = [a for a in _audit_json(str(idle.pid), "-n", "1000") if "repl_case_31" in (a.get("code") or "")]
    assert [(a["command"], a["outcome"]) for a in actions] == [("repl", "ok"), ("repl", "ok")], actions


def test_reads_are_recorded_when_the_target_asks(tmp_path):
    with running("idle.py", env=target_env(PROBE_AUDIT_READS="1")) as proc:
        run_cli(str(proc.pid), "query", "SELECT 'read-case-10' AS x")
        run_cli(str(proc.pid), "backtrace")
        records = [r for r in _trail(proc.pid, "reads") if r["phase"] == "start"]
        assert any(r["command"] == "query" and "read-case-10" in json.dumps(r.get("detail")) and r["scope"] == "read"
                   for r in records), records
        assert any(r["command"] == "backtrace" for r in records), records


def test_the_trail_is_rotated_bounded_and_owner_only_and_outlives_the_process(tmp_path):
    env = target_env(PROBE_AUDIT_MAX_BYTES="4096", PROBE_AUDIT_KEEP="2")
    with running("idle.py", env=env) as proc:
        client = probe.connect(str(proc.pid))
        for i in range(30):
            client.eval("x_%d = %r" % (i, "y" * 600))
        client.eval("'last-one'")
        directory = os.environ["PROBE_RUNTIME_DIR"]
        names = sorted(n for n in os.listdir(directory) if n.startswith("audit-%d-" % proc.pid))
        base = [n for n in names if n.endswith(".jsonl")][0]
        assert names == sorted([base, base + ".1", base + ".2"]), names
        for name in names:
            info = os.stat(os.path.join(directory, name))
            assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_size <= 4096, (name, info)
        for name in names:  # every line whole: one write per record
            with open(os.path.join(directory, name)) as handle:
                for line in handle:
                    json.loads(line)
        live = _audit_json(str(proc.pid), "-n", "1000")
        assert live[-1]["code"] == "'last-one'" and live[-1]["outcome"] == "ok"
        proc.kill()
        dead = run_cli(str(proc.pid), "audit", "--json", "-n", "1000")
        assert dead.code == 0, dead.err
        after = [json.loads(line) for line in dead.out.splitlines()]
        assert [a["code"] for a in after] == [a["code"] for a in live] and "read from" in dead.err, dead.err


def test_checkpoint_trace_and_debug_stop_are_recorded(tmp_path):
    path = str(tmp_path / "ck.pt")
    with running("train.py", "--idle", timeout=120) as proc:
        target = str(proc.pid)
        assert run_cli(target, "checkpoint", path, "--model", "model").code == 0
        assert run_cli(target, "checkpoint", str(tmp_path / "nodir" / "x.pt")).code != 0
        assert run_cli(target, "trace", "start", "--every", "2").code == 0
        assert run_cli(target, "trace", "stop").code == 0
        assert run_cli(target, "debug", "--stop").code in (0, 1)
        actions = _audit_json(target)
    by_command = {}
    for action in actions:
        by_command.setdefault(action["command"], []).append(action)
    ok, failed = by_command["checkpoint with --model/--optimizer/--frame"][0], by_command["checkpoint"][0]
    assert ok["outcome"] == "ok" and ok["scope"] == "eval" and ok["code"] == "model" and path in ok["detail"]
    assert failed["outcome"] == "error" and failed["scope"] == "control" and failed["error"]
    start = by_command["trace start"][0]
    assert start["outcome"] == "ok" and start["scope"] == "control" and json.loads(start["detail"])["every"] == 2
    assert by_command["trace stop"][0]["outcome"] == "ok"
    assert by_command["debug stop"][0]["scope"] == "control"


def _wait_socket(runtime, pid: int) -> None:
    deadline = time.monotonic() + scaled(20)
    while not (runtime / ("%d.sock" % pid)).exists():
        assert time.monotonic() < deadline, "no agent socket"
        time.sleep(0.02)


def test_a_trail_that_cannot_be_written_never_reaches_the_program(tmp_path):
    from probe import _paths

    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    with running("idle.py", env=target_env(PROBE_RUNTIME_DIR=str(runtime)), wait_socket=False) as proc:
        _wait_socket(runtime, proc.pid)
        # Something that is no file where the trail goes (it is opened on the first audited request).
        os.mkdir(runtime / ("audit-%d-%d.jsonl" % (proc.pid, _paths.process_start_ticks(str(proc.pid)))))
        env = target_env(probe=False, PROBE_RUNTIME_DIR=str(runtime))
        for _ in range(2):
            done = run_cli(str(proc.pid), "eval", "6 * 7", env=env)
            assert done.code == 0 and done.out.strip() == "42", done
        proc.popen.terminate()
        proc.popen.wait(scaled(10))
        err = proc.popen.stderr.read().decode()
    assert err.count("the audit trail") == 1 and "cannot be written" in err, err


def test_the_trails_of_dead_processes_are_pruned_to_the_newest(tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    gone = 4190000  # above any pid a test machine hands out
    for i in range(40):
        path = runtime / ("audit-%d-%d.jsonl" % (gone + i, 1000 + i))
        path.write_text("{}\n")
        os.utime(path, (1_700_000_000 + i, 1_700_000_000 + i))
    for i, _why in ((39, "the newest one's rotated part stays"), (0, "the oldest one's goes with it")):
        path = runtime / ("audit-%d-%d.jsonl.1" % (gone + i, 1000 + i))
        path.write_text("{}\n")
        os.utime(path, (1_700_000_000 + i - 1, 1_700_000_000 + i - 1))  # older than the file that followed it
    with running("idle.py", env=target_env(PROBE_RUNTIME_DIR=str(runtime)), wait_socket=False) as proc:
        _wait_socket(runtime, proc.pid)
        run_cli(str(proc.pid), "eval", "1", env=target_env(probe=False, PROBE_RUNTIME_DIR=str(runtime)))
        names = sorted(n for n in os.listdir(runtime) if n.startswith("audit-"))
    dead = [n for n in names if not n.startswith("audit-%d-" % proc.pid)]
    assert len([n for n in dead if n.endswith(".jsonl")]) == 32, dead
    assert "audit-%d-1039.jsonl.1" % (gone + 39) in dead and "audit-%d-1000.jsonl.1" % gone not in dead
    assert "audit-%d-1008.jsonl" % (gone + 8) in dead and "audit-%d-1007.jsonl" % (gone + 7) not in dead


def test_the_control_token_changes_the_lr_and_the_change_is_recorded(tmp_path):
    control = tmp_path / "control.token"
    control.write_text("control-token-for-lr\n")
    control.chmod(0o600)
    port = _free_port()
    env = target_env(PROBE_LISTEN="127.0.0.1:%d" % port, PROBE_CONTROL_TOKEN_FILE=str(control))
    with running("lr_loop.py", str(tmp_path / "log"), "--sched", "lambda", env=env, timeout=120) as proc:
        done = run_cli("127.0.0.1:%d" % port, "--token-file", str(control), "lr", "0.05", "--json")
        assert done.code == 0, (done.code, done.err)
        assert json.loads(done.out)["readback"]["stuck"], done.out
        actions = [a for a in _audit_json(str(proc.pid)) if a["command"] == "lr"]
    assert [a["outcome"] for a in actions] == ["ok", "ok", "ok"], actions  # plan, change, read-back
    assert {a["scope"] for a in actions} == {"control"} and {a["granted_by"] for a in actions} == {"control token"}
    assert json.loads(actions[1]["detail"])["what"] == "change" and "0.05" in actions[1]["detail"], actions[1]
