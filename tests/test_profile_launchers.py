"""``probe ... profile`` under every launcher probe supports (issue 37 item 1): torchrun has
tests/test_profile.py; ``accelerate launch``, ``deepspeed`` and Lightning's ``ddp`` launch have
tests/test_profile_frameworks.py (a real Trainer, Lightning module and DeepSpeed engine under each); here
the others: Lightning's ``ddp_spawn``, ``torch.multiprocessing.spawn``, Open MPI's ``mpirun`` and Slurm's
``srun``. Each starts a real 2-rank job of ``tests/targets/launchers/ranks.py`` with ``TRAIN=1`` (a small
model, its gradients summed by gloo's all_reduce, an optimizer step) under ``PROBE=1 PROBE_PORT=P``, and asks
it through nothing but its address, as a user would: ``profile --steps 2 -o FILE`` writes one trace holding
both ranks' steps, and ``torch.profile`` answers across ranks with those steps, each row under its own rank.

Under mpirun the ranks set up no process group (``TRAIN=alone``: each steps on its own, as a program whose
ranks talk through MPI itself): their rank is still mpirun's; and rank 1 imports a module in each step while
profiled that keeps the GIL 1.5 s (a lazy import on a loaded machine): it is asked again, not dropped.
Under srun also as ``slurm:JOBID``. Under mp.spawn a rank stopped (SIGSTOP) is refused in words at once,
before any capture starts. A launcher missing here is skipped with why."""

import importlib.util
import json
import os
import signal
from typing import Dict, Optional

import pytest

import launch
from procs import run_cli, scaled, target_env
from profile_trace import profiled_events
from test_slurm import slurm  # noqa: F401  (the one-node Slurm fixture, shared)

STEPS = 2


def _why_not_torch() -> str:
    """Looked up, not imported (seconds in the test's process)."""
    return "" if importlib.util.find_spec("torch") is not None else "torch is not installed"


def _lightning() -> str:
    return launch.installed("python", "lightning.pytorch") or _why_not_torch()


# name -> (how its 2-rank job starts, why it cannot run here: "" when it can[, TRAIN])
LAUNCHERS: Dict[str, tuple] = {
    "lightning-ddp_spawn": (lambda **env: launch.lightning_job("ddp_spawn", 2, 90, **env), _lightning),
    "mp.spawn": (lambda **env: launch.mp_spawn_job(2, 60, **env), _why_not_torch),
    "mpirun": (lambda **env: launch.mpirun_job(2, 60, SLOW_IMPORT_RANK="1", **env),
               lambda: launch.installed("mpirun") or _why_not_torch(), "alone"),
}


def _profiled(address: str, out: str, collective: bool = True, env: Optional[Dict[str, str]] = None) -> None:
    """``profile --steps 2 -o FILE`` of the job: both ranks in one trace, each with its 2 steps of ops (and
    the all_reduce of ``collective``), and ``torch.profile`` of both ranks with those 2 steps."""
    events = profiled_events(address, out, STEPS, env=env)
    for rank in (0, 1):
        ops = [e for e in events if e.get("pid") == rank and e.get("ph") == "X"]
        assert sum(1 for e in ops if e["name"].startswith("ProfilerStep#")) == STEPS, rank
        assert any(e["name"].startswith("aten::") for e in ops), rank
        assert any("all_reduce" in e["name"] for e in ops) == collective, (rank, sorted({e["name"] for e in ops}))
    # The first query of a rank starts its SQL worker: seconds on a loaded box, past the default 10 s deadline.
    table = run_cli(address, "--all-ranks", "--deadline", "%.0f" % scaled(60), "query",
                    "SELECT rank, COUNT(DISTINCT step) AS steps, MIN(step) AS first, MAX(step) AS last, "
                    "SUM(calls) AS calls FROM torch.profile GROUP BY rank ORDER BY rank", "--json", timeout=scaled(90),
                    env=env)
    assert table.code == 0, (table.out, table.err)
    rows = json.loads(table.out)
    assert [r["rank"] for r in rows] == [0, 1] and not any("table_rank" in r for r in rows), rows  # the same rank
    assert all(r["steps"] == STEPS and r["last"] - r["first"] == STEPS - 1 and int(r["calls"]) > 0 for r in rows), rows


def _refused_while_stopped(address: str, pid: int, out: str) -> None:
    """Rank 1 stopped: named with why at once (not after --timeout), and no capture starts on rank 0."""
    os.kill(pid, signal.SIGSTOP)
    try:
        refused = run_cli(address, "profile", "--steps", "1", "-o", out, "--timeout", "600", timeout=scaled(60))
    finally:
        os.kill(pid, signal.SIGCONT)
    assert refused.code == 5, (refused.code, refused.out, refused.err)
    assert "rank 1" in refused.err and "stopped" in refused.err and "--ranks" in refused.err, refused.err
    assert "capturing" not in refused.err and not os.path.exists(out), refused.err
    status = run_cli(address, "--all-ranks", "query", "SELECT 1 AS one", "--json",
                     timeout=scaled(60))
    assert status.code == 0, status.err


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_profile_two_ranks_under_the_launcher(name: str, tmp_path) -> None:
    start, missing, *train = LAUNCHERS[name]
    why = missing()
    if why:
        pytest.skip(why)
    with start(TRAIN=train[0] if train else "1") as job:
        _profiled(job.address, str(tmp_path / "trace.json"), collective=not train)
        if name == "mp.spawn":
            _refused_while_stopped(job.address, job.ranks[1], str(tmp_path / "no.json"))


def test_profile_two_ranks_under_srun_by_its_address_and_by_slurm_jobid(slurm, tmp_path) -> None:
    """At the master's address, and as ``slurm:JOBID:PORT`` (every rank of the job, as Slurm names its nodes)."""
    if _why_not_torch():
        pytest.skip(_why_not_torch())
    with launch.srun_job(slurm, 2, 60, TRAIN="1") as job:
        _profiled(job.address, str(tmp_path / "trace.json"))
        assert job.slurm_job, "squeue named no job"
        _profiled("slurm:%s:%d" % (job.slurm_job, job.port), str(tmp_path / "by_slurm.json"),
                  env=slurm.env(target_env(probe=False)))
