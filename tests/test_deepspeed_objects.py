"""A job under DeepSpeed is read through DeepSpeed's own objects (issue 32 item 16): its optimizer is the
engine's (named ``engine.optimizer``, not found through a scheduler), its scheduler (WarmupDecayLR, not
one of torch's) drives it, so that ``--all-ranks lr`` scales what the scheduler computes lr from and
the change outlives its next steps; and ``checkpoint`` saves ZeRO's own optimizer state, DeepSpeed's
scheduler and the engine's step, refusing a format that has no place for ZeRO's partition."""

import importlib.util
import json
import os
import time

import pytest

from procs import run_cli, scaled
from test_cluster import needs_torchrun, torchrun_job

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed is not installed")


def _rows(target: str) -> list:
    done = run_cli(target, "query", "SELECT optimizer, lr, scheduler, scheduler_class, scheduler_base_lr, "
                   "scheduler_step FROM torch.optimizers", "--json", timeout=120)
    assert done.code == 0, (done.out, done.err)
    return json.loads(done.out)


@needs_torchrun
@needs_deepspeed
def test_deepspeed_engine_optimizer_scheduler_lr_and_checkpoint(tmp_path):
    with torchrun_job("deepspeed_train.py", 2, timeout=scaled(240)) as (port, pids):
        rows = _rows(str(pids[0]))
        assert len(rows) == 1, rows
        assert rows[0]["optimizer"] == "engine.optimizer", rows
        assert rows[0]["scheduler"] == "engine.lr_scheduler", rows
        assert rows[0]["scheduler_class"] == "deepspeed.runtime.lr_schedules.WarmupDecayLR", rows
        assert rows[0]["scheduler_base_lr"] == pytest.approx(0.01) and rows[0]["scheduler_step"] > 0, rows

        master = "127.0.0.1:%d" % port
        every = run_cli(master, "--all-ranks", "lr", "0.05", "--json", timeout=scaled(180))
        assert every.code == 0, (every.out, every.err)
        done = [json.loads(line) for line in every.out.splitlines()]
        assert sorted(d["rank"] for d in done) == [0, 1] and all(d["readback"]["stuck"] for d in done), every.out
        # Held over many of the scheduler's own steps (it computes lr from max_lrs, min_lrs and delta_lrs,
        # all scaled): the decay over a million steps moves it by parts in a million, not back to 0.01.
        first = max(_rows(str(pid))[0]["scheduler_step"] for pid in pids.values())
        deadline = time.monotonic() + scaled(60)
        while time.monotonic() < deadline:
            later = [_rows(str(pid))[0] for pid in pids.values()]
            if min(r["scheduler_step"] for r in later) >= first + 20:
                break
        assert min(r["scheduler_step"] for r in later) >= first + 20, later
        assert all(r["lr"] == pytest.approx(0.05, rel=1e-3) for r in later), later
        assert all(r["scheduler_base_lr"] == pytest.approx(0.05, rel=1e-3) for r in later), later

        path = str(tmp_path / "ds.pt")
        saved = run_cli(str(pids[1]), "checkpoint", path, "--json", timeout=scaled(120))
        assert saved.code == 0, (saved.out, saved.err)
        import torch

        state = torch.load(path, weights_only=True)
        zero = state["optimizers"]["engine.optimizer"]
        assert "single_partition_of_fp32_groups" in zero and "base_optimizer_state" in zero, sorted(zero)
        assert state["schedulers"]["engine.lr_scheduler"]["last_batch_iteration"] > 0, state["schedulers"]
        facts = state["deepspeed"]["engine"]
        assert facts["zero_stage"] == 1 and facts["world_size"] == 2, facts
        assert state["step"] == facts["global_steps"] and state["step_source"] == "engine.global_steps", state["step"]

        hf = run_cli(str(pids[1]), "checkpoint", str(tmp_path / "hf"), "--format", "hf", timeout=scaled(120))
        assert hf.code == 2 and "ZeRO" in hf.err, (hf.code, hf.out, hf.err)
        assert not os.path.exists(str(tmp_path / "hf")), os.listdir(str(tmp_path))
