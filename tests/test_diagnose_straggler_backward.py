"""``probe diagnose`` names a straggler slow inside its own backward pass under DDP (issue 32: "a straggler slow
inside backward under DDP is not told apart"): a 2-rank gloo job under torchrun (tests/targets/dist_slow_backward.py)
whose slow rank runs Python inside its backward (an autograd Function's backward, or a module's full backward
hook) for ~0.3 s a step. DDP's gradient all_reduce is inside every rank's backward, so the steps are equally
long and every rank's main thread is in a backward pass: before, healthy. Now the slow rank is told by its own
code running inside the autograd engine, where the rank that waits has the engine's frame innermost (exit 10),
and the function the extra time goes to is named."""

import json
import time

import pytest

from procs import run_cli, scaled
from test_cluster import needs_torchrun, torchrun_job
from test_diagnose import DEGRADED, _expect


@needs_torchrun
@pytest.mark.parametrize("how,slow,caller", [("function", 1, "GradientNoise.backward"), ("hook", 0, "on_head_grad")])
def test_a_rank_slow_inside_its_backward_under_ddp_is_the_straggler(how, slow, caller):
    waiting = 1 - slow
    with torchrun_job("dist_slow_backward.py", 2, timeout=scaled(180), SLOW_RANK=str(slow), SLOW_HOW=how) as (port, _):
        master = "127.0.0.1:%d" % port
        result = _expect(master, DEGRADED, "straggler: rank %d holds up rank %d" % (slow, waiting),
                         "its own code run inside its backward pass", "mostly audit_rows (dist_slow_backward.py:",
                         "rank %d waited in the backward pass" % waiting)
        assert result.out.splitlines()[0].startswith("DEGRADED: straggler: rank %d" % slow), result.out
        assert "where: audit_rows" in result.out.split("evidence:")[0], result.out
        assert caller in result.out, result.out
        deadline = time.monotonic() + scaled(60)  # one look may fall on a step's other phases: look again
        while True:
            report = json.loads(run_cli(master, "diagnose", "--json", timeout=scaled(90)).out)
            verdict = next((v for v in report["verdicts"] if v["kind"] == "straggler"), report)
            if verdict.get("culprits") == [slow] or time.monotonic() > deadline:
                break
        assert (verdict.get("culprits"), verdict.get("victims")) == ([slow], [waiting]), verdict
