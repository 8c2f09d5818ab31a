"""python.workers, `probe list` and `inject` on the DataLoader workers of a real CPU job whose worker 1
hangs in one sample's read (issue 19, item 6)."""

import json
import os
import signal
from contextlib import contextmanager
from typing import Iterator, List

import pytest

from procs import run_cli, running, scaled

pytest.importorskip("torch")


@contextmanager
def hung_loader() -> Iterator[List[int]]:
    """[main pid, worker 0 pid, worker 1 pid] of loader_hang.py, its main thread waiting for batch 3,
    which worker 1 makes and never finishes. The workers leave once the main process is gone; they are
    killed here too."""
    with running("loader_hang.py", timeout=scaled(60)) as proc:
        workers = [int(w) for w in next(line for line in proc.lines if line.startswith("WORKERS")).split()[1:]]
        try:
            yield [proc.pid] + workers
        finally:
            for pid in workers:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def test_the_worker_the_main_thread_waits_for_is_named_listed_and_entered():
    with hung_loader() as (main, first, second):
        done = run_cli(str(main), "query", "SELECT pid, worker_id, alive, state, tasks, tasks_outstanding, "
                                           "next_task, waited_by FROM python.workers ORDER BY worker_id", "--json")
        assert done.code == 0, done.err
        rows = json.loads(done.out)
        assert [(r["pid"], r["worker_id"], r["alive"]) for r in rows] == [(first, 0, True), (second, 1, True)], rows
        assert rows[1]["waited_by"] == "MainThread" and rows[0]["waited_by"] is None, rows
        assert rows[1]["next_task"] == 3 and 3 in json.loads(rows[1]["tasks"]), rows

        listed = json.loads(run_cli("list", "--json").out)
        workers = {r["pid"]: r for r in listed if r["pid"] in (first, second)}
        assert workers[second]["worker_of"] == main and workers[second]["worker_id"] == 1, workers
        assert workers[first]["state"] == "DataLoader worker 0 of %d" % main, workers

        short = run_cli(str(second), "inject", "--timeout", "0.12")
        if short.code != 0:  # the whole time it had, not what was left for the step gdb was at (0.1 s)
            assert "within 0.12 s (--timeout)" in short.err, short.err
        assert run_cli(str(second), "inject").code == 0
        done = run_cli(str(second), "query", "SELECT value FROM python.locals WHERE name = 'index' "
                                             "AND func LIKE '%__getitem__'", "--json")
        assert done.code == 0 and json.loads(done.out) == [{"value": "13"}], done
