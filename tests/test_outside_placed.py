"""A program thread that keeps the GIL while it runs probe's own work (a snippet placed on the main
thread, a read placed after an optimizer step) is busy for a client, not blocked: every other request
waits for its answer, however stale the agent's heartbeat grew meanwhile. And a request that fails
where the agent is called blocked (eval) is not given up on while a C call of the program's keeps the
GIL a few tenths of a second at a time.

Before: a request sent while such a snippet had kept the GIL 0.6 s was answered 'thread MainThread
holds the GIL ... and does not let go' (exit 5), as a torch.optimizers read placed between steps was
on a loaded machine (tests/test_torch_reads.py); eval against 0.3 s C calls failed the same way.
"""

import subprocess
import sys
import time

import pytest

from procs import REPO, run_cli, running, scaled, target_env
from test_outside_quick import _heartbeat_age, _in_sleep as _sleeping

pytest.importorskip("pystack", reason="reading from outside needs pystack or py-spy")

HOLD_S = 1.5  # the placed snippet keeps the GIL this long in one C call (libc usleep through ctypes.PyDLL)
HOLD = "__import__('ctypes').PyDLL(None).usleep(%d) or 42" % int(HOLD_S * 1e6)


def _held_past_a_beat(pid: int) -> None:
    """Wait until the main thread sleeps in the placed snippet and the agent missed two beats."""
    deadline = time.monotonic() + scaled(20)
    while not (_sleeping(pid) and _heartbeat_age(pid) > 0.6):
        assert time.monotonic() < deadline, "the placed snippet never held the GIL past a beat"
        time.sleep(0.01)


def _placed(pid: int, *args: str) -> "subprocess.Popen[str]":
    """``probe PID eval ARGS HOLD`` in the background."""
    return subprocess.Popen([sys.executable, "-m", "probe", str(pid), "eval", *args, HOLD], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=target_env(probe=False), cwd=REPO)


def _finished(placed: "subprocess.Popen[str]") -> "tuple[int, str, str]":
    try:
        out, err = placed.communicate(timeout=scaled(30))
    finally:
        placed.kill()
        placed.wait()
    return placed.returncode, out, err


def test_requests_wait_for_a_snippet_placed_on_main_that_keeps_the_gil():
    with running("placed_work.py", timeout=scaled(30)) as proc:
        for command in (("eval", "6 * 7"), ("query", "SELECT count(*) AS n FROM python.threads", "-f", "json"),
                        ("backtrace",)):
            placed = _placed(proc.pid, "--on", "main")
            try:
                _held_past_a_beat(proc.pid)
                result = run_cli(str(proc.pid), *command, timeout=scaled(60))
            finally:
                code, out, err = _finished(placed)
            assert result.code == 0, (command, result.err)
            assert "cannot answer" not in result.err and "outside" not in result.err, (command, result.err)
            assert code == 0 and out.strip() == "42", (command, code, err)


def test_a_torch_optimizers_read_waits_for_a_read_placed_between_steps_that_keeps_the_gil():
    pytest.importorskip("torch")
    with running("many_groups.py", timeout=scaled(60)) as proc:
        placed = _placed(proc.pid, "--between-steps")
        try:
            _held_past_a_beat(proc.pid)
            result = run_cli(str(proc.pid), "query", "SELECT step FROM torch.optimizers", "-f", "json",
                             "--query-timeout", "%.0f" % min(60, scaled(20)), timeout=scaled(90))
        finally:
            code, out, err = _finished(placed)
        assert result.code == 0 and result.out.count('"step"') == 64, result.err
        assert code == 0 and out.strip() == "42", (code, err)


def test_eval_and_queries_wait_out_c_calls_that_keep_the_gil_a_third_of_a_second():
    """The main thread keeps the GIL 0.3 s at a time (a collection of a big heap on a loaded machine can
    take as long): a backtrace may say the GIL is held (it is, and its stacks are read from outside), eval
    is answered. (A query needs many more turns of the GIL than these gaps give it within its timeout.)"""
    with running("gil_short_holds.py", "0.3", timeout=scaled(30)) as proc:
        pid = str(proc.pid)
        for _ in range(3):
            result = run_cli(pid, "eval", "6 * 7", timeout=scaled(60))
            assert result.code == 0 and result.out.strip() == "42", result.err
            result = run_cli(pid, "backtrace", timeout=scaled(60))
            assert result.code == 0 and "gil_short_holds.py" in result.out, result.err
