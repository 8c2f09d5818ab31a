"""`probe T lr` on a multi-rank job: refused where it would reach only some ranks (the replicas would drift apart
silently), done on every rank with --all-ranks, and on one rank where the user says --this-rank-only."""

import json

import pytest

from procs import run_cli
from test_cluster import needs_torchrun, torchrun_job


def _lr_of(target: str) -> float:
    done = run_cli(target, "query", "SELECT lr FROM torch.optimizers", "--json")
    assert done.code == 0, (done.out, done.err)
    return json.loads(done.out)[0]["lr"]


@needs_torchrun
def test_lr_on_some_ranks_of_a_ddp_job_is_refused_and_all_ranks_changes_every_rank():
    pytest.importorskip("torch")
    with torchrun_job("ddp_schedule.py", 2) as (port, pids):
        master = "127.0.0.1:%d" % port
        for target in ([master], [master, "--ranks", "1"], [str(pids[1])]):
            refused = run_cli(*target, "lr", "0.05")
            assert refused.code == 2, (target, refused.out, refused.err)
            assert "of a job of 2 ranks" in refused.err and "--all-ranks lr" in refused.err, refused.err
            assert "drift apart" in refused.err, refused.err
        assert _lr_of(str(pids[0])) == pytest.approx(0.02) and _lr_of(str(pids[1])) == pytest.approx(0.02)

        alone = run_cli(str(pids[1]), "lr", "0.03", "--this-rank-only", "--json", timeout=120)
        assert alone.code == 0, (alone.out, alone.err)
        assert _lr_of(str(pids[1])) == pytest.approx(0.03) and _lr_of(str(pids[0])) == pytest.approx(0.02)

        every = run_cli(master, "--all-ranks", "lr", "0.05", "--json", timeout=180)
        assert every.code == 0, (every.out, every.err)
        done = [json.loads(line) for line in every.out.splitlines()]
        assert sorted(d["rank"] for d in done) == [0, 1], every.out
        assert all(d["readback"]["stuck"] for d in done), every.out
        assert _lr_of(str(pids[0])) == pytest.approx(0.05) and _lr_of(str(pids[1])) == pytest.approx(0.05)
