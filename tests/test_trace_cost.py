"""What the torch trace's hooks cost a training step (issue 24: every step <= 0.5 %): on a CPU process the
RSS reading (three system calls, ~9 us right after a step's matmuls here) was taken again for every span
that ended more than 100 us after the last one, which was most spans of a real model; now a reading is
shared by the spans that end within 1 ms of it, or 2000 times what it took where that is longer, so
reading RSS takes about 0.05 % of the process's time at most. Counted, not timed: the read system calls
of the process (/proc/self/io's ``syscr``) over traced forwards of modules that each take ~0.4 ms. Runs
in a real child process."""

import json
import subprocess
import sys
import textwrap

import pytest

from procs import REPO, scaled, target_env

pytest.importorskip("torch", reason="the torch trace needs torch (CPU build, torch==2.13.0)")

_SCRIPT = textwrap.dedent("""
    import json, time
    import torch
    from probe.tables.torch import trace

    class Busy(torch.nn.Module):
        def forward(self, x):
            end = time.perf_counter() + 0.0004
            while time.perf_counter() < end:
                pass
            return x + 1

    model = torch.nn.Sequential(*[Busy() for _ in range(40)])
    x = torch.zeros(2)

    def reads():
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("syscr:")).split()[1]) - 1  # this read

    trace.start()
    model(x)  # names the modules
    time.sleep(0.03)
    before = reads()
    started = time.perf_counter()
    for _ in range(5):
        model(x)
    took = time.perf_counter() - started
    after = reads()
    spans = trace.current().ring.written()
    trace.stop()
    print(json.dumps({"reads": after - before - 1, "spans": spans, "took": took}))
""")


def test_spans_that_end_soon_after_a_reading_share_it() -> None:
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=scaled(90),
                          env=target_env(probe=False), cwd=REPO)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["spans"] == 6 * 41, seen  # every module call of the 6 forwards has its span
    # 205 spans over >= 80 ms, ~0.4 ms apart: before, one reading each (200 reads); now readings 1 ms
    # apart at least (2000 x what one takes where that is longer: 10-100 ms here).
    assert 0 < seen["reads"] <= seen["took"] / 0.001 + 1, seen
