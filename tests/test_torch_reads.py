"""torch tables that must say what happened (issue 19, item 6), on real CPU processes: a torch.optimizers
read never straddles a step; a NaN that came with the batch is the batch's; a Flight Recorder entry of a
gloo job says whether it finished."""

import json
import os
import time

import pytest

import probe
from procs import run_cli, running, scaled, target_env

pytest.importorskip("torch")

from torch_job import TORCHRUN, torchrun_job  # noqa: E402


def test_an_optimizer_read_never_straddles_a_step():
    """64 param groups and a loop that steps as fast as it can: read alongside the loop, some groups came
    from one step and the others from the next (steps 516/515 in one read)."""
    with running("many_groups.py", timeout=scaled(60)) as proc:
        client = probe.connect(str(proc.pid))
        mixed = []
        deadline = time.monotonic() + scaled(20)
        reads = 0
        while reads < 40 and time.monotonic() < deadline:
            # Each read waits for a moment between two steps; under load that has taken over the 10 s default.
            steps = [r[0] for r in client.query_rows("SELECT step FROM torch.optimizers", timeout=60).rows]
            assert len(steps) == 64, steps
            if len(set(steps)) != 1:
                mixed.append(sorted(set(steps)))
            reads += 1
        assert reads >= 10
        assert not mixed, "%d reads of %d held groups of different steps: %s" % (len(mixed), reads, mixed[:3])


def test_a_nan_that_came_with_the_batch_is_blamed_on_the_batch_and_a_dict_loss_is_read():
    """The batch of step 3 holds a NaN: it was blamed on the first module (whose output is the first to
    show it), and the loss of a model that returns it in a dict (as Hugging Face's ModelOutput) was NULL."""
    env = target_env(PROBE_TORCH_TRACE="1", PROBE_TORCH_TRACE_ANOMALIES="1")
    with running("nan_batch.py", env=env, timeout=scaled(60)) as proc:
        done = run_cli(str(proc.pid), "query", "SELECT step, module, stage, kind, loss FROM torch.anomalies "
                                               "ORDER BY step, seq", "--json")
        assert done.code == 0, done.err
        rows = json.loads(done.out)
        assert rows and rows[0]["step"] == 3 and rows[0]["stage"] == "input", rows
        assert rows[0]["module"] == "Net" and rows[0]["kind"] == "nan", rows
        assert not [r for r in rows if r["step"] == 3 and r["stage"] != "input"], rows  # no module blamed
        assert ("body.0", "forward") in {(r["module"], r["stage"]) for r in rows if r["step"] == 4}, rows  # its
        # weights turned NaN in step 3's update: from step 4 the first layer makes NaN of a clean batch
        assert isinstance(rows[0]["loss"], float) and rows[0]["loss"] >= 1.0, rows


@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun (torch) is not installed")
def test_a_gloo_flight_recorder_entry_says_whether_it_finished():
    """Rank 1 skips the 4th all_reduce, so rank 0 waits in it. Gloo gives the recorder no events: every
    entry read 'scheduled' with NULL times, the three that finished too; retired tells them apart."""
    with torchrun_job("dist_hang.py", HANG_SKIP_RANK="1", TORCH_FR_BUFFER_SIZE="64") as ranks:
        sql = ("SELECT collective_seq_id AS seq, op, state, retired FROM torch.flight_recorder "
               "WHERE op = 'gloo:all_reduce' ORDER BY seq")
        deadline = time.monotonic() + scaled(20)
        while True:
            done = run_cli(str(ranks[0]), "query", sql, "--json")
            assert done.code == 0, done.err
            rows = json.loads(done.out)
            if len(rows) >= 4 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert [(r["state"], r["retired"]) for r in rows] == [("completed", True)] * 3 + [("scheduled", False)], rows
