"""Hangs across two process groups (real torchrun jobs, gloo on CPU, the Flight Recorder on): a rank that
waits in one group's collective is no culprit of another group's hang. Where each rank waits for one that
waits elsewhere (the groups' collectives issued in different orders) the verdict is a deadlock naming
every rank in it, not a hang blaming one of them; where one rank is outside every collective, it alone is
blamed and the others are the waiting ones."""

import json

from procs import run_cli
from test_cluster import torchrun_job
from test_node_helper import _until


def _diagnosed(master: str, kind: str):
    """diagnose --json until its first verdict is of ``kind`` (the ranks reach their hang a moment apart, and
    a hang is called one only after a few seconds), bounded; the last answer otherwise."""
    seen = {}

    def look():
        out = run_cli(master, "diagnose", "--json", timeout=120)
        seen["last"] = out
        report = json.loads(out.out) if out.out.strip().startswith("{") else {}
        verdicts = report.get("verdicts") or [{}]
        return report if verdicts[0].get("kind") == kind else None

    try:
        return _until(look, 90, "a %s verdict" % kind)
    except AssertionError:
        raise AssertionError((seen["last"].out, seen["last"].err)) from None


def test_each_rank_waiting_in_a_collective_of_another_group_is_a_deadlock_across_groups():
    with torchrun_job("dist_group_order.py", 2, timeout=120, GROUP_HANG="cycle", TORCH_FR_BUFFER_SIZE="2000") as (port, _):
        master = "127.0.0.1:%d" % port
        report = _diagnosed(master, "collective_deadlock")
        text = run_cli(master, "diagnose", timeout=120)
    verdict = report["verdicts"][0]
    assert report["exit_code"] == 11 and verdict["status"] == "stuck", report
    assert verdict["culprits"] == [0, 1] and verdict["victims"] == [], verdict
    assert "rank 0 waits in group 0" in verdict["summary"] and "barrier" in verdict["summary"], verdict["summary"]
    assert "rank 1 waits in group 1" in verdict["summary"] and "all_reduce" in verdict["summary"], verdict["summary"]
    assert "different orders" in verdict["summary"], verdict["summary"]
    said = json.dumps(verdict["evidence"])
    assert "rank 0, a member, issued none of its collectives" in said, said
    assert "wait_for_everyone" in said and "subgroup_step" in said, said
    assert text.code == 11 and text.out.startswith("STUCK: collective deadlock across process groups"), text.out
    assert "not to blame" not in text.out.split("\n\n")[0], text.out


def test_a_rank_outside_every_collective_is_the_culprit_and_one_waiting_in_a_subgroup_is_not():
    with torchrun_job("dist_group_order.py", 3, timeout=150, GROUP_HANG="root", TORCH_FR_BUFFER_SIZE="2000") as (port, _):
        master = "127.0.0.1:%d" % port
        report = _diagnosed(master, "collective_hang")
    verdict = report["verdicts"][0]
    assert verdict["culprits"] == [2] and verdict["victims"] == [0, 1], verdict
    assert verdict["where"]["func"] == "load_slowly", verdict["where"]
    assert "rank 2 did not issue gloo:barrier" in verdict["summary"], verdict["summary"]
    said = json.dumps(verdict["evidence"])
    assert "rank 1 waits in group 1's gloo:all_reduce" in said and "which rank 2 did not issue" in said, said
