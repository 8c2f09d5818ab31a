"""``probe diagnose`` on one training process: a DataLoader worker that hangs, a NaN from a poisoned batch, a
leak of losses kept with their graphs; and no such verdict on a healthy loop."""

import json

from procs import target_env
from test_diagnose import DEGRADED, HEALTHY, STUCK, _diagnose, _expect


def test_a_hung_dataloader_worker_is_named_with_its_pid_and_its_stack_read_from_outside(target_factory):
    proc = target_factory("loader_hang.py")
    workers = next(line for line in proc.lines if line.startswith("WORKERS")).split()[1:]
    hung = int(workers[1])  # worker 1 makes the batch that holds the sample that never comes
    result = _expect(str(proc.pid), STUCK, "data loader stall", "worker 1 (pid %d)" % hung)
    assert result.out.startswith("STUCK: "), result.out
    assert "__getitem__ (" in result.out and "loader_hang.py" in result.out  # the worker's own stack
    assert "probe %d query \"SELECT" % proc.pid in result.out and "python.workers" in result.out
    report = json.loads(_diagnose(str(proc.pid), "--json").out)
    stall = next(v for v in report["verdicts"] if v["kind"] == "loader_stall")
    rows = [row for piece in stall["evidence"] for row in piece["rows"]]
    assert any(row.get("pid") == hung and row.get("waited_by") for row in rows), stall


def test_a_nan_from_a_poisoned_batch_is_named_with_its_step_and_the_batch(target_factory):
    env = target_env(PROBE_TORCH_TRACE="1", PROBE_TORCH_TRACE_ANOMALIES="1")
    proc = target_factory("nan_batch.py", env=env)
    result = _expect(str(proc.pid), DEGRADED, "numerical:", "the batch held NaN")
    verdict = result.out.split("\n\n")[0]
    assert "step 3" in verdict and "torch.anomalies" in verdict, result.out


def test_memory_growth_of_losses_kept_with_their_graphs_is_named_with_its_holder(target_factory):
    proc = target_factory("leak_graphs.py")
    result = _expect(str(proc.pid), DEGRADED, "memory grows", "requires_grad")
    verdict = result.out.split("\n\n")[0]
    assert "MB/s" in verdict and "autograd graph" in verdict and "torch.tensors" in verdict, result.out


def test_a_healthy_loop_gets_none_of_these_verdicts(target_factory):
    proc = target_factory("grad_loop.py")
    for _ in range(3):
        result = _diagnose(str(proc.pid))
        assert result.code == HEALTHY and result.out.startswith("HEALTHY"), (result.code, result.out)


def _ev(rank, state="answering", memory=None, why=""):
    from probe.client.results import Frame
    from probe.diagnose.evidence import RankEvidence

    frames = [Frame(1, "MainThread", 1, True, 0, "forward", "/job/train.py", 30, "y = f(x)")]
    return RankEvidence(rank, "h", 100 + rank, state=state, why=why, frames=frames, memory=memory,
                        threads=[{"thread_id": 1, "thread_name": "MainThread", "is_main": True, "cpu": 1.0}])


def test_rules_memory_growth_needs_a_steady_rise_over_enough_looks_and_the_oom_killer_needs_its_record():
    from probe.diagnose.evidence import Sample
    from probe.diagnose.rules import judge

    def cmd(ranks, rest):
        return "probe T %s" % rest

    mb = 1024 * 1024
    two = {"readings": [(0.0, 500 * mb), (1.0, 560 * mb)]}  # a rise, but two looks a second apart
    report = judge(Sample({0: _ev(0)}, 1, True, at=0.0), Sample({0: _ev(0, memory=two)}, 1, True, at=1.0), cmd)
    assert report.status == "healthy" and any("not enough samples" in line for line in report.unavailable)
    steady = {"readings": [(0.0, 500 * mb), (1.0, 530 * mb), (3.0, 590 * mb)],
              "tensors": [(1.0, 30 * mb, 530 * mb), (3.0, 85 * mb, 590 * mb)]}  # the live tensors grew with it
    report = judge(Sample({0: _ev(0)}, 1, True, at=0.0), Sample({0: _ev(0, memory=steady)}, 1, True, at=3.0), cmd)
    assert report.verdicts[0].kind == "memory_growth" and "30.0 MB/s" in report.verdicts[0].summary
    warmup = {"readings": [(0.0, 500 * mb), (1.0, 560 * mb), (3.0, 560 * mb)]}  # rose once, then flat
    report = judge(Sample({0: _ev(0)}, 1, True, at=0.0), Sample({0: _ev(0, memory=warmup)}, 1, True, at=3.0), cmd)
    assert report.status == "healthy", report.verdicts[0].summary

    # A SIGKILLed rank: the OOM killer is said only where the kernel log names it.
    why = "rank 1 is dead: killed by signal 9"
    for oom, said in (({}, False), ({"kernel_log": "Out of memory: Killed process 101 (python)"}, True)):
        ranks = {0: _ev(0), 1: _ev(1, "dead", {"oom": oom}, why)}
        report = judge(Sample(dict(ranks), 2, at=0.0), Sample(dict(ranks), 2, at=1.0), cmd)
        dead = report.verdicts[0]
        assert dead.kind == "dead" and ("OOM killer" in dead.summary) == said, dead.summary


def test_memorys_split_names_pythons_share_where_tracemalloc_counts_it(target_factory):
    """Python's share of RSS is known where the job runs with PYTHONTRACEMALLOC=1 (process.info's
    python_traced_bytes, read by the agent from the interpreter); without it the column is NULL and the split
    says how to get it. The rule subtracts it from "the rest"."""
    from procs import run_cli

    traced = target_factory("idle.py", env=target_env(PYTHONTRACEMALLOC="1"))
    plain = target_factory("idle.py")
    sql = "SELECT python_traced_bytes AS py FROM process.info"
    values = [json.loads(run_cli(str(p.pid), "query", sql, "-f", "json").out)[0]["py"] for p in (traced, plain)]
    assert isinstance(values[0], int) and values[0] > 100_000 and values[1] is None, values

    from probe.diagnose.evidence import Sample
    from probe.diagnose.rules import judge

    mb = 1024 * 1024
    split = [{"device": "cpu", "allocated_bytes": 100 * mb, "rss_bytes": 600 * mb, "tensors": 10, "complete": True}]
    for python, said in (([{"python_traced_bytes": 200 * mb}], "Python's allocators 200 MB (tracemalloc); the rest 300 MB"),
                         (None, "Python objects are counted where the job runs with PYTHONTRACEMALLOC=1")):
        memory = {"readings": [(0.0, 500 * mb), (1.0, 530 * mb), (3.0, 590 * mb)], "split": split, "python": python,
                  "tensors": [(1.0, 30 * mb, 530 * mb), (3.0, 85 * mb, 590 * mb)]}
        report = judge(Sample({0: _ev(0)}, 1, True, at=0.0), Sample({0: _ev(0, memory=memory)}, 1, True, at=3.0),
                       lambda ranks, rest: "probe T %s" % rest)
        where = next(e.text for e in report.verdicts[0].evidence if e.text.startswith("where it is"))
        assert said in where, where
