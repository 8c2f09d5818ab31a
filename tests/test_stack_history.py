"""Where each rank has been (issue 36, item 4): the node helper samples its ranks' stacks every
PROBE_STACK_EVERY seconds, keeps them deduplicated as cluster.stack_history, queried through the job's
address and from the stall record that carries it, and diagnose says since when a stuck rank has been
where it is. A real 2-rank torchrun gloo job on the CPU in which rank 1 waits in its own data loading
(tests/targets/dist_hang.py) while rank 0 waits for it in all_reduce."""

import json
import os

from procs import run_cli, running, scaled
from test_cluster import needs_torchrun, torchrun_job
from test_snapshot_watch import _until

PER_RANK = """SELECT rank, count(*) AS samples, count(DISTINCT stack_id) AS stacks, arg_max(source, time) AS source,
  bool_or(frames LIKE '%load_next_batch%') AS in_loader,
  count(*) FILTER (WHERE frames LIKE '%load_next_batch%' OR frames LIKE '%train_step%') AS waiting
  FROM cluster.stack_history WHERE thread = 'MainThread' GROUP BY rank ORDER BY rank"""


def _rows(result) -> list:
    assert result.code == 0, result.out + result.err
    return json.loads(result.out)


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

        from probe.client.cluster import connect_all

        table = connect_all(master).stack_history()  # the same from Python
        assert set(table.column("rank").to_pylist()) == {0, 1} and table.num_rows >= 6

        verdict = run_cli(master, "diagnose", "--json", timeout=scaled(60))
        report = json.loads(verdict.out)
        assert verdict.code == 11, verdict.out + verdict.err
        said = [e["text"] for v in report["verdicts"] for e in v["evidence"]]
        since = [t for t in said if t.startswith("rank 1 has been in load_next_batch since ")]
        assert since and since[0].endswith(" samples"), said

        # a snapshot by hand, now that the hang is old, carries the history: queried and judged from it
        hand = _rows(run_cli(master, "--deadline", str(scaled(30)), "snapshot", "--dir", str(tmp_path / "hand"),
                             "--json", timeout=scaled(120)))
        # the watch's record of the stall (made at 6 s, whatever the ranks did by then) carries it too
        watched = _until(lambda: [d for d in os.listdir(snaps) if os.path.isfile(os.path.join(
            snaps, d, "meta-%s.json" % os.uname().nodename))] if os.path.isdir(snaps) else None, 90,
                         "the watch's record of the stall")
    from probe.snapshot.record import rank_file_name, read_rank

    for directory, repeated in ((hand["path"], True), (os.path.join(snaps, watched[0]), False)):
        for rank in (0, 1):  # each rank's rows in its record, each of its stacks written once
            kept = read_rank(os.path.join(directory, rank_file_name(rank)))["tables"]["cluster.stack_history"]
            assert {row[1] for row in kept["rows"]} == {rank}, kept
            assert set(kept["stacks"]) == {row[5] for row in kept["rows"]}, kept
            assert len(kept["stacks"]) < len(kept["rows"]) or not repeated, kept
    target = "snapshot:%s" % hand["path"]
    kept = _rows(run_cli(target, "query", "--json", PER_RANK))
    assert [r["rank"] for r in kept] == [0, 1] and all(r["stacks"] < r["samples"] for r in kept), kept
    judged = run_cli(target, "diagnose")
    assert "rank 1 has been in load_next_batch since " in judged.out, judged.out + judged.err


class _Node:
    """The one thing the sampler asks of its node helper: the node's ranks (here one real process)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def local_members(self):
        return [{"rank": 0, "pid": self.pid, "state": "running"}]


def test_the_history_stays_within_its_bounds_and_forgets_what_is_older_than_it_keeps(monkeypatch):
    from probe.host import history

    with running("idle.py") as target:
        kept = history.History(_Node(target.popen.pid), every=1.0, keep=3600.0)
        assert kept.sample() == 3  # the main thread, loader-0 and heartbeat, from the agent
        body = kept.answer()
        assert {r[3] for r in body["rows"]} == {"MainThread", "loader-0", "heartbeat"}
        assert all(r[5] == "agent" and r[4] in body["stacks"] for r in body["rows"])
        assert any("data_loader_wait" in frames for _, frames in body["stacks"].values())

        monkeypatch.setattr(history, "MAX_ROWS", 7)
        for _ in range(4):
            kept.sample()
        body = kept.answer()
        assert len(body["rows"]) == 7 and len(body["stacks"]) < 7  # the oldest rows went; stacks stored once
        assert set(kept._stacks) == {r[4] for r in body["rows"]}  # a stack no row names is gone too

        monkeypatch.setattr(history, "MAX_STACKS", 2)
        few = history.History(_Node(target.popen.pid), every=1.0, keep=3600.0)
        few.sample()  # room for two distinct stacks: the third thread's pushes out the oldest row and its stack
        body = few.answer()
        assert len(body["stacks"]) == 2 and len(body["rows"]) == 2, body

        kept.keep = 0.0  # nothing is older than the last hour here: forget everything sampled before now
        assert kept.answer()["rows"] == [] and kept._stacks == {}
