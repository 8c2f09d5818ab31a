"""``probe diagnose`` on a mismatched collective (issue 32, item 3): rank 1 of a 2-rank gloo job under torchrun
``broadcast``s a float64 vector of 6 where rank 0 ``all_reduce``s a float32 vector of 3, under the same
collective number (tests/targets/dist_metrics_mismatch.py). Each waits in its own collective: no rank is
behind, none is outside. It is called a mismatch, both ops named, each side's rank and line:

* live, with the Flight Recorder on (its numbers, ops, sizes and dtypes), and from torch's own dumps of the
  same job's recorder (no stacks there);
* live, with the recorder off (from the stacks alone: it says the recorder is off, and only then).
"""

import contextlib
import json
import os
import time
from typing import Any, Dict, Iterator

import pytest

from procs import run_cli, scaled
from test_cluster import needs_torchrun, torchrun_job
from test_diagnose import STUCK, _expect

FUNC = "share_metrics"
SCRIPT = "dist_metrics_mismatch.py"


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: Any) -> Iterator[Dict[str, Any]]:
    base = tmp_path_factory.mktemp("mismatch")
    control_on, control_off = base / "control-on", base / "control-off"
    control_on.write_text("")
    control_off.write_text("")
    dumps = base / "dumps"
    dumps.mkdir()
    with contextlib.ExitStack() as stack:
        on = stack.enter_context(torchrun_job(SCRIPT, 2, timeout=180, MISMATCH_CONTROL=str(control_on),
                                              TORCH_FR_BUFFER_SIZE="2000", TORCH_FR_DUMP_TEMP_FILE=str(dumps / "fr_")))
        off = stack.enter_context(torchrun_job(SCRIPT, 2, timeout=180, MISMATCH_CONTROL=str(control_off),
                                               TORCH_FR_BUFFER_SIZE="0"))
        control_on.write_text("bcast 1\n")
        control_off.write_text("bcast 1\n")
        yield {"on": "127.0.0.1:%d" % on[0], "off": "127.0.0.1:%d" % off[0], "control_on": control_on,
               "dumps": dumps}


def _verdict(target: str) -> Dict[str, Any]:
    report = json.loads(run_cli(target, "diagnose", "--json", timeout=90).out)
    return report["verdicts"][0]


@needs_torchrun
def test_a_mismatch_with_the_flight_recorder_on_names_both_ops_sizes_and_lines_live_and_from_torchs_dumps(jobs):
    result = _expect(jobs["on"], STUCK, "collective mismatch in process group 0 (default_pg) at #")
    head = result.out.splitlines()[0]
    assert "rank 0 gloo:all_reduce" in head and "rank 1 gloo:broadcast" in head, result.out
    assert "each waits in its own" in head and "which side is wrong is not recorded" in head, result.out
    assert "sizes [[3]], dtypes [\"Float\"]" in result.out and "sizes [[6]], dtypes [\"Double\"]" in result.out
    for rank in (0, 1):  # each side's rank and its line in the program
        line = next(l for l in result.out.splitlines() if l.strip().startswith("- rank %d issued " % rank))
        assert "called from %s (" % FUNC in line and SCRIPT in line, result.out
    assert "did not enter" not in result.out and "Flight Recorder is off" not in result.out, result.out
    verdict = _verdict(jobs["on"])
    assert (verdict["kind"], verdict["culprits"], verdict["status"]) == ("collective_mismatch", [0, 1], "stuck")

    # torch's own dumps of this job's recorder (written by a thread: the main threads are stuck)
    jobs["control_on"].write_text("bcast 1\ndump\n")
    deadline = time.monotonic() + scaled(30)
    while sorted(os.listdir(str(jobs["dumps"]))) != ["fr_0", "fr_1"] and time.monotonic() < deadline:
        time.sleep(0.2)
    dumped = run_cli("snapshot:" + str(jobs["dumps"]), "diagnose")
    assert dumped.code == STUCK, (dumped.out, dumped.err)
    head = dumped.out.splitlines()[1]
    assert head.startswith("STUCK: collective mismatch in process group 0 (default_pg) at #"), dumped.out
    assert "rank 0 gloo:all_reduce" in head and "rank 1 gloo:broadcast" in head, dumped.out
    assert "the collective itself hangs" not in dumped.out and '"Double"' in dumped.out, dumped.out


@needs_torchrun
def test_a_mismatch_with_the_flight_recorder_off_is_named_from_the_stacks(jobs):
    result = _expect(jobs["off"], STUCK, "collective mismatch: ")
    head = result.out.splitlines()[0]
    assert "rank 0 in all_reduce" in head and "rank 1 in broadcast" in head, result.out
    for rank, op in ((0, "all_reduce"), (1, "broadcast")):
        line = next(l for l in result.out.splitlines() if l.strip().startswith("- rank %d: in %s at " % (rank, op)))
        assert "called from %s (" % FUNC in line and SCRIPT in line, result.out
    assert "did not enter" not in result.out and "the Flight Recorder: " in result.out, result.out
    verdict = _verdict(jobs["off"])
    assert (verdict["kind"], verdict["culprits"]) == ("collective_mismatch", [0, 1]), verdict



def test_rules_sizes_or_dtypes_that_differ_under_one_op_are_a_mismatch_where_the_op_demands_them_equal():
    """On the recorder's rows alone (3 ranks): the odd rank out is the culprit, the others wait; an earlier
    number that differs is found though later ones agree; all_to_all's uneven inputs are no mismatch."""
    from test_diagnose import _cmd, _in_all_reduce, _rank, _sample

    from probe.diagnose.rules import judge

    def fr(lines, done=False):
        recent = "\n".join("\t".join(map(str, line)) for line in lines)
        last = lines[-1]
        return [{"pg": "0", "pg_desc": "default_pg", "last_seq": last[0], "last_op": last[1], "last_done": done,
                 "last_age": 9.0, "period": 0.05, "recent": recent}]

    ok = (11, "gloo:all_reduce", "[[3]]", '["Float"]')
    odd = (12, "gloo:all_reduce", "[[4]]", '["Float"]')
    even = (12, "gloo:all_reduce", "[[3]]", '["Float"]')
    ranks = [_rank(0, _in_all_reduce(), 1.0, fr([ok, even])), _rank(1, _in_all_reduce(), 1.0, fr([ok, odd])),
             _rank(2, _in_all_reduce(), 1.0, fr([ok, even]))]
    report = judge(_sample(ranks, 0.0), _sample(ranks, 5.0), _cmd)
    verdict = report.verdicts[0]
    assert (verdict.kind, verdict.culprits, verdict.victims, report.status) == ("collective_mismatch", [1], [0, 2],
                                                                                "stuck"), verdict
    assert "at #12: ranks 0,2 gloo:all_reduce (sizes [[3]]" in verdict.summary and "rank 1 gloo:all_reduce (sizes [[4]]" \
        in verdict.summary and "input sizes differ" in verdict.evidence[0].text, verdict.summary

    dtype = (12, "gloo:all_reduce", "[[3]]", '["Double"]')
    later = (13, "gloo:barrier", "[]", "[]")
    ranks = [_rank(0, _in_all_reduce(), 1.0, fr([ok, even, later], True)),
             _rank(1, _in_all_reduce(), 1.0, fr([ok, dtype, later], True))]
    verdict = judge(_sample(ranks, 0.0), _sample(ranks, 5.0), _cmd).verdicts[0]
    assert verdict.kind == "collective_mismatch" and verdict.status == "degraded" and "#12" in verdict.summary
    assert "input dtypes differ" in verdict.evidence[0].text and verdict.culprits == [0, 1], verdict

    for uneven in ([(12, "gloo:all_to_all", "[[3]]", '["Float"]'), (12, "gloo:all_to_all", "[[5]]", '["Float"]')],
                   [(12, "gloo:scatter", "[[2], [2]]", '["Float", "Float"]'), (12, "gloo:scatter", "[]", "[]")]):
        ranks = [_rank(0, _in_all_reduce(), 1.0, fr([ok, uneven[0]], True)),
                 _rank(1, _in_all_reduce(), 1.0, fr([ok, uneven[1]], True))]
        verdicts = judge(_sample(ranks, 0.0), _sample(ranks, 5.0), _cmd).verdicts
        assert all(v.kind != "collective_mismatch" for v in verdicts), uneven
