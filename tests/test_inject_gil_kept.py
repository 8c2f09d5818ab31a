"""A process whose main thread keeps the GIL in a C call (gil_sleep.py: libc's sleep through ctypes.PyDLL):
``probe list`` says so in its state, and ``probe PID inject`` says at once that the start is queued behind
that call, before it gives up waiting, instead of saying it only at the end of its whole budget."""

import json
import subprocess
import sys

from procs import run_cli, scaled, spawn, target_env
from test_inject import needs_ptrace


@needs_ptrace
def test_list_and_inject_say_the_gil_is_kept_in_a_c_call():
    proc = spawn("gil_sleep.py", ["600"], probe=False)
    try:
        rows = json.loads(run_cli("list", "--json", timeout=scaled(60)).out)
        row = next(r for r in rows if r["pid"] == proc.pid)
        assert row["state"].startswith("GIL kept in a C call") and "gil_sleep.py:" in row["state"], row

        inject = subprocess.Popen([sys.executable, "-m", "probe", str(proc.pid), "inject"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=target_env(probe=False))
        try:
            first = inject.stderr.readline()  # said as soon as gdb saw it, not with the final error
            rest = inject.communicate(timeout=scaled(120))[1]
        finally:
            if inject.poll() is None:
                inject.kill()
                inject.communicate()
        assert "holds the GIL" in first and "its start is queued" in first and "waiting" in first, first
        assert "error:" not in first, first
        assert inject.returncode != 0 and "probe: error: the agent did not start" in rest, rest
        assert proc.popen.poll() is None  # the target runs on, its call unharmed
    finally:
        proc.kill()
