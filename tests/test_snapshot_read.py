"""Reading a snapshot as a target (issue 21): the same commands as on the live job, after its ranks are gone.

One module fixture runs two real 2-rank gloo jobs under torchrun at once, each with the Flight Recorder on
and rank 1 skipping an all_reduce (tests/targets/dist_diagnose.py's ``skip 1``):

* with probe's agents: recorded by hand (``probe MASTER:PORT snapshot --dir D``), then killed and reaped;
* without any agent: its collective times out (8 s) and its ranks leave torch's Flight Recorder dumps
  (tests/targets/fr_dump_gloo.py), then it ends.
"""

import json
import os
import pickle
import subprocess
import time
from typing import Any, Dict, Iterator, Tuple

import pytest

from probe.diagnose.verdict import EXIT_CODES
from procs import TARGETS, Proc, run_cli, scaled, target_env
from test_cluster import TORCHRUN, _free_ports, _kill_job, _ready_ranks, needs_torchrun, torchrun_job

STUCK = EXIT_CODES["stuck"]
HANG = "collective hang in process group 0 (default_pg): rank 1 did not issue gloo:all_reduce #"


def _record(port: int, root: str) -> Tuple[str, Any]:
    """Record the job by hand until its record shows the hang (rank 0 must have waited 2 s and more in its
    all_reduce when recorded); the snapshot: target and the record's diagnosis while the job still ran."""
    deadline = time.monotonic() + scaled(60)
    time.sleep(3)  # the hang's first 2 s and more; a record made too early is made again below
    while True:
        made = run_cli("127.0.0.1:%d" % port, "snapshot", "--dir", root, "--json", timeout=120)
        assert made.code == 0, (made.code, made.out, made.err)
        target = "snapshot:" + json.loads(made.out)["path"]
        result = run_cli(target, "diagnose")
        if result.code == STUCK and HANG in result.out or time.monotonic() > deadline:
            return target, result
        time.sleep(2)


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting for its reaper does not)."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as handle:
            stat = handle.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2:][:1] not in (b"Z", b"X")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: Any) -> Iterator[Dict[str, Any]]:
    base = tmp_path_factory.mktemp("snapshot-read")
    dumps = base / "dumps"
    dumps.mkdir()
    control_a, control_b = base / "control-a", base / "control-b"
    control_a.write_text("")
    control_b.write_text("")
    env = target_env(probe=False, DIAG_CONTROL=str(control_b), TORCH_FR_BUFFER_SIZE="2000",
                     TORCH_FR_DUMP_TEMP_FILE=str(dumps / "fr_"), PG_TIMEOUT_S="8")
    launcher = subprocess.Popen([TORCHRUN, "--nproc-per-node=2", "--master-port=%d" % _free_ports(1),
                                 "--monitor-interval=1", os.path.join(TARGETS, "fr_dump_gloo.py")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
    agentless = Proc(launcher, "torchrun fr_dump_gloo.py")
    try:
        with torchrun_job("dist_diagnose.py", 2, timeout=180, DIAG_CONTROL=str(control_a),
                          TORCH_FR_BUFFER_SIZE="2000") as (port, pids):
            _ready_ranks(agentless, 2, time.monotonic() + scaled(180))
            control_a.write_text("skip 1\n")
            control_b.write_text("skip 1\n")
            target, live = _record(port, str(base / "records"))
        # torchrun_job killed and reaped the recorded job; the other ends on its collective's timeout
        deadline = time.monotonic() + scaled(90)
        while launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        yield {"target": target, "live": live, "pids": pids, "dumps": str(dumps),
               "dumped": sorted(os.listdir(str(dumps))), "agentless_exit": launcher.poll()}
    finally:
        _kill_job(launcher)


@needs_torchrun
def test_a_recorded_job_reads_as_it_was_after_its_ranks_are_killed(recorded: Dict[str, Any]) -> None:
    target = recorded["target"]
    assert recorded["live"].code == STUCK, (recorded["live"].out, recorded["live"].err)
    deadline = time.monotonic() + scaled(20)
    while any(_alive(pid) for pid in recorded["pids"].values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in recorded["pids"].values()), recorded["pids"]  # every rank is gone

    result = run_cli(target, "diagnose")
    assert result.code == STUCK, (result.out, result.err)
    lines = result.out.splitlines()
    assert lines[0].startswith("RECORD: a record of ranks 0-1, written ") and "by hand" in lines[0] \
        and "the ranks may be gone" in lines[0], lines[0]
    assert lines[1].startswith("STUCK: " + HANG) and "rank 0 waits in it" in lines[1], result.out
    assert "load_next_batch" in result.out.split("evidence:")[0] and "waiting (not to blame): rank 0" in result.out
    report = json.loads(run_cli(target, "diagnose", "--json").out)
    assert [(v["kind"], v["culprits"], v["victims"]) for v in report["verdicts"]][0] == ("collective_hang", [1], [0])
    assert report["record"]["reasons"] == ["by hand"] and report["record"]["ranks"] == [0, 1]

    # --all-ranks backtrace: rank 1 apart, in its data loader; rank 0 in the all_reduce.
    stacks = run_cli(target, "--all-ranks", "backtrace")
    assert stacks.code == 0, (stacks.out, stacks.err)
    main = stacks.out.split('Thread "MainThread": 2 distinct stacks across 2 of 2 ranks\n', 1)[-1].split("\n\n")[0]
    groups = {block.split("\n", 1)[0].strip(): block for block in main.split("\n  rank ")}
    assert "load_next_batch" in groups.get("1 (1)", "") and "sync_loss" not in groups.get("1 (1)", ""), stacks.out
    assert "sync_loss" in groups.get("rank 0 (1)", ""), stacks.out
    plain = run_cli(target, "backtrace")  # rank 0, as `probe MASTER:PORT backtrace` speaks to rank 0
    assert plain.code == 0 and "sync_loss" in plain.out and "load_next_batch" not in plain.out, plain.out

    # The query, over every rank's rows at once; and the live job's way, across ranks and merged.
    seq = "SELECT rank, max(collective_seq_id) AS seq FROM torch.flight_recorder GROUP BY rank ORDER BY rank"
    rows = json.loads(run_cli(target, "query", seq, "--json").out)
    assert [r["rank"] for r in rows] == [0, 1] and rows[0]["seq"] == rows[1]["seq"] + 1, rows
    merged = json.loads(run_cli(target, "--all-ranks", "query", "SELECT collective_seq_id FROM torch.flight_recorder",
                                "--merge", "SELECT rank, max(collective_seq_id) AS seq FROM result GROUP BY rank "
                                           "ORDER BY rank", "--json").out)
    assert merged == rows, (merged, rows)
    tables = run_cli(target, "tables")
    assert all(name in tables.out for name in ("python.backtrace", "python.locals", "torch.flight_recorder")), tables.out
    ranks = run_cli(target, "ranks", "--json")
    assert [r["rank"] for r in json.loads(ranks.out)] == [0, 1], ranks.out

    # What needs a live process says why it cannot be.
    refused = run_cli(target, "eval", "1 + 1")
    assert refused.code == 2 and "a snapshot is a record of ranks that may be gone: eval needs a live process" \
        in refused.err, (refused.code, refused.err)


@needs_torchrun
def test_torch_flight_recorder_dumps_of_a_job_without_agents_name_the_rank_that_skipped(recorded: Dict[str, Any]) -> None:
    assert recorded["dumped"] == ["fr_0", "fr_1"], recorded
    for where in (os.path.join(recorded["dumps"], "fr_"), recorded["dumps"]):  # the prefix, or the directory
        result = run_cli("snapshot:" + where, "diagnose")
        assert result.code == STUCK, (result.out, result.err)
        lines = result.out.splitlines()
        assert lines[0].startswith("RECORD: torch Flight Recorder dumps of ranks 0-1"), lines[0]
        assert lines[1].startswith("STUCK: " + HANG) and "rank 0 waits in it" in lines[1], result.out
        assert "rank 1 issued its last collective, #" in result.out and "sync_loss" in result.out, result.out
    alone = run_cli("snapshot:" + os.path.join(recorded["dumps"], "fr_0"), "diagnose")  # one rank's dump: no verdict
    assert alone.code == EXIT_CODES["degraded"] and "DEGRADED: only rank 0's dump" in alone.out, alone.out
    rows = json.loads(run_cli("snapshot:" + recorded["dumps"], "query", "SELECT rank, max(collective_seq_id) AS seq "
                              "FROM torch.flight_recorder GROUP BY rank ORDER BY rank", "--json").out)
    assert [r["rank"] for r in rows] == [0, 1] and rows[0]["seq"] == rows[1]["seq"] + 1, rows


def test_a_dump_file_that_could_run_code_is_refused_before_it_is_unpickled(tmp_path: Any) -> None:
    (tmp_path / "evil_0").write_bytes(pickle.dumps({"entries": [], "x": os.system}))
    (tmp_path / "cut_0").write_bytes(pickle.dumps({"entries": [{"collective_seq_id": 1}] * 50})[:40])
    result = run_cli("snapshot:%s" % (tmp_path / "evil_"), "diagnose")
    assert result.code == 2 and "is refused: its pickle uses STACK_GLOBAL" in result.err, (result.code, result.err)
    result = run_cli("snapshot:%s" % (tmp_path / "cut_"), "query", "SELECT 1")
    assert result.code == 2 and "is not a Flight Recorder dump that can be read" in result.err, result.err


def _nccl_dump(path: Any, last: int, done_upto: int) -> None:
    """A dump of the form torch's recorder gives for NCCL (JSON here): collectives 1..``last``, each with its
    CUDA events' times, completed up to ``done_upto``, the rest started and not finished."""
    now = time.time_ns()
    entries = [{"record_id": s - 1, "pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": s,
                "p2p_seq_id": 0, "op_id": s, "profiling_name": "nccl:all_reduce", "is_p2p": False,
                "time_created_ns": now - (60 - s) * 10**9, "time_discovered_started_ns": now - (60 - s) * 10**9 + 10**6,
                "time_discovered_completed_ns": now - (60 - s) * 10**9 + 10**7 if s <= done_upto else None,
                "state": "completed" if s <= done_upto else "started", "retired": s <= done_upto, "timeout_ms": 600000,
                "frames": [{"name": "train_step", "filename": "/job/train.py", "line": 40}]} for s in range(1, last + 1)]
    path.write_text(json.dumps({"version": "2.10", "entries": entries, "pg_config": {}}))


def test_dumps_of_a_collective_that_every_rank_issued_and_none_finished_say_so(tmp_path: Any) -> None:
    _nccl_dump(tmp_path / "nccl_trace_rank_0", 7, 6)
    _nccl_dump(tmp_path / "nccl_trace_rank_1", 7, 6)
    result = run_cli("snapshot:%s" % tmp_path, "diagnose")
    assert result.code == STUCK and "STUCK: collective stuck in process group 0 (default_pg): ranks 0-1 issued " \
        "nccl:all_reduce #7 and none finished it" in result.out, (result.code, result.out, result.err)
    assert "rank 1 issued its last collective, #7 (nccl:all_reduce), at /job/train.py:40 train_step" in result.out
    _nccl_dump(tmp_path / "nccl_trace_rank_1", 6, 6)  # rank 1 never issued #7
    result = run_cli("snapshot:%s" % tmp_path, "diagnose")
    assert result.code == STUCK and "rank 1 did not issue nccl:all_reduce #7; rank 0 waits in it" in result.out, \
        result.out


def test_a_recorded_lock_cycle_reads_stuck_as_it_did_live(target_factory: Any, tmp_path: Any) -> None:
    """The lock-wait rule wants the same stack over 2 s and more: the record looks again at 3 s where the
    second look showed no sign of life, as diagnose does live."""
    proc = target_factory("lock_cycle.py")
    made = run_cli(str(proc.pid), "snapshot", "--dir", str(tmp_path), "--json", timeout=scaled(60))
    proc.kill()
    assert made.code == 0, made.err
    target = "snapshot:" + json.loads(made.out)["path"]
    result = run_cli(target, "diagnose")
    assert result.code == STUCK, (result.out, result.err)
    lines = result.out.splitlines()
    assert lines[0].startswith("RECORD: a record of process %d, written " % proc.pid), lines[0]
    assert lines[1].startswith("STUCK: process %d: audit, transfer wait for a lock" % proc.pid), result.out
