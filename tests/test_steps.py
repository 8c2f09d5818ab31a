"""``torch.steps``: optimizer steps counted by the agent's post-step hook, without the trace."""

import json
import time

from procs import run_cli


def _steps(pid):
    result = run_cli(str(pid), "query", "--json", "SELECT * FROM torch.steps")
    assert result.code == 0, (result.code, result.out, result.err)
    return json.loads(result.out)


def test_a_plain_loop_has_its_steps_counted_without_the_trace(target_factory):
    proc = target_factory("train.py")  # PROBE=1, no trace: Adam stepping every few ms
    first = _steps(proc.pid)
    time.sleep(0.5)
    second = _steps(proc.pid)
    assert len(first) == 1 and len(second) == 1, second
    a, b = first[0], second[0]
    assert b["class"] == "torch.optim.adam.Adam" and b["optimizer_id"].startswith("Adam@0x") and b["alive"], b
    assert a["optimizer_id"] == b["optimizer_id"] and b["steps"] > a["steps"] >= 5, (a, b)  # from its first steps
    assert 0 <= b["last_step_age_s"] < 0.5 and 0 < b["step_time_median_s"] < 0.5, b
    assert b["step_time_min_s"] <= b["step_time_median_s"] <= b["step_time_max_s"], b
    assert 1 <= b["step_times"] <= 64 and b["counted_for_s"] > b["last_step_age_s"], b


def test_torch_steps_joins_torch_optimizers_on_the_optimizer_name(target_factory):
    proc = target_factory("train.py", "--optim", "sgd", "--watch")  # registered as opt
    result = run_cli(str(proc.pid), "query", "--json", "SELECT s.optimizer, s.steps, o.class, o.lr FROM torch.steps s "
                     "JOIN torch.optimizers o ON o.optimizer = s.optimizer")
    assert result.code == 0, (result.code, result.out, result.err)
    rows = json.loads(result.out)
    assert len(rows) == 1 and rows[0]["optimizer"] == "opt" and rows[0]["steps"] > 0, rows
    assert rows[0]["class"] == "torch.optim.sgd.SGD" and rows[0]["lr"] == 0.01, rows

    plain = target_factory("train.py")  # found in __main__, not registered: the same name in both tables
    names = json.loads(run_cli(str(plain.pid), "query", "--json", "SELECT (SELECT list(optimizer) FROM torch.steps) "
                               "AS steps, (SELECT list(DISTINCT optimizer) FROM torch.optimizers) AS found").out)[0]
    assert names["steps"] == names["found"] and not names["steps"][0].startswith("Adam@"), names


def test_a_process_without_torch_says_so(target_factory):
    proc = target_factory("train.py", "--no-torch")
    result = run_cli(str(proc.pid), "query", "SELECT * FROM torch.steps")
    assert result.code != 0 and "torch is not loaded" in result.err, (result.code, result.out, result.err)
