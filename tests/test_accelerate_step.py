"""accelerate keeps no global step: `Accelerator.step` counts micro-batches towards the next sync and goes back to 0
at each epoch's end. torch.trainer and a checkpoint must give the optimizer steps really taken (a resume from 0
would redo the whole run), from the optimizers accelerate prepared."""

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
