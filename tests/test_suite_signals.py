"""The suite run as a background job (`bash tests/run.sh &`, nohup, a CI runner) starts its children with SIGINT
at its default, as in the foreground: a shell starts a background job with SIGINT ignored, and an ignored
signal survives exec, so without tests/conftest.py's reset every Ctrl-C test failed there."""

import os
import signal
import subprocess
import sys

import pytest

from procs import scaled

HERE = os.path.dirname(os.path.abspath(__file__))
SIGINT_BIT = 1 << (signal.SIGINT - 1)


def _ignored_signals(pid: int) -> int:
    with open("/proc/%d/status" % pid) as status:
        for line in status:
            if line.startswith("SigIgn:"):
                return int(line.split()[1], 16)
    raise AssertionError("no SigIgn line for pid %d" % pid)


def test_a_child_of_the_suite_takes_sigint_by_default() -> None:
    """Run inside the suite (always), and inside a pytest started with SIGINT ignored (by the test below)."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert not _ignored_signals(child.pid) & SIGINT_BIT, "a child of the suite starts with SIGINT ignored"
    finally:
        child.kill()
        child.wait(timeout=scaled(10))


def test_the_suite_run_in_the_background_gives_its_children_sigint() -> None:
    def ignore_sigint() -> None:  # what a non-interactive shell does to `cmd &`
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    inner = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         os.path.join(HERE, "test_suite_signals.py") + "::test_a_child_of_the_suite_takes_sigint_by_default"],
        preexec_fn=ignore_sigint, capture_output=True, text=True, timeout=scaled(120), cwd=os.path.dirname(HERE))
    assert inner.returncode == 0, inner.stdout[-3000:] + inner.stderr[-2000:]
    assert "1 passed" in inner.stdout, inner.stdout[-2000:]
