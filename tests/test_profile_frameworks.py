"""``probe ... profile`` under the training frameworks and their launchers (issue 37 item 1): a Hugging Face
Trainer on two ranks under ``accelerate launch``, a Lightning module on two ranks under Lightning's own ddp
launch, and a DeepSpeed engine (ZeRO 1) on two ranks under the ``deepspeed`` launcher. Each is profiled
for 2 steps through the job's address alone: one trace holds both ranks' events, each captured step
holds exactly one optimizer step of each rank (its end is where a capture starts and stops: the
Trainer's wrapped AdamW, Lightning's, the engine's inner Adam), and ``torch.profile`` answers across
ranks with those two steps. A job with a rank that cannot run (stopped) is refused as a whole, in
words, before any rank's steps are changed."""

import json
import os
import signal
import sys

import pytest

import launch
from procs import TARGETS, run_cli, scaled
from profile_trace import profiled_events

pytest.importorskip("torch")

STEPS = 2


def _optimizer_steps(events: list, rank: int) -> list:
    """For each ``ProfilerStep#k`` of ``rank`` (in order): the optimizer steps begun inside it. (Each window
    ends inside the optimizer's step wrapper, where its post-step hook runs: the step's event ends after it.)"""
    mine = [e for e in events if e.get("pid") == rank and e.get("ph") == "X"]
    windows = sorted((e for e in mine if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
    steps = [e for e in mine if e["name"].startswith("Optimizer.step#")]
    return [[e["name"] for e in steps if w["ts"] <= e["ts"] < w["ts"] + w["dur"]]
            for w in windows]


def _after_the_step(events: list, rank: int, op: str) -> list:
    """For each ``ProfilerStep#k`` of ``rank``: whether ``op`` ran in it, every time after its optimizer step
    began (ZeRO gathers the updated weights after the optimizer's step, within the engine's)."""
    mine = [e for e in events if e.get("pid") == rank and e.get("ph") == "X"]
    windows = sorted((e for e in mine if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
    out = []
    for w in windows:
        inside = [e for e in mine if w["ts"] <= e["ts"] < w["ts"] + w["dur"]]
        stepped = min(e["ts"] for e in inside if e["name"].startswith("Optimizer.step#"))
        ran = [e["ts"] for e in inside if e["name"] == op]
        out.append(bool(ran) and min(ran) > stepped)
    return out


def _profiled(address: str, out: str, optimizer: str, after: str = "") -> None:
    """``profile --steps 2`` of both ranks, then the checks every framework shares; ``after``: an op each
    captured step runs after its optimizer step."""
    events = profiled_events(address, out, STEPS, timeout=180)
    for rank in (0, 1):
        assert any(e.get("pid") == rank and e["name"].startswith("aten::") for e in events if e.get("ph") == "X"), rank
        # Started right after one optimizer step and stopped right after another: one in each window.
        assert _optimizer_steps(events, rank) == [["Optimizer.step#%s.step" % optimizer]] * STEPS, \
            (rank, _optimizer_steps(events, rank))
        if after:
            assert _after_the_step(events, rank, after) == [True] * STEPS, (rank, after)
    # The first query of a rank starts its SQL worker: seconds on a loaded box, past the default 10 s deadline.
    table = run_cli(address, "--all-ranks", "--deadline", "%.0f" % scaled(60), "query",
                    "SELECT rank, COUNT(DISTINCT step) AS steps, MIN(step) AS first, MAX(step) AS last, "
                    "SUM(calls) AS calls FROM torch.profile GROUP BY rank", "--json", timeout=scaled(90))
    assert table.code == 0, (table.out, table.err)
    rows = json.loads(table.out)
    assert [r["rank"] for r in rows] == [0, 1], rows
    assert all(r["steps"] == STEPS and r["last"] - r["first"] == STEPS - 1 and int(r["calls"]) > 0 for r in rows), rows


def _refused_while_stopped(address: str, pid: int, out: str) -> None:
    """Rank 1 stopped: the command names it and why, and starts no capture on rank 0 (whose steps would
    wait for rank 1 in their collectives)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        refused = run_cli(address, "profile", "--steps", "1", "-o", out, "--timeout", str(scaled(60)),
                          timeout=scaled(120))
    finally:
        os.kill(pid, signal.SIGCONT)
    assert refused.code == 5, (refused.code, refused.out, refused.err)
    assert "rank 1" in refused.err and "stopped" in refused.err and "--ranks" in refused.err, refused.err
    assert not os.path.exists(out)
    status = run_cli(address, "--all-ranks", "query", "SELECT 1 AS one", "--json", timeout=scaled(60))
    assert status.code == 0, status.err  # rank 1 runs again, rank 0 was left as it was


def test_profile_hf_trainer_on_two_ranks_under_accelerate_launch(tmp_path):
    pytest.importorskip("transformers")
    if launch.installed("accelerate", "accelerate"):
        pytest.skip(launch.installed("accelerate", "accelerate"))
    argv = [launch.tool("accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(launch.free_ports(1)),
            "--monitor_interval", "60", os.path.join(TARGETS, "hf_trainer.py"), str(tmp_path / "run.log"),
            "--max-steps", "100000", "--sleep", "0.05"]
    with launch._job("accelerate launch hf_trainer.py", argv, 2, 120, {}) as job:
        _profiled(job.address, str(tmp_path / "hf.json"), "AdamW")


def test_profile_lightning_on_two_ranks_under_its_ddp_launch_and_a_stopped_rank_refused(tmp_path):
    pytest.importorskip("lightning")
    argv = [sys.executable, os.path.join(TARGETS, "lightning_train.py"), str(tmp_path / "run.log"), "--ddp",
            "--max-steps", "100000", "--sleep", "0.05"]
    with launch._job("lightning ddp lightning_train.py", argv, 2, 120, {}) as job:
        _profiled(job.address, str(tmp_path / "lightning.json"), "AdamW")
        _refused_while_stopped(job.address, job.ranks[1], str(tmp_path / "no.json"))


def test_profile_deepspeed_zero1_on_two_ranks_under_the_deepspeed_launcher(tmp_path):
    if launch.installed("deepspeed", "deepspeed"):
        pytest.skip(launch.installed("deepspeed", "deepspeed"))
    argv = [launch.tool("deepspeed"), "--num_gpus", "2", "--master_port", str(launch.free_ports(1)),
            os.path.join(TARGETS, "deepspeed_train.py")]
    with launch._job("deepspeed deepspeed_train.py", argv, 2, 240, {}) as job:
        # The engine's step ends after its optimizer's (ZeRO gathers the weights): the capture's boundary.
        _profiled(job.address, str(tmp_path / "ds.json"), "AdamW", after="c10d::_allgather_base_")
