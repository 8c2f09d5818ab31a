"""Where each rank has been (issue 36, item 4): the node helper samples its ranks' stacks every
PROBE_STACK_EVERY seconds, keeps them deduplicated as cluster.stack_history, queried through the job's
address and from the stall record that carries it, and diagnose says since when a stuck rank has been
where it is. A real 2-rank torchrun gloo job on the CPU in which rank 1 waits in its own data loading
(tests/targets/dist_hang.py) while rank 0 waits for it in all_reduce."""

import json
import os
import time

from procs import run_cli, scaled
from test_cluster import needs_torchrun, torchrun_job

PER_RANK = """SELECT rank, count(*) AS samples, count(DISTINCT stack_id) AS stacks, arg_max(source, time) AS source,
  bool_or(frames LIKE '%load_next_batch%') AS in_loader,
  count(*) FILTER (WHERE frames LIKE '%load_next_batch%' OR frames LIKE '%train_step%') AS waiting
  FROM cluster.stack_history WHERE thread = 'MainThread' GROUP BY rank ORDER BY rank"""


def _rows(result) -> list:
    assert result.code == 0, result.out + result.err
    return json.loads(result.out)


def _until(check, timeout: float, what: str):
    deadline = time.monotonic() + scaled(timeout)
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, "timed out waiting for %s" % what
        time.sleep(0.2)


def _sampled(target: str, samples: int):
    """The per-rank counts once both ranks' main threads were sampled ``samples`` times where they wait (the
    samples before, of their imports, differ from one another)."""
    rows = _rows(run_cli(target, "query", "--json", PER_RANK, timeout=scaled(60)))
    return rows if len(rows) == 2 and all(r["waiting"] >= samples for r in rows) else None


@needs_torchrun
def test_the_helpers_history_says_where_each_rank_has_been_and_since_when(tmp_path):
    snaps = str(tmp_path / "snaps")
    with torchrun_job("dist_hang.py", 2, timeout=180, HANG_SKIP_RANK="1", PROBE_STACK_EVERY="1",
                      PROBE_HANG_AFTER="6", PROBE_HANG_MIN="6", PROBE_SNAPSHOT_DIR=snaps) as (port, pids):
        master = "127.0.0.1:%d" % port
        rows = _until(lambda: _sampled(master, 3), 60, "3 samples of each rank where it waits")
        assert [r["rank"] for r in rows] == [0, 1]
        for row in rows:  # a stack is stored once, then referred to: a rank that stays put has one or two
            assert row["stacks"] < row["samples"], rows
            assert row["source"] == "agent", rows  # now; while it imported, a C call may have kept its GIL: outside
        assert [r["in_loader"] for r in rows] == [False, True], rows
        pid_of = _rows(run_cli(master, "query", "--json", "SELECT DISTINCT rank, pid, host, func FROM "
                                                          "cluster.stack_history WHERE thread = 'MainThread'"))
        assert {(r["rank"], r["pid"]) for r in pid_of} == set(pids.items()), pid_of

        verdict = run_cli(master, "diagnose", "--json", timeout=scaled(60))
        report = json.loads(verdict.out)
        assert verdict.code == 11, verdict.out + verdict.err
        said = [e["text"] for v in report["verdicts"] for e in v["evidence"]]
        since = [t for t in said if t.startswith("rank 1 has been in load_next_batch since ")]
        assert since and since[0].endswith(" samples"), said

        # the watch's record of the stall carries the history: queried and judged from it
        record = _until(lambda: [d for d in os.listdir(snaps) if os.path.isfile(os.path.join(snaps, d, "meta-%s.json"
                                                                                             % os.uname().nodename))]
                        if os.path.isdir(snaps) else None, 90, "the watch's record of the stall")
    target = "snapshot:%s" % os.path.join(snaps, record[0])
    kept = _rows(run_cli(target, "query", "--json", PER_RANK))
    assert [r["rank"] for r in kept] == [0, 1] and all(r["stacks"] < r["samples"] for r in kept), kept
    judged = run_cli(target, "diagnose")
    assert "rank 1 has been in load_next_batch since " in judged.out, judged.out + judged.err
