"""A busy process whose GIL moves among threads, whose agent runs a long snippet, or whose C calls keep the
GIL 0.12 s at a time, is never called blocked: what the rule that tells a GIL-held process must never
get wrong, however quick it is made (issue 24). Its speed is measured in bench/bench_outside.py.
"""

import pytest

import probe
from procs import run_cli, scaled

pytest.importorskip("pystack", reason="reading from outside needs pystack or py-spy")


def test_a_busy_process_whose_gil_moves_is_never_called_blocked(target_factory):
    proc = target_factory("gil_contended.py")
    pid = str(proc.pid)
    for _ in range(4):
        result = run_cli(pid, "backtrace")
        assert result.code == 0 and "outside" not in result.err and "cannot answer" not in result.err, result.err
        assert "spinner-3" in result.out
    # Snippets that keep the GIL in one C call (sum over a range) for about half a second, on the agent's
    # thread and on the program's main thread: the agent is busy for its client, not blocked.
    for on in ("agent", "main"):
        result = run_cli(pid, "eval", "--on", on, "sum(range(40000000)) > 0", timeout=scaled(60))
        assert result.code == 0 and result.out.strip() == "True", (on, result.err)


def test_c_calls_that_keep_the_gil_briefly_are_waited_for_not_called_held(target_factory):
    """The main thread keeps the GIL for 0.12 s at a time: each request waits for a gap and is answered.
    A watch of 40 ms alone would have caught the holder in a call and called the GIL held."""
    proc = target_factory("gil_short_holds.py")
    client = probe.connect(str(proc.pid))
    for _ in range(6):
        assert client.eval("6 * 7").value == "42"
        assert client.query_rows("SELECT thread_name FROM python.threads ORDER BY thread_name").rows
