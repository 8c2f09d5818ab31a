"""``probe ... profile``: torch.profiler on every rank of a real torchrun job (gloo, CPU) for N steps, one
merged trace with a process per rank, and the ops as ``torch.profile`` across ranks; one process alone,
and the refusal of a process that cannot run (stopped, GIL held) or has no torch."""

import json
import os
import signal

from procs import run_cli, running, scaled
from test_cluster import needs_torchrun, torchrun_job


@needs_torchrun
def test_profile_two_ranks_one_trace_and_the_table_across_ranks(tmp_path):
    out = str(tmp_path / "trace.json")
    with torchrun_job("dist_steps.py", 2, timeout=scaled(120), extra=("--monitor-interval=60",),
                      TORCH_FR_BUFFER_SIZE="0") as (port, pids):
        master = "127.0.0.1:%d" % port
        done = run_cli(master, "profile", "--steps", "3", "-o", out, "--timeout", str(scaled(60)),
                       timeout=scaled(120))
        assert done.code == 0, (done.code, done.out, done.err)
        assert "wrote" in done.out and "of 2 ranks" in done.out, (done.out, done.err)
        assert "profile 3/3 steps captured" in done.err, done.err  # the progress
        with open(out) as handle:
            trace = json.load(handle)
        events = trace["traceEvents"]
        names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
        assert names == {0: "rank 0", 1: "rank 1"}, names
        for rank in (0, 1):
            ops = [e for e in events if e.get("pid") == rank and e.get("ph") == "X"]
            assert any(e["name"].startswith("aten::") for e in ops), rank
            assert sum(1 for e in ops if e["name"].startswith("ProfilerStep#")) == 3, rank
        # One clock: both ranks' steps lie within seconds of each other (they meet in an all_reduce each step).
        starts = {rank: min(e["ts"] for e in events if e.get("pid") == rank and e.get("ph") == "X") for rank in (0, 1)}
        assert min(starts.values()) >= 0 and abs(starts[0] - starts[1]) < scaled(30) * 1e6, starts

        top = run_cli(master, "--all-ranks", "query",
                      "SELECT rank, op, kind, SUM(calls) AS calls, SUM(self_cpu_s) AS self_s, "
                      "COUNT(DISTINCT step) AS steps FROM torch.profile GROUP BY rank, op, kind",
                      "--merge", "SELECT rank, kind, SUM(self_s) AS s, MAX(steps) AS steps FROM result "
                                 "GROUP BY rank, kind ORDER BY rank, kind", "--json", timeout=scaled(60))
        assert top.code == 0, (top.code, top.out, top.err)
        rows = [json.loads(line) for line in top.out.splitlines() if line.strip()]
        rows = rows[0] if len(rows) == 1 and isinstance(rows[0], list) else rows
        seen = {(r["rank"], r["kind"]) for r in rows}
        assert seen == {(0, "communication"), (0, "compute"), (1, "communication"), (1, "compute")}, rows
        assert all(r["steps"] == 3 and r["s"] > 0 for r in rows), rows

        one = run_cli(master, "profile", "--steps", "1", "--ranks", "1", "--json", timeout=scaled(120))
        assert one.code == 0, (one.code, one.out, one.err)
        assert json.loads(one.out)["ranks"] == [1], one.out


def test_profile_one_process_with_shapes_and_a_stopped_one_refused(tmp_path):
    out = str(tmp_path / "one.json")
    with running("train.py", timeout=scaled(60)) as proc:
        pid = str(proc.pid)
        done = run_cli(pid, "profile", "--steps", "2", "--shapes", "-o", out, "--json", timeout=scaled(90))
        assert done.code == 0, (done.code, done.out, done.err)
        summary = json.loads(done.out)
        assert summary["ranks"] == [0] and summary["events"] > 0, summary  # its rows are summed meanwhile
        with open(out) as handle:
            events = json.load(handle)["traceEvents"]
        assert {e["pid"] for e in events} == {0}
        assert sum(1 for e in events if e.get("name", "").startswith("ProfilerStep#")) == 2
        query = run_cli(pid, "query", "SELECT step, op, calls, input_shapes FROM torch.profile "
                                      "WHERE op = 'aten::addmm' ORDER BY step", "--json", timeout=scaled(60))
        assert query.code == 0, (query.code, query.err)
        rows = [json.loads(line) for line in query.out.splitlines() if line.strip()]
        rows = rows[0] if len(rows) == 1 and isinstance(rows[0], list) else rows
        assert len({r["step"] for r in rows}) == 2 and all(r["input_shapes"].startswith("[[") for r in rows), rows

        os.kill(proc.pid, signal.SIGSTOP)
        try:
            refused = run_cli(pid, "profile", "--steps", "1", "-o", str(tmp_path / "no.json"), timeout=scaled(60))
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert refused.code == 5, (refused.code, refused.out, refused.err)
        assert "stopped" in refused.err, refused.err
        assert not os.path.exists(str(tmp_path / "no.json"))


def test_profile_refuses_a_process_holding_its_gil_and_one_without_torch_in_words(tmp_path):
    """Asked first for its capture's status, a process that holds its GIL in a C call is named with why
    (exit 5) at once, not after --timeout; one that never imported torch has nothing to profile (exit 2)."""
    out = str(tmp_path / "no.json")
    with running("gil_sleep.py", timeout=scaled(60)) as proc:
        held = run_cli(str(proc.pid), "profile", "--steps", "1", "-o", out, "--timeout", "600", timeout=scaled(120))
    assert held.code == 5 and "holds the GIL" in held.err and "capturing" not in held.err, (held.code, held.err)
    with running("idle.py", timeout=scaled(60)) as proc:
        plain = run_cli(str(proc.pid), "profile", "--steps", "1", "-o", out, timeout=scaled(60))
    assert plain.code == 2 and "torch is not loaded" in plain.err, (plain.code, plain.err)
    assert not os.path.exists(out)
