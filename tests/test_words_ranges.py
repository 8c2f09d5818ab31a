"""Words as a person reads them, from real processes through the CLI: a range of one value is that value
(``82 steps``, not ``82-82``), a death is said once, --watch says a verdict's status once, a hint names
the target it was given for, a query across ranks has one ``rank`` column, and a command that takes its
target as an argument shows it once in its usage."""

import json
import re
import signal
import subprocess
import sys

from procs import die_with_record, run_cli, scaled, target_env
from test_cluster import needs_torchrun, torchrun_job

_ONE_VALUE_RANGE = re.compile(r"\b(\d+(?:\.\d+)?)-\1\b")  # 82-82, 0.1-0.1


def _no_range_of_one(text: str) -> None:
    found = _ONE_VALUE_RANGE.search(text)
    assert found is None, "a range of one value (%r) in:\n%s" % (found.group(0), text)


def test_a_training_process_steps_are_said_as_one_number_and_watch_says_a_status_once(target_factory):
    proc = target_factory("train.py", timeout=60)
    pid = str(proc.pid)
    assert run_cli(pid, "trace", "start", timeout=scaled(60)).code == 0
    deadline = "%d" % scaled(30)

    # the trace's steps on one process: "trace: 12 steps in ...", never "12-12 steps"
    once = run_cli("--deadline", deadline, pid, "diagnose", timeout=scaled(120))
    assert once.code == 0, (once.out, once.err)
    traced = [ln for ln in once.out.splitlines() if "trace: " in ln and " steps in " in ln]
    assert traced, once.out
    _no_range_of_one(once.out)

    # --watch: each round's steps as one number for one rank, and a status never said twice in a row
    watch = subprocess.Popen([sys.executable, "-m", "probe", "--deadline", deadline, pid, "diagnose", "--watch",
                              "0.5", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=target_env(probe=False))
    try:
        rounds = [json.loads(watch.stdout.readline()) for _ in range(3)]
    finally:
        watch.send_signal(signal.SIGINT)
        watch.communicate(timeout=scaled(30))
    changes = [line for r in rounds[1:] for line in r["changes"]]
    assert any(re.fullmatch(r"rank 0 made \d+ steps?", line) for line in changes), changes
    for line in changes:
        _no_range_of_one(line)
        assert not re.match(r"(\w+) -> \1\b", line), changes  # "healthy -> healthy"
        assert not re.search(r"\b(\w+): \1:", line), changes  # "healthy: healthy:"


def test_a_dead_process_is_said_dead_once(tmp_path):
    tmp_path.chmod(0o700)
    pid = die_with_record(str(tmp_path), "idle.py", [], signal.SIGKILL).pid
    env = target_env(probe=False, PROBE_RUNTIME_DIR=str(tmp_path))
    result = run_cli(str(pid), "diagnose", env=env, timeout=scaled(60))
    head = result.out.splitlines()[0]
    assert result.code == 12 and head.startswith("DEAD: process %d is dead: " % pid), (result.code, result.out)
    assert head.count("is dead") == 1, head


def test_a_hint_names_the_target_it_was_given_for(idle_target):
    pid = str(idle_target.pid)
    for argv, command in (((pid, "eval", "--frame", "MainThread:no_such_function", "1"), "backtrace"),
                          (("-t", pid, "eval", "--frame", "MainThread:99", "1"), "backtrace")):
        result = run_cli(*argv, timeout=scaled(60))
        assert result.code != 0 and "`probe %s %s`" % (pid, command) in result.err, (argv, result.err)
        assert "probe TARGET" not in result.err and "probe PID" not in result.err, result.err


def test_mcp_usage_shows_its_target_once():
    result = run_cli("mcp", "--help")
    assert result.code == 0 and result.out.splitlines()[0] == "Usage: probe mcp [OPTIONS] [TARGET]", result.out


@needs_torchrun
def test_a_query_across_ranks_has_one_rank_column():
    with torchrun_job("dist_train.py", 2, timeout=scaled(180)) as (port, pids):
        master = "127.0.0.1:%d" % port
        result = run_cli(master, "--all-ranks", "query", "SELECT * FROM torch.distributed", "-f", "json",
                         timeout=scaled(120))
        assert result.code == 0, result.err
        rows = json.loads(result.out)
        assert sorted(r["rank"] for r in rows) == [0, 1] and all("table_rank" not in r for r in rows), rows
        table = run_cli(master, "--all-ranks", "query", "SELECT rank, world_size FROM torch.distributed",
                        timeout=scaled(120))
        assert table.code == 0, table.err
        header = table.out.splitlines()[0].split()
        assert header.count("rank") == 1, table.out
