"""``probe diagnose``: each verdict from a trouble planted in a real torchrun job on CPU (gloo), and no false
alarm on a healthy or merely slow one; the rules alone on evidence made by hand."""

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor


from probe import _paths
from probe.client.results import Frame
from probe.diagnose.evidence import RankEvidence, Sample
from probe.diagnose.rules import judge
from probe.diagnose.verdict import EXIT_CODES
from probe.tables.torch.steps import read_progress
from procs import REPO, run_cli, scaled, target_env
from test_cluster import needs_torchrun, torchrun_job

HEALTHY, DEGRADED, STUCK, DEAD = (EXIT_CODES[s] for s in ("healthy", "degraded", "stuck", "dead"))


def _cmd(ranks, rest):
    return "probe T %s" % rest


def _frames(*stack, thread_id=1, main=True, name="MainThread"):
    return [Frame(thread_id, name, thread_id, main, d, f, p, n, c) for d, (f, p, n, c) in enumerate(stack)]


_C10D = "/x/site-packages/torch/distributed/distributed_c10d.py"


def _rank(rank, frames, cpu=1.0, fr=None, trace=None, state="answering", at=0.0):
    ev = RankEvidence(rank, "h", 100 + rank, state=state, frames=frames, at=at,
                      threads=[{"thread_id": 1, "thread_name": "MainThread", "is_main": True, "cpu": cpu}],
                      fr=fr, trace=trace)
    return ev


def _sample(ranks, at):
    return Sample({r.rank: r for r in ranks}, len(ranks), at=at)


def _in_all_reduce():
    return _frames(("all_reduce", _C10D, 2500, "work.wait()"), ("sync", "/job/train.py", 40, "dist.all_reduce(t)"))


def _loading():
    return _frames(("wait", "/usr/lib/python3.11/threading.py", 320, "waiter.acquire()"),
                   ("load_next_batch", "/job/train.py", 20, "ev.wait()"))


def test_rules_fr_hang_blames_the_rank_that_did_not_issue_the_collective_not_those_waiting():
    def fr(seq, done, age):
        return [{"pg": "0", "pg_desc": "default_pg", "last_seq": seq, "last_op": "gloo:all_reduce", "last_done": done,
                 "last_age": age, "period": 0.05}]

    first = _sample([_rank(0, _in_all_reduce(), 1.0, fr(7, False, 5.0)), _rank(1, _loading(), 1.0, fr(6, True, 5.1)),
                     _rank(2, _in_all_reduce(), 1.0, fr(7, False, 5.0))], 0.0)
    last = _sample([_rank(0, _in_all_reduce(), 1.0, fr(7, False, 6.0)), _rank(1, _loading(), 1.0, fr(6, True, 6.1)),
                    _rank(2, _in_all_reduce(), 1.0, fr(7, False, 6.0))], 1.0)
    report = judge(first, last, _cmd)
    assert report.status == "stuck" and report.exit_code == STUCK
    verdict = report.verdicts[0]
    assert verdict.kind == "collective_hang" and verdict.culprits == [1] and verdict.victims == [0, 2]
    assert "rank 1 did not issue gloo:all_reduce #7" in verdict.summary
    assert verdict.where["func"] == "wait" and verdict.where["called_from"]["func"] == "load_next_batch"
    assert verdict.evidence[0].rows and verdict.evidence[0].command.startswith("probe T query")

    # Each next step can be followed as printed: a path it names exists, or is a placeholder to choose.
    for step in verdict.next:
        for word in step.replace("`", " ").split():
            if word.startswith("/") and "{rank}" in word:
                assert os.path.isdir(os.path.dirname(word)), step

    # The same picture where the waiting ranks arrived only a moment ago, at the group's pace: no hang.
    young = _sample([_rank(0, _in_all_reduce(), 1.0, fr(7, False, 0.2)), _rank(1, _loading(), 1.0, fr(6, True, 0.3)),
                     _rank(2, _in_all_reduce(), 1.0, fr(7, False, 0.2))], 1.0)
    assert judge(first, young, _cmd).status != "stuck"


def test_rules_need_evidence_a_straggler_is_named_by_its_compute_and_a_quiet_job_is_not_called_stuck():
    def trace(step, compute):
        return {"step": step, "compute": compute, "step_s": 0.2, "last_age": 0.05, "top_module": "block"}

    forward = _frames(("forward", "/job/train.py", 30, "time.sleep(x)"))
    first = _sample([_rank(r, forward, 1.0, None, trace(10, 0.02)) for r in range(4)], 0.0)
    last = _sample([_rank(r, forward, 1.5, None, trace(15, 0.17 if r == 3 else 0.02)) for r in range(4)], 1.0)
    report = judge(first, last, _cmd)
    assert report.status == "degraded" and report.verdicts[0].kind == "straggler"
    assert report.verdicts[0].culprits == [3] and "module block" in report.verdicts[0].summary

    # No trace, no Flight Recorder, main threads in the same place gaining no CPU, not in a collective:
    # nothing says it is stuck, and nothing is made up: unsure, not healthy (a wait and a hang look alike).
    still = [_rank(r, forward, 1.0) for r in range(2)]
    report = judge(_sample(still, 0.0), _sample(still, 3.0), _cmd)
    summary = report.verdicts[0].summary
    assert report.status == "degraded" and report.verdicts[0].kind == "unknown", report.verdicts
    assert summary.startswith("progress unknown on ranks 0-1: no optimizer step counted") and \
        summary.endswith("a wait and a hang look alike here"), summary
    assert report.verdicts[0].culprits == [] and any("TORCH_FR_BUFFER_SIZE" in n for n in report.verdicts[0].next)
    # ... where every main thread ran, the job works at something: no trouble found, progress unknown
    busy = [_rank(r, forward, 1.0) for r in range(2)], [_rank(r, forward, 1.5) for r in range(2)]
    report = judge(_sample(busy[0], 0.0), _sample(busy[1], 3.0), _cmd)
    assert report.status == "healthy" and report.verdicts[0].summary.endswith(
        "; no optimizer step counted: progress unknown"), report.verdicts[0].summary


def _progress(pid):
    """Rank ``pid``'s step count and last step time, from its agent's progress file (the step counter's)."""
    found = read_progress(_paths.progress_path(pid))
    assert found is not None and found.pid == pid, "no progress file of %d" % pid
    return found


def _diagnose(target, *args, timeout=60):
    return run_cli(target, "diagnose", *args, timeout=timeout)


def _until(check, seconds, what):
    deadline = time.monotonic() + scaled(seconds)
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last is not None:
            return last
        time.sleep(0.5)
    raise AssertionError("%s within %.0f s; last: %r" % (what, scaled(seconds), last))


def _expect(target, code, *words):
    """Diagnose until it exits ``code`` with every word in its output; the result."""
    def check():
        result = _diagnose(target)
        return result if result.code == code and all(w in result.out for w in words) else None
    try:
        return _until(check, 40, "diagnose exit %d with %r" % (code, words))
    except AssertionError:
        result = _diagnose(target)
        raise AssertionError("expected exit %d with %r; got %d:\n%s\n%s" % (code, words, result.code, result.out,
                                                                           result.err)) from None


@needs_torchrun
def test_one_job_healthy_slow_straggler_skipped_collective_stopped_gil_and_killed(tmp_path):
    """One 2-rank job with the Flight Recorder and the trace on; the troubles are planted one after another
    through its control file."""
    control = tmp_path / "control"
    control.write_text("")
    with torchrun_job("dist_diagnose.py", 2, timeout=180, extra=("--monitor-interval=60",),
                      DIAG_CONTROL=str(control), TORCH_FR_BUFFER_SIZE="2000", PROBE_TORCH_TRACE="1") as (port, pids):
        master = "127.0.0.1:%d" % port

        # Healthy and busy: never a false alarm. Two looks at a time (each waits a second between its samples).
        with ThreadPoolExecutor(2) as pool:
            looks = list(pool.map(lambda _: _diagnose(master), range(10)))
        for result in looks:
            assert result.code == HEALTHY and result.out.startswith("HEALTHY: healthy: steps advance on ranks 0-1"), \
                (result.code, result.out, result.err)
        assert "trace:" in result.out and "Flight Recorder:" in result.out
        one = _diagnose(str(pids[0]), "--json")
        report = json.loads(one.out)
        assert one.code == HEALTHY and report["single"] and report["status"] == "healthy", one.out

        # --watch: a report a round, saying what changed.
        watch = subprocess.Popen([sys.executable, "-m", "probe", master, "diagnose", "--watch", "0.5", "--json"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                 env=target_env(probe=False))
        try:
            rounds = [json.loads(watch.stdout.readline()) for _ in range(2)]
        finally:
            watch.send_signal(signal.SIGINT)
            watch.communicate(timeout=30)
        assert rounds[0]["changes"] is None and any("made" in line for line in rounds[1]["changes"]), rounds[1]

        # A merely slow job (2.5 s steps on every rank) is not called hung. The ranks take the order at their
        # next step each: until both have made two slow steps, the trace may still show one rank's slow
        # step beside the other's quick one (a passing straggler, degraded): never stuck, never dead.
        steps = {pid: _progress(pid).steps for pid in pids.values()}
        control.write_text("slow 0\n")
        # both ranks made two slow steps (the one under way when the order came may be a quick one)
        _until(lambda: all(p.steps >= steps[pid] + 3 and p.step_time >= 2.5 for pid in pids.values()
                           for p in [_progress(pid)]) or None, 30, "two slow steps on each rank")
        for _ in range(3):
            result = _diagnose(master)
            assert result.code in (HEALTHY, DEGRADED) and "hang" not in result.out.splitlines()[0], (
                result.code, result.out)

        # A straggler: rank 1 sleeps 0.15 s more in Block.forward every step.
        control.write_text("straggle 1\n")
        result = _expect(master, DEGRADED, "straggler: rank 1 computes", "module block")
        report = json.loads(_diagnose(master, "--json").out)
        assert report["verdicts"][0]["culprits"] == [1] and report["verdicts"][0]["victims"] == [0], report

        # Rank 1 skips the collective (Flight Recorder on): it is blamed, rank 0 is named as waiting.
        control.write_text("skip 1\n")
        result = _expect(master, STUCK, "collective hang in process group 0 (default_pg): rank 1 did not issue "
                                        "gloo:all_reduce #", "rank 0 waits in it")
        assert "waiting (not to blame): rank 0" in result.out and "sync_loss" in result.out
        control.write_text("")
        _expect(master, HEALTHY, "HEALTHY")

        # Stopped: named, with kill -CONT.
        os.kill(pids[1], signal.SIGSTOP)
        try:
            result = _expect(master, STUCK, "rank 1 is stopped", "kill -CONT %d" % pids[1])
            assert "rank 0 waits for it in all_reduce" in result.out
        finally:
            os.kill(pids[1], signal.SIGCONT)
        _expect(master, HEALTHY, "HEALTHY")

        # A C call keeps rank 1's GIL.
        control.write_text("gil 1\n")
        result = _expect(master, STUCK, "rank 1 cannot answer", "hold_the_gil", "a call into C that keeps the GIL")
        assert result.out.index("hold_the_gil") < result.out.index("evidence:")

        # Killed: dead, and how.
        os.kill(pids[1], signal.SIGKILL)
        result = _expect(master, DEAD, "rank 1 is dead", "killed by signal 9")
        assert result.out.startswith("DEAD: ")


@needs_torchrun
def test_a_skipped_collective_without_the_flight_recorder_is_found_from_the_stacks():
    """dist_hang.py: rank 2 waits in its data loader while ranks 0, 1, 3 wait in all_reduce; no Flight Recorder."""
    with torchrun_job("dist_hang.py", 4, timeout=180, TORCH_FR_BUFFER_SIZE="0") as (port, pids):
        master = "127.0.0.1:%d" % port
        result = _expect(master, STUCK, "collective hang: rank 2 did not enter all_reduce; ranks 0-1,3 wait in it")
        assert "load_next_batch" in result.out.split("evidence:")[0]  # where, in the verdict's first lines
        assert "the Flight Recorder is off" in result.out
        assert "probe %s --ranks 2 backtrace" % master in result.out
        report = json.loads(_diagnose(master, "--json").out)
        assert [(v["kind"], v["culprits"], v["victims"]) for v in report["verdicts"]] == \
            [("collective_hang", [2], [0, 1, 3])], report["verdicts"]

        # One rank alone: it waits in all_reduce; the rank to blame is for the job's diagnosis to name.
        alone = _diagnose(str(pids[0]))
        assert alone.code in (DEGRADED, STUCK) and "waits in all_reduce" in alone.out, alone.out


def test_two_threads_in_a_lock_cycle_are_named_with_where_each_waits_and_who_holds_what(target_factory):
    proc = target_factory("lock_cycle.py")
    result = _expect(str(proc.pid), STUCK, "audit, transfer wait for a lock", "a deadlock: thread audit waits for "
                     "ledger_lock, held by thread transfer; thread transfer waits for audit_lock, held by thread audit")
    assert "thread transfer at `with audit_lock:`" in result.out and "thread audit at `with ledger_lock:`" in result.out
    assert "held by thread audit, inside `with audit_lock:` (" in result.out  # where it took it
    assert "torch is not loaded" in result.out  # said, not guessed
    report = json.loads(_diagnose(str(proc.pid), "--json").out)
    rows = [row for piece in report["verdicts"][0]["evidence"] for row in piece["rows"]]
    assert sorted((r["thread"], r["lock"], r["holder"]) for r in rows) == [
        ("audit", "ledger_lock", "transfer"), ("transfer", "audit_lock", "audit")], rows


def test_the_thread_that_keeps_an_rlock_the_main_thread_waits_for_is_named(target_factory):
    proc = target_factory("lock_rlock.py")
    result = _expect(str(proc.pid), STUCK, "MainThread waits for a lock", "MainThread waits for registry_lock, held "
                     "by thread refresher in refresh (")
    assert "holder unknown" not in result.out and "what thread refresher does while holding it" in result.out


def test_rules_a_lock_whose_holder_the_stacks_do_not_show_is_said_unknown(tmp_path):
    source = tmp_path / "job.py"
    source.write_text("import threading, time\nlock = threading.Lock()\n\ndef hold():\n    lock.acquire()\n"
                      "    time.sleep(100)\n\ndef work():\n    with lock:\n        pass\n")
    path = str(source)
    waiter = _frames(("work", path, 9, "with lock:"))
    other = [Frame(2, "other", 2, False, 0, "hold", path, 6, "time.sleep(100)")]  # took it by acquire()
    ev = [_rank(0, waiter + other, at=t) for t in (0.0, 3.0)]
    report = judge(Sample({0: ev[0]}, 1, True, at=0.0), Sample({0: ev[1]}, 1, True, at=3.0), _cmd)
    verdict = report.verdicts[0]
    assert verdict.kind == "lock_wait" and "the holder of lock unknown" in verdict.summary, verdict.summary
    assert "holder unknown: no thread's stack is inside a `with lock:` block" in verdict.evidence[0].text
