"""``probe diagnose`` names NaN in a job's parameters without the opt-in NaN/Inf check (issue 32, item 6): a
2-rank gloo job under torchrun (tests/targets/dist_diverge.py) whose rank 1 scales its loss by infinity; the
all_reduce of the gradients carries NaN to both ranks, and both go on stepping with a NaN loss. Without the
trace or its check, diagnose reads each rank's parameters once (torch.parameters) and names the ranks, the
optimizer step each had reached and a parameter whose value or gradient is not finite (exit 10), where
before the job was called healthy (steps advance)."""

import json
from typing import Any, Dict, Iterator

import pytest

from procs import run_cli
from test_cluster import needs_torchrun, torchrun_job
from test_diagnose import DEGRADED, HEALTHY, _expect


@pytest.fixture(scope="module")
def job(tmp_path_factory: Any) -> Iterator[Dict[str, Any]]:
    control = tmp_path_factory.mktemp("diverge") / "control"
    control.write_text("")
    with torchrun_job("dist_diverge.py", 2, timeout=180, DIVERGE_CONTROL=str(control)) as (port, pids):
        yield {"master": "127.0.0.1:%d" % port, "control": control}


@needs_torchrun
def test_nan_weights_on_every_rank_are_named_without_the_opt_in_check(job):
    master = job["master"]
    healthy = _expect(master, HEALTHY, "healthy: steps advance on ranks 0-1")
    assert "numerical" not in healthy.out and "parameters' NaN/Inf" not in healthy.out, healthy.out
    job["control"].write_text("blowup 1\n")
    result = _expect(master, DEGRADED, "numerical: NaN in the ", "of ranks 0-1 (")
    head = result.out.splitlines()[0]
    assert "found by step " in head and "trace start --anomalies" in head, result.out
    assert any(name in head for name in ("trunk.0.weight", "trunk.0.bias", "out.weight", "out.bias")), result.out
    assert "read once at its optimizer step " in result.out, result.out
    report = json.loads(run_cli(master, "diagnose", "--json", timeout=90).out)
    verdict = next(v for v in report["verdicts"] if v["kind"] == "numerical")
    assert verdict["culprits"] == [0, 1] and report["exit_code"] == DEGRADED, report
    rows = verdict["evidence"][0]["rows"]
    assert rows and all(r["has_nan"] or r["grad_has_nan"] or r["has_inf"] or r["grad_has_inf"] for r in rows), rows
    steps = [e for e in verdict["evidence"] if e["text"].startswith("read at: ")]
    assert steps and "rank 0 at optimizer step " in steps[0]["text"], verdict

