"""LR schedulers in torch.optimizers, and ``probe TARGET lr`` changing the rate so that it sticks (issue 19,
item 2): a plain loop under LambdaLR and StepLR, a Hugging Face Trainer built in main(); the warning of
an eval that sets lr under a scheduler; the errors."""

import csv
import io
import json
import time
from typing import List, Tuple

import pytest

from procs import run_cli, running, scaled, target_env

pytest.importorskip("torch")


def decay(step: int) -> float:
    return 1.0 / (1.0 + step / 100.0)  # tests/targets/lr_loop.py's LambdaLR


def _rows(pid: int, sql: str) -> List[dict]:
    done = run_cli(str(pid), "query", sql, "-F", "csv")
    assert done.code == 0, done.err
    return list(csv.DictReader(io.StringIO(done.out)))


def _log_after(path: str, step: int, count: int) -> List[Tuple[int, float]]:
    """The first ``count`` (step, lr) lines of the target's log past ``step`` (bounded wait)."""
    deadline = time.monotonic() + scaled(30)
    while True:
        with open(path) as log:
            lines = [(int(a), float(b)) for a, b in (line.split() for line in log.read().splitlines() if " " in line)]
        later = [entry for entry in lines if entry[0] > step]
        if len(later) >= count:
            return later[:count]
        assert time.monotonic() < deadline, "the target logged %d steps past %d" % (len(later), step)
        time.sleep(0.05)


def _last_step(path: str) -> int:
    with open(path) as log:
        return int(log.read().splitlines()[-1].split()[0])


@pytest.fixture(scope="module")
def lambda_loop(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("lr") / "log")
    with running("lr_loop.py", log, "--sched", "lambda") as proc:
        yield proc, log


def test_optimizers_show_the_scheduler(lambda_loop):
    proc, _ = lambda_loop
    [row] = _rows(proc.pid, "SELECT optimizer, group_index, lr, scheduler, scheduler_class, scheduler_base_lr, "
                            "scheduler_step, initial_lr, lr_note FROM torch.optimizers")
    assert (row["optimizer"], row["scheduler"]) == ("optimizer", "scheduler"), row
    assert row["scheduler_class"] == "torch.optim.lr_scheduler.LambdaLR", row
    assert float(row["scheduler_base_lr"]) == 0.01 and float(row["initial_lr"]) == 0.01, row
    assert int(row["scheduler_step"]) >= 5 and "base_lrs" in row["lr_note"] and "probe TARGET lr" in row["lr_note"]


def test_an_eval_that_sets_lr_under_lambdalr_is_warned(lambda_loop):
    proc, _ = lambda_loop
    done = run_cli(str(proc.pid), "eval", "print(optimizer.param_groups[0]['lr'] > 0)")
    assert done.code == 0 and done.out.strip() == "True" and "warning" not in done.err, done
    done = run_cli(str(proc.pid), "eval", "optimizer.param_groups[0]['lr'] = 0.07")
    assert done.code == 0, done.err
    assert "probe: warning: the snippet set lr of optimizer (group 0: " in done.err, done.err
    assert "-> 0.07" in done.err and "LambdaLR" in done.err and "probe TARGET lr 0.07" in done.err, done.err


def test_lr_sticks_through_lambdalr_and_the_schedule_goes_on_from_it(lambda_loop):
    proc, log = lambda_loop
    done = run_cli(str(proc.pid), "lr", "0.05", "--json")
    assert done.code == 0, done.err
    answer = json.loads(done.out)
    [scheduler] = answer["schedulers"]
    assert (scheduler["name"], scheduler["class"], scheduler["kind"]) == (
        "scheduler", "torch.optim.lr_scheduler.LambdaLR", "base"), answer
    [group] = answer["groups"]
    before, after = group["before"], group["after"]
    assert after["lr"] == 0.05 and after["base_lr"] == pytest.approx(before["base_lr"] * 0.05 / before["lr"]), group
    assert after["initial_lr"] == pytest.approx(after["base_lr"]), group
    assert answer["readback"]["stuck"] and answer["readback"]["groups"][0]["verdict"] == "stuck", answer
    base = after["base_lr"]
    # Several steps on, the loop's own log: the schedule goes on from the new base (it would be ~0.005 else)
    for step, lr in _log_after(log, _last_step(log) + 10, 5):
        assert lr == pytest.approx(base * decay(step), rel=1e-9), (step, lr, base)
        assert 0.02 < lr < 0.05
    [row] = _rows(proc.pid, "SELECT scheduler_base_lr, initial_lr FROM torch.optimizers")
    assert float(row["scheduler_base_lr"]) == pytest.approx(base) and float(row["initial_lr"]) == pytest.approx(base)


def test_lr_errors_say_what_to_do(lambda_loop, tmp_path):
    proc, _ = lambda_loop
    done = run_cli(str(proc.pid), "lr", "0.05", "--group", "3")
    assert done.code == 2 and "group 3 is out of range: optimizer has 1 param group (0 to 0)" in done.err, done
    done = run_cli(str(proc.pid), "lr", "0.05", "--optimizer", "nope")
    assert done.code == 2 and "no optimizer named 'nope' (found: optimizer)" in done.err, done
    done = run_cli(str(proc.pid), "lr", "--", "-1")
    assert done.code == 2 and "finite number of 0 or more" in done.err, done

    with running("train.py", "--idle") as idle:  # an optimizer, and no step ever comes
        done = run_cli(str(idle.pid), "lr", "0.05", "--start-within", "1")
        assert done.code == 5, done
        assert "no optimizer step came within 1 s: nothing was changed" in done.err, done.err
        assert [r["lr"] for r in _rows(idle.pid, "SELECT lr FROM torch.optimizers")] == ["0.001"]
    with running("lr_loop.py", str(tmp_path / "log"), env=target_env(PROBE_EVAL="0")) as read_only:
        done = run_cli(str(read_only.pid), "lr", "0.05")
        assert done.code == 4, done
        assert "probe lr changes the target through eval, and the agent refuses it: eval is switched off" in done.err


def test_lr_under_steplr_in_a_function(tmp_path):
    log = str(tmp_path / "log")
    with running("lr_loop.py", log, "--sched", "step", "--in-function") as proc:
        done = run_cli(str(proc.pid), "lr", "0.05")
        assert done.code == 0, done.err
        assert ("scheduler  scheduler (torch.optim.lr_scheduler.StepLR): StepLR goes on from the group's current lr: "
                "a changed lr sticks") in done.out, done.out
        assert "  group 0  lr 0.01 -> 0.05   base_lr 0.01 -> 0.05   initial_lr 0.01 -> 0.05" in done.out, done.out
        assert "it stuck" in done.out, done.out
        assert all(lr == 0.05 for _, lr in _log_after(log, _last_step(log) + 5, 5))
        # StepLR goes on from the group's lr: setting it alone sticks, and no warning is given
        done = run_cli(str(proc.pid), "eval", "--frame", "MainThread:train", "optimizer.param_groups[0]['lr'] = 0.02")
        assert done.code == 0 and "warning" not in done.err, done


def test_lr_sticks_through_a_hugging_face_trainer_built_in_main(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (the test extra has it)")
    log = str(tmp_path / "log")
    with running("hf_lr.py", log, timeout=120) as proc:
        [row] = _rows(proc.pid, "SELECT optimizer, scheduler, scheduler_class, scheduler_base_lr FROM torch.optimizers "
                                "WHERE group_index = 0")
        assert (row["optimizer"], row["scheduler"]) == ("trainer.optimizer", "trainer.lr_scheduler"), row
        assert row["scheduler_class"] == "torch.optim.lr_scheduler.LambdaLR" and float(row["scheduler_base_lr"]) == 1e-3

        done = run_cli(str(proc.pid), "lr", "0.05", "--json")
        assert done.code == 0, done.err
        answer = json.loads(done.out)
        assert [s["name"] for s in answer["schedulers"]] == ["trainer.lr_scheduler"], answer
        assert all(g["after"]["lr"] == 0.05 for g in answer["groups"]) and answer["readback"]["stuck"], answer
        base = answer["groups"][0]["after"]["base_lr"]
        for step, lr in _log_after(log, _last_step(log) + 5, 3):  # linear decay over 100000 steps, from the new base
            assert lr == pytest.approx(base * (100000 - step) / 100000, rel=1e-6), (step, lr, base)
        [row] = _rows(proc.pid, "SELECT scheduler_base_lr FROM torch.optimizers WHERE group_index = 0")
        assert float(row["scheduler_base_lr"]) == pytest.approx(base)

        done = run_cli(str(proc.pid), "eval", "--frame", "MainThread:main",
                       "trainer.optimizer.param_groups[0]['lr'] = 0.07")
        assert done.code == 0 and "probe: warning: the snippet set lr of trainer.optimizer" in done.err, done
