"""``probe diagnose`` by the step counter (torch.steps), with neither the trace nor the Flight Recorder: a
healthy job's step rate, a rank that stops stepping, ranks whose own steps are slower; and the rules on
evidence made by hand."""

import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from probe.client.results import Frame
from probe.diagnose.evidence import RankEvidence, Sample
from probe.diagnose.rules import judge
from probe.diagnose.verdict import EXIT_CODES
from procs import run_cli, scaled, target_env
from test_cluster import needs_torchrun, torchrun_job

HEALTHY, DEGRADED, STUCK = (EXIT_CODES[s] for s in ("healthy", "degraded", "stuck"))


def _cmd(ranks, rest):
    return "probe T %s" % rest


def _rank(rank, steps, age, step_s, cpu, at):
    frames = [Frame(1, "MainThread", 1, True, 0, "forward", "/job/train.py", 30, "y = f(x)")]
    return RankEvidence(rank, "h", 100 + rank, frames=frames, at=at,
                        threads=[{"thread_id": 1, "thread_name": "MainThread", "is_main": True, "cpu": cpu}],
                        steps=[{"optimizer": "SGD@0x1", "steps": steps, "last_age": age, "step_s": step_s}])


def _sample(ranks, at):
    return Sample({r.rank: r for r in ranks}, len(ranks), at=at)


def test_rules_equal_step_times_blame_no_rank_and_a_stall_names_the_rank_behind():
    # Every rank steps, at one pace (a collective every step): healthy, with the rate; nobody called slow.
    first = _sample([_rank(r, 100, 0.01, 0.1, 1.0, 0.0) for r in range(4)], 0.0)
    last = _sample([_rank(r, 110, 0.02, 0.1, 2.0, 1.0) for r in range(4)], 1.0)
    report = judge(first, last, _cmd)
    assert report.status == "healthy" and report.verdicts[0].summary.startswith(
        "healthy: steps advance on ranks 0-3 (10.0 steps/s"), report.verdicts[0].summary
    assert "a straggler would slow them all alike" in " ".join(e.text for e in report.verdicts[0].evidence)

    # No step anywhere for 30 s, no main thread running; rank 2 is a step behind the others: it is named.
    first = _sample([_rank(r, 41 if r != 2 else 40, 29.0, 0.1, 1.0, 0.0) for r in range(4)], 0.0)
    last = _sample([_rank(r, 41 if r != 2 else 40, 30.0, 0.1, 1.0, 1.0) for r in range(4)], 1.0)
    report = judge(first, last, _cmd)
    verdict = report.verdicts[0]
    assert report.status == "stuck" and verdict.kind == "stalled", report.verdicts
    assert verdict.culprits == [2] and verdict.victims == [0, 1, 3] and "rank 2 is behind (step 40" in verdict.summary

    # No optimizer anywhere, main threads still: progress unknown, said so, and unsure rather than healthy.
    bare = [RankEvidence(r, "h", 100 + r, frames=[], steps_why="it has no optimizer") for r in range(2)]
    report = judge(_sample(bare, 0.0), _sample(bare, 1.0), _cmd)
    summary = report.verdicts[0].summary
    assert report.status == "degraded" and summary.startswith(
        "progress unknown on ranks 0-1: no optimizer step counted (it has no optimizer)"), summary
    assert "without the trace" not in summary
    # ... and where torch is not loaded, no collective can hold them: no trouble found, progress unknown
    plain = [RankEvidence(r, "h", 100 + r, frames=[], steps_why="torch is not loaded", fr_why="torch is not loaded")
             for r in range(2)]
    report = judge(_sample(plain, 0.0), _sample(plain, 1.0), _cmd)
    assert report.status == "healthy" and report.verdicts[0].summary.endswith("progress unknown"), report.verdicts


def test_a_torch_process_without_an_optimizer_is_healthy_with_no_step_counted_and_progress_unknown(target_factory):
    proc = target_factory("no_optimizer.py")
    result = _diagnose(str(proc.pid))
    headline = result.out.splitlines()[0]
    assert result.code == HEALTHY and headline == (
        "HEALTHY: no trouble found on process %d; no optimizer step counted (no optimizer has made a step since "
        "probe began counting): progress unknown" % proc.pid), (result.code, result.out, result.err)
    assert "progress unknown: no optimizer step counted" in result.out and "without the trace" not in result.out


def _diagnose(target, *args):
    # The first look gets half the deadline: with the suite on both cores a rank's answer has been seen to
    # take over 2 s, and a rank that does not answer in time is (rightly) DEGRADED, not healthy.
    return run_cli(target, "--deadline", "%.0f" % max(10, scaled(5)), "diagnose", *args, timeout=120)


def _expect(target, code, *words):
    deadline = time.monotonic() + scaled(40)
    result = None
    while time.monotonic() < deadline:
        result = _diagnose(target)
        if result.code == code and all(w in result.out for w in words):
            return result
        time.sleep(0.5)
    raise AssertionError("expected exit %d with %r; got %s:\n%s\n%s" % (
        code, words, result and result.code, result and result.out, result and result.err))


@needs_torchrun
def test_without_the_trace_healthy_20_times_then_a_rank_that_stops_stepping_and_slow_steps(tmp_path):
    control = tmp_path / "control"
    control.write_text("")
    with torchrun_job("dist_steps.py", 2, timeout=180, extra=("--monitor-interval=60",), DIAG_CONTROL=str(control),
                      TORCH_FR_BUFFER_SIZE="0") as (port, pids):
        master = "127.0.0.1:%d" % port

        # Healthy and busy, no trace: steps advance on both ranks, at a rate; never a false alarm. Two looks at
        # a time (each waits a second between its samples): 20 looks in half the time.
        with ThreadPoolExecutor(2) as pool:
            looks = list(pool.map(lambda _: _diagnose(master), range(20)))
        for result in looks:
            assert result.code == HEALTHY and result.out.startswith("HEALTHY: healthy: steps advance on ranks 0-1 ("), \
                (result.code, result.out, result.err)
            assert "steps/s" in result.out.splitlines()[0] and "progress unknown" not in result.out, result.out
        report = json.loads(_diagnose(master, "--json").out)
        assert all(p["optimizer_steps"] > 0 for p in report["progress"].values()), report["progress"]

        # --watch without the trace: each round says how many steps each rank made since the last.
        watch = subprocess.Popen([sys.executable, "-m", "probe", "--deadline", "4", master, "diagnose", "--watch", "0.5",
                                  "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=target_env(probe=False))
        try:
            rounds = [json.loads(watch.stdout.readline()) for _ in range(2)]
        finally:
            watch.send_signal(signal.SIGINT)
            watch.communicate(timeout=30)
        assert any("ranks 0-1 made" in line for line in rounds[1]["changes"]), rounds[1]["changes"]

        # Rank 1 sleeps between steps, outside any collective; rank 0 waits for it in all_reduce. Rank 1 is
        # named, rank 0 is not blamed, and the step counter says both stopped at one step.
        control.write_text("nap 1\n")
        result = _expect(master, STUCK, "rank 1 did not enter all_reduce", "between_steps",
                         "step counter: ranks 0-1 at step")
        assert "waiting (not to blame): rank 0" in result.out, result.out
        control.write_text("")
        _expect(master, HEALTHY, "HEALTHY: healthy: steps advance")

        # The ranks step on their own from now on; rank 1's steps take 0.15 s more: its own are slower.
        control.write_text("solo 0\nslow 1\n")
        _expect(master, DEGRADED, "slow steps: rank 1 takes", "its own iterations are slower")

        # Rank 1 stops stepping while rank 0 goes on: rank 1 is named, rank 0 is not blamed.
        control.write_text("solo 0\nnap 1\n")
        result = _expect(master, STUCK, "rank 1 makes no optimizer step", "while rank 0 advances", "between_steps")
        report = json.loads(_diagnose(master, "--json").out)
        verdict = report["verdicts"][0]
        assert (verdict["kind"], verdict["culprits"], verdict["victims"]) == ("no_step", [1], []), verdict
