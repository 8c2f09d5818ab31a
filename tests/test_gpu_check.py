"""``bench/gpu_check.sh`` (issue 37 item 4) on this GPU-less machine: the checks that make sense on a CPU
pass there, the GPU-only ones say "needs a GPU", the run is one table and one record, exit 0; a check that
runs out of time fails the run; an interrupted run leaves no process and no directory behind."""

import glob
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from typing import Dict, Iterator, List, Tuple

import pytest

from procs import REPO, scaled, target_env

pytest.importorskip("torch")

SCRIPT = os.path.join(REPO, "bench", "gpu_check.sh")
MARK = "GPU_CHECK_TEST_MARK"
CPU_CHECKS = ("trace", "checkpoint", "flight_recorder", "compile", "step_extras")
GPU_ONLY = ("blocked", "profile")


@pytest.fixture
def short_tmp() -> Iterator[str]:
    """A TMPDIR for the run, short enough for the agents' socket paths (108 bytes) under it."""
    path = tempfile.mkdtemp(prefix="gct", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _env(tmp_path, short_tmp: str, mark: str) -> Dict[str, str]:
    env = target_env(probe=False, GPU_CHECK_DEVICE="cpu", BENCH_RESULTS=str(tmp_path / "results"),
                     TMPDIR=short_tmp, GPU_CHECK_SCALE="%.2f" % scaled(1.0))
    env[MARK] = mark  # every process of the run inherits it: how the test finds what the run left behind
    env.pop("PROBE_RUNTIME_DIR", None)
    return env


def _cmdline(pid: int) -> str:
    """What a process runs, for a failure's message."""
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode("utf-8", "replace")[:300]
    except OSError:
        return "(gone)"


def _marked(mark: str) -> List[int]:
    """Live processes started by the run marked ``mark`` (zombies have no environment to read)."""
    needle = ("%s=%s" % (MARK, mark)).encode()
    found = []
    for path in glob.glob("/proc/[0-9]*/environ"):
        try:
            with open(path, "rb") as handle:
                if needle in handle.read().split(b"\0"):
                    found.append(int(path.split("/")[2]))
        except OSError:
            pass
    return found


def _targets(mark: str) -> List[int]:
    """The run's targets (bench/targets/gpu_job.py) alive now."""
    found = []
    for pid in _marked(mark):
        try:
            with open("/proc/%d/cmdline" % pid, "rb") as handle:
                if b"gpu_job.py" in handle.read():
                    found.append(pid)
        except OSError:
            pass
    return found


def _run(env: Dict[str, str], timeout: float) -> Tuple[int, str]:
    popen = subprocess.Popen(["bash", SCRIPT], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    try:
        out, _ = popen.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(popen.pid, signal.SIGKILL)
        popen.communicate()
        raise
    return popen.returncode, out


def _table(out: str) -> Dict[str, List[str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split() == ["check", "result", "seconds", "detail"])
    rows = {}
    for line in lines[start + 2:]:
        if not line.strip() or line.startswith("SUMMARY"):
            break
        name, rest = line.split(None, 1)
        rows[name] = [part.strip() for part in rest.split("  ") if part.strip()]
    return rows


def _assert_nothing_left(short_tmp: str, mark: str) -> None:
    deadline = time.monotonic() + scaled(10)
    while _marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _marked(mark)
    assert left == [], [_cmdline(pid) for pid in left]
    # the run's mktemp directory and the runtime directories in it removed (torch may keep its caches there)
    assert [name for name in os.listdir(short_tmp) if name.startswith("probe-gpu-check")] == []


def test_on_a_cpu_the_cpu_checks_pass_and_the_gpu_ones_say_they_need_a_gpu(tmp_path, short_tmp):
    mark = uuid.uuid4().hex
    code, out = _run(_env(tmp_path, short_tmp, mark), scaled(300))
    assert code == 0, out
    rows = _table(out)
    assert sorted(rows) == sorted(CPU_CHECKS + GPU_ONLY), out
    for name in CPU_CHECKS:
        assert rows[name][0] == "ok", out
    for name in GPU_ONLY:
        assert rows[name][0] == "needs a GPU", out
    assert "gloo:all_reduce" in " ".join(rows["flight_recorder"]), out
    assert "graph breaks 0 with and without the trace" in " ".join(rows["compile"]), out
    assert "no probe_cuda_* series (no CUDA), no alert" in " ".join(rows["step_extras"]), out
    (record,) = glob.glob(str(tmp_path / "results" / "*_gpu_check.json"))
    with open(record, encoding="utf-8") as handle:
        saved = json.load(handle)
    assert saved["bench"] == "gpu_check" and saved["argv"] == ["device=cpu"]
    assert {row["what"]: row["result"] for row in saved["rows"]} == {
        **{name: "ok" for name in CPU_CHECKS}, **{name: "needs a GPU" for name in GPU_ONLY}}
    assert saved["seconds"] >= sum(row["seconds"] for row in saved["rows"]) - 1
    _assert_nothing_left(short_tmp, mark)


def test_a_check_out_of_time_fails_the_run_and_leaves_nothing(tmp_path, short_tmp):
    mark = uuid.uuid4().hex
    env = _env(tmp_path, short_tmp, mark)
    env["GPU_CHECK_SCALE"] = "0.02"  # one second a check: the trace's target is still importing torch
    code, out = _run(env, scaled(120))
    assert code != 0, out
    assert _table(out)["trace"][0] == "timeout", out
    assert "failed: trace" in out, out
    _assert_nothing_left(short_tmp, mark)


def test_an_interrupted_run_kills_and_reaps_every_process_it_started(tmp_path, short_tmp):
    mark = uuid.uuid4().hex
    popen = subprocess.Popen(["bash", SCRIPT], cwd=REPO, env=_env(tmp_path, short_tmp, mark), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + scaled(60)
        while not _targets(mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _targets(mark), "the first check started no target within %.0f s" % scaled(60)
        popen.send_signal(signal.SIGTERM)
        assert popen.wait(scaled(30)) == 143
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()
    _assert_nothing_left(short_tmp, mark)
