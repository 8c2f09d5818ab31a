"""A rank killed without a word (SIGKILL, as the OOM killer kills) in a torchrun job: torchrun then ends the
other rank with SIGTERM, whose handler leaves a crash record with a time, while the killed rank's record has
its header alone and no time. The record made at the deaths, and the verdict read from it, must name the
killed rank first, not the rank its launcher ended or whose all_reduce lost its peer. A real 2-rank torchrun
gloo job (tests/targets/snap_train.py)."""

import json
import os
import signal

from procs import run_cli, scaled, target_env
from test_snapshot_watch import _dirs, _recorded, _stderr, _stepping_and_watched, _torchrun, _until
from torch_job import stop_launcher


def test_a_rank_killed_without_a_word_is_named_first_and_the_rank_its_launcher_ended_after_it(tmp_path):
    run, snaps, control = _dirs(tmp_path, "kill")
    launcher, output = _torchrun(tmp_path, "kill", run, PROBE_SNAPSHOT_DIR=snaps, PROBE_HANG_AFTER="600",
                                 SNAP_CONTROL=control)
    try:
        ranks = _stepping_and_watched(run, output)
        os.kill(ranks[1], signal.SIGKILL)
        code = launcher.wait(scaled(60))
    finally:
        stop_launcher(launcher)
    assert code != 0
    found = _until(lambda: [s for s in _recorded(snaps) if s.complete], 10, "the death recorded")
    # torchrun saw the exit code (-9): the record names the signal
    assert found[0].reason.startswith("rank 1 died: killed by SIGKILL"), (found, _stderr(tmp_path, "kill"))
    shown = run_cli("snapshot:%s" % found[0].path, "diagnose", "--json",
                    env=target_env(probe=False, PROBE_RUNTIME_DIR=run))
    assert shown.code == 12, shown
    report = json.loads(shown.out)
    first = report["verdicts"][0]
    assert first["kind"] == "dead" and first["culprits"] == [1], report["verdicts"]
    assert "killed by SIGKILL (torchrun saw exitcode -9)" in first["summary"], first
    ended = [v for v in report["verdicts"] if v["kind"] == "dead" and v["culprits"] == [0]]
    for verdict in ended:  # rank 0, where it was recorded dead (the launcher's SIGTERM or gloo's lost peer): said so
        assert "most likely of the death of rank 1" in verdict["summary"], verdict
