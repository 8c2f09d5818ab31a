"""``probe MASTER:PORT diagnose`` on a 2-rank torchrun job (CPU, gloo) whose training trouble is planted on one
rank: a leak (losses kept with their graphs), a DataLoader worker asleep in ``__getitem__``, a NaN from a poisoned
batch (tests/targets/dist_training.py). One job for the file; the troubles one after another, the NaN last (it
stays). Each names rank 1, and rank 0 is not blamed. Also the memory rule on hand-made readings."""

import json
import os

import pytest

from test_cluster import needs_torchrun, torchrun_job
from test_diagnose import DEGRADED, HEALTHY, STUCK, _diagnose, _expect

MB = 1024 * 1024


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    control = tmp_path_factory.mktemp("dist_training") / "control"
    control.write_text("")
    with torchrun_job("dist_training.py", 2, timeout=180, extra=("--monitor-interval=60",), DIAG_CONTROL=str(control),
                      TORCH_FR_BUFFER_SIZE="0", PROBE_TORCH_TRACE="1", PROBE_TORCH_TRACE_ANOMALIES="1") as (port, pids):
        yield "127.0.0.1:%d" % port, pids, control


def _verdicts(master):
    result = _diagnose(master, "--json")
    return result.code, [(v["kind"], v["culprits"], v["victims"]) for v in json.loads(result.out)["verdicts"]]


@needs_torchrun
def test_a_leak_on_rank_1_is_named_on_rank_1_only(job):
    master, pids, control = job
    _expect(master, HEALTHY, "HEALTHY: healthy: steps advance on ranks 0-1")
    control.write_text("leak 1\n")
    try:
        result = _expect(master, DEGRADED, "memory grows on rank 1", "torch CPU tensors grew with it",
                         "with requires_grad")
        assert "memory grows on rank 0" not in result.out, result.out
        code, verdicts = _verdicts(master)
        growth = [v for v in verdicts if v[0] == "memory_growth"]
        assert code == DEGRADED and growth == [("memory_growth", [1], [])], verdicts
    finally:
        control.write_text("")


@needs_torchrun
def test_a_hung_dataloader_worker_on_rank_1_is_named_first_and_rank_0_is_not_blamed(job):
    master, pids, control = job
    _expect(master, HEALTHY, "HEALTHY: healthy: steps advance on ranks 0-1")
    control.write_text("hang 1\n")
    try:
        result = _expect(master, STUCK, "data loader stall: rank 1's MainThread waits for batch",
                         "which is in Batches.__getitem__ (", "rank 1 waits for its DataLoader worker instead")
        headline = result.out.splitlines()[0]
        assert headline.startswith("STUCK: data loader stall: rank 1's"), result.out  # the cause first
        worker = int(headline.split("DataLoader worker 1 (pid ")[1].split(")")[0])
        with open("/proc/%d/stat" % worker) as handle:
            assert int(handle.read().rsplit(")", 1)[1].split()[1]) == pids[1]  # rank 1's own worker
        assert "waiting (not to blame): rank 0" in result.out
        code, verdicts = _verdicts(master)
        assert code == STUCK and verdicts[:2] == [("loader_stall", [1], []), ("collective_hang", [1], [0])], verdicts
    finally:
        control.write_text("")
    _expect(master, HEALTHY, "HEALTHY: healthy: steps advance on ranks 0-1")


@needs_torchrun
def test_a_nan_from_rank_1s_batch_is_named_on_rank_1_where_rank_0_got_it_later(job):
    master, pids, control = job
    control.write_text("nan 1\n")
    result = _expect(master, DEGRADED, "numerical: NaN first at step", "on rank 1: the batch held NaN",
                     "later on rank 0")
    code, verdicts = _verdicts(master)
    assert code == DEGRADED and ("numerical", [1], []) in verdicts, verdicts
    assert os.path.exists("/proc/%d" % pids[1]) and "torch.anomalies" in result.out


def _ev(readings, tensors=None):
    from probe.client.results import Frame
    from probe.diagnose.evidence import RankEvidence

    frames = [Frame(1, "MainThread", 1, True, 0, "forward", "/job/train.py", 30, "y = f(x)")]
    memory = {"readings": readings}
    if tensors is not None:
        memory["tensors"] = tensors
    return RankEvidence(0, "h", 100, frames=frames, memory=memory,
                        threads=[{"thread_id": 1, "thread_name": "MainThread", "is_main": True, "cpu": 1.0}])


def test_rules_a_short_rise_of_rss_is_growth_only_where_the_tensors_grow_with_it_or_over_a_long_look():
    from probe.diagnose.evidence import Sample
    from probe.diagnose.rules import judge

    def cmd(ranks, rest):
        return "probe T %s" % rest

    def report(readings, tensors=None):
        ev = _ev(readings, tensors)
        return judge(Sample({0: _ev(readings[:1])}, 1, True, at=0.0), Sample({0: ev}, 1, True, at=3.0), cmd)

    # The allocator's churn of a healthy job: +21 MB in 3 s, steady, the live tensors flat: not called a leak.
    rss = [(0.0, 429 * MB), (1.0, 440 * MB), (3.0, 450 * MB)]
    flat = [(1.0, 1 * MB, 440 * MB), (3.0, 1 * MB, 450 * MB)]
    churn = report(rss, flat)
    assert churn.status == "healthy", churn.verdicts[0].summary
    assert any("too short a look" in line and "did not grow with it" in line for line in churn.unavailable)
    assert report(rss).status == "healthy"  # the tensors not read twice: not said either

    # The same rise, the tensors growing with it: a leak, said with the tensors' share.
    grew = report(rss, [(1.0, 20 * MB, 440 * MB), (3.0, 28 * MB, 450 * MB)])
    assert grew.verdicts[0].kind == "memory_growth", grew.verdicts[0].summary
    assert "torch CPU tensors grew with it (+8 MB in 2.0 s)" in grew.verdicts[0].summary

    # Tensors read before these readings (an earlier record's, the watch records again and again): not used.
    stale = report(rss, [(-60.0, 20 * MB, 300 * MB), (-58.0, 28 * MB, 310 * MB)])
    assert stale.status == "healthy", stale.verdicts[0].summary

    # RSS alone, steady over a long look (--watch rounds): growth, said to be elsewhere than in tensors.
    long = [(float(t), (400 + 3 * t) * MB) for t in range(0, 13, 2)]
    steady = report(long, [(0.0, 1 * MB, 400 * MB), (2.0, 1 * MB, 406 * MB)])
    assert steady.verdicts[0].kind == "memory_growth" and "not in torch CPU tensors" in steady.verdicts[0].summary
