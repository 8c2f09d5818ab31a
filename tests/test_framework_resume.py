"""Checkpoints that frameworks resume from. accelerate keeps no global step (`Accelerator.step` counts micro-batches
towards the next sync and goes back to 0 at each epoch's end): torch.trainer and a checkpoint give the optimizer
steps really taken (a resume from 0 would redo the whole run). And `-F hf` of a hand-written loop with no LR
scheduler gives a directory transformers' Trainer resumes from."""

import json

import pytest

from procs import run_cli


def _taken(log) -> int:
    return int(log.read_text().split()[-1])


def test_an_accelerate_loop_s_step_is_the_optimizer_steps_taken_not_the_accumulation_counter(target_factory, tmp_path):
    pytest.importorskip("accelerate")
    log = tmp_path / "steps.log"
    proc = target_factory("accelerate_loop.py", str(log), timeout=120)
    before = _taken(log)
    rows = run_cli(str(proc.pid), "query", "SELECT kind, global_step, grad_accumulation FROM torch.trainer", "--json")
    after = _taken(log)
    assert rows.code == 0, rows.err
    [row] = json.loads(rows.out)
    assert row["kind"] == "accelerate" and row["grad_accumulation"] == 2, row
    assert before >= 6 and before <= row["global_step"] <= after + 1, (before, row, after)

    before = _taken(log)
    saved = run_cli(str(proc.pid), "checkpoint", str(tmp_path / "ck.pt"), "--json", timeout=120)
    after = _taken(log)
    assert saved.code == 0, saved.err
    done = json.loads(saved.out)
    assert before <= done["step"] <= after + 1, (before, done["step"], after)
    assert "accelerator._optimizers[0] state step" in done["step_source"], done["step_source"]


def test_format_hf_of_a_loop_without_a_scheduler_resumes_under_the_trainer(target_factory, tmp_path):
    """transformers resumes optimizer.pt only beside a scheduler.pt: a job with a constant lr (no scheduler) gets
    a constant schedule's state, and the Trainer's own resume runs on from the saved step."""
    pytest.importorskip("transformers")
    from procs import spawn
    from test_frameworks import _log

    proc = target_factory("gpt_plain_loop.py", timeout=120)
    directory = tmp_path / "hf-ck"
    saved = run_cli(str(proc.pid), "checkpoint", str(directory), "-F", "hf", timeout=120)
    assert saved.code == 0, (saved.out, saved.err)
    assert "none in the job: scheduler.pt holds a constant schedule" in saved.out, saved.out
    step = int(saved.out.split("  step        ")[1].split()[0])
    assert step >= 4 and (directory / "scheduler.pt").exists() and (directory / "optimizer.pt").exists()
    log = tmp_path / "resumed.log"
    resumed = spawn("hf_trainer.py", [str(log), "--max-steps", str(step + 3), "--sleep", "0", "--resume",
                                      str(directory), "--ready-at", str(step + 3)], probe=False, timeout=120)
    try:
        assert resumed.popen.wait(120) == 0
    finally:
        resumed.kill()
    assert sorted(_log(str(log))) == [step + 1, step + 2, step + 3], _log(str(log))
