"""Step extras (issue 36): what a rank's progress file carries beside its steps (probe.tables.torch.step_extras)
and the node helper serves at /metrics. A real 2-rank torchrun gloo job that takes its batches from a
DataLoader (tests/targets/dist_loader_steps.py), its helper scraped: the optimizer's lr, the collective
sequence number advancing, data wait; no CUDA series on the CPU. Single processes: PROBE_STEP_EXTRAS=0 leaves
the file at its 64 bytes; a torch program that steps no optimizer is left as it was (no file, its DataLoader
untouched); a loop whose epochs end in StopIteration and whose dataset raises goes on as it did, timed. The CUDA-memory alert's rule on a live process's progress file written as a rank on a GPU would
write it (this machine has none: bench/gpu_check.sh checks the real thing)."""

import ast
import os
import signal
import subprocess
import time
from typing import Any, Dict, Iterator, List

import pytest

from probe import _paths
from probe.tables.torch import step_extras
from probe.tables.torch.steps import PROGRESS, PROGRESS_MAGIC, PROGRESS_VERSION, read_progress
from procs import TARGETS, Proc, run_cli, running, scaled, target_env
from test_alerts import _Receiver
from test_metrics import TORCHRUN, _free_port, _free_ports, _get, _samples, _until, needs_client, needs_torchrun
from torch_job import ready_lines

LR = 0.0125


@pytest.fixture(scope="module")
def job() -> Iterator[Dict[str, Any]]:
    if not os.path.exists(TORCHRUN):
        pytest.skip("torchrun (torch) is not installed")
    port, metrics = _free_ports(2), _free_port()
    launcher = subprocess.Popen([TORCHRUN, "--nproc-per-node=2", "--master-port=%d" % _free_port(),
                                 os.path.join(TARGETS, "dist_loader_steps.py")], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True,
                                env=target_env(probe=False, PROBE_PORT="127.0.0.1:%d" % port, LR=str(LR),
                                               PROBE_METRICS_PORT=str(metrics), PROBE_METRICS_EVERY="0"))
    output = Proc(launcher, "torchrun dist_loader_steps.py")
    try:
        ranks = {int(w[2]): int(w[1]) for w in ready_lines(output, 2, time.monotonic() + scaled(90))}
        yield {"ranks": ranks, "url": "http://127.0.0.1:%d/metrics" % metrics}
    finally:
        from probe.reader.proc import children

        for pid in children(launcher.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        launcher.wait(20)
        for stream in (launcher.stdout, launcher.stderr):
            if stream:
                stream.close()


def _by_rank(samples: List[Dict[str, Any]], name: str) -> Dict[str, float]:
    return {s["labels"]["rank"]: s["value"] for s in samples if s["name"] == name}


@needs_client
@needs_torchrun
def test_the_helper_serves_each_ranks_lr_collective_sequence_and_data_wait(job: Dict[str, Any]) -> None:
    wanted = ("probe_lr", "probe_collective_seq", "probe_data_wait_seconds", "probe_data_waited_seconds_total",
              "probe_step_extras_age_seconds")

    def all_there() -> List[Dict[str, Any]]:
        samples = _samples(_get(job["url"]).decode("utf-8"))
        return samples if all(set(_by_rank(samples, n)) == {"0", "1"} for n in wanted) else []

    first = _until(all_there, scaled(60), "the step extras of ranks 0 and 1 at /metrics")
    assert _by_rank(first, "probe_lr") == {"0": LR, "1": LR}, first
    assert all(v > 0 for v in _by_rank(first, "probe_data_waited_seconds_total").values()), first
    assert all(v >= 0 for v in _by_rank(first, "probe_data_wait_seconds").values()), first
    assert not [s for s in first if s["name"].startswith("probe_cuda_")], "CUDA series of a CPU job"
    seq = _by_rank(first, "probe_collective_seq")
    assert all(v >= 3 for v in seq.values()), seq  # 2 all_reduces a step, 3 steps made at least

    def advanced() -> List[Dict[str, Any]]:
        samples = _samples(_get(job["url"]).decode("utf-8"))
        now = _by_rank(samples, "probe_collective_seq")
        waited = _by_rank(samples, "probe_data_waited_seconds_total")
        moved = all(now.get(r, 0) > seq[r] for r in seq) and all(
            waited.get(r, 0) > v for r, v in _by_rank(first, "probe_data_waited_seconds_total").items())
        return samples if moved else []

    later = _until(advanced, scaled(30), "the collective sequence numbers and data wait advancing between scrapes")
    assert _by_rank(later, "probe_data_wait_seconds")["0"] > 0  # each batch sleeps in the dataset


def _progress_file(pid: int) -> Any:
    path = _paths.progress_path(pid)
    return _until(lambda: read_progress(path), scaled(30), "the progress file of %d" % pid), path


def test_extras_off_leave_the_file_its_64_bytes_and_on_hold_the_optimizers_lr(tmp_path) -> None:
    log = str(tmp_path / "lr.log")
    with running("lr_loop.py", log, "--sched", "none", env=target_env(PROBE_STEP_EXTRAS="0")) as off, \
            running("lr_loop.py", log + "2", "--sched", "none") as on:
        head, path = _progress_file(off.pid)
        assert head.pid == off.pid and os.path.getsize(path) == PROGRESS.size
        assert step_extras.read_extras(path) is None
        head, path = _progress_file(on.pid)
        extras = _until(lambda: step_extras.read_extras(path), scaled(30), "the extras of %d" % on.pid)
        assert extras.lr == 0.01 and extras.cuda_reserved is None and extras.collective_seq is None, extras
        assert extras.batches == 0 and extras.steps >= 1  # DataLoader's __next__ wrapped (torch loads it), none called


def test_a_torch_program_that_steps_no_optimizer_is_left_as_it_was() -> None:
    with running("no_optimizer.py") as proc:
        # the agent's accept thread has woken a few times by now (its socket answers); still no file, no wrapper
        assert run_cli(str(proc.pid), "health").code == 0
        code = ("import sys; m = sys.modules['torch.utils.data.dataloader']; "
                "(m._BaseDataLoaderIter.__next__.__module__, 'torch.distributed' in sys.modules)")
        answer = run_cli(str(proc.pid), "eval", code)
        assert answer.out.startswith("('torch.utils.data.dataloader', "), answer
        assert not os.path.exists(_paths.progress_path(proc.pid))


def _fake_gpu_file(pid: int, reserved: int, total: int, number: int) -> str:
    """A progress file for live process ``pid`` laid out as a GPU rank's agent writes it (its head, then the
    extras' section with CUDA memory), for the rule alone: no GPU here."""
    path = _paths.progress_path(pid)
    ticks = _paths.process_start_ticks(str(pid))
    now = time.monotonic()
    raw = bytearray(step_extras.OFFSET + step_extras.SECTION.size)
    PROGRESS.pack_into(raw, 0, PROGRESS_MAGIC, PROGRESS_VERSION, pid, 10, now, 0.1, now - 1, ticks)
    step_extras.SECTION.pack_into(raw, step_extras.OFFSET, step_extras.MAGIC, step_extras.VERSION,
                                  step_extras.CUDA, number, now, 10, 0.0, reserved // 2, reserved, total, 0, 0, 0.0,
                                  0.0, 0, number)
    with open(path + ".tmp", "wb") as handle:
        handle.write(bytes(raw))
    os.replace(path + ".tmp", path)
    return path


class _Rank:
    def __init__(self, rank: int, pid: int) -> None:
        self.rank, self.pid, self.steps = rank, pid, 10
        self.ticks = _paths.process_start_ticks(str(pid))


class _Members:
    def node_key(self) -> int:
        return 0


class _Helper:
    base_port = 9700
    members = _Members()


class _Watch:
    helper = _Helper()


def test_the_cuda_memory_rule_fires_once_a_crossing_over_the_fraction(monkeypatch) -> None:
    from probe.host import alert_memory
    from probe.host.alerts import Alerts, Hook

    monkeypatch.setenv("PROBE_ALERT_CUDA_EVERY_S", "0")
    monkeypatch.setenv("PROBE_ALERT_CUDA_FRACTION", "0.95")
    receiver = _Receiver()
    lines: List[str] = []
    gib = 2 ** 30
    try:
        with running("idle.py", probe=False) as proc:  # a live process whose file it is (pid, start time)
            alerts = Alerts([Hook("http://127.0.0.1:%d/hook" % receiver.port, False)], lines.append, cooldown=0)
            rank = _Rank(3, proc.pid)
            try:
                for reserved in (70, 77, 78, 79, 60, 77):  # of 80 GiB: over at 77 (96 %), under at 60, over again
                    _fake_gpu_file(proc.pid, reserved * gib, 80 * gib, 2 * reserved)
                    alert_memory.look(alerts, _Watch(), [rank])
                assert alerts.drain(scaled(10)), lines
            finally:
                os.unlink(_paths.progress_path(proc.pid))
    finally:
        receiver.close()
    posts = receiver.of("/hook", "cuda_memory")
    assert len(posts) == 2 and [p["cuda_reserved_bytes"] for p in posts] == [77 * gib] * 2, posts
    assert posts[0]["culprits"] == [3] and posts[0]["pid"] == proc.pid, posts
    assert posts[0]["summary"].startswith("rank 3's CUDA memory reserved is 77.0 GiB of its device's 80.0 GiB"), posts
    assert not alert_memory.over(None, 0.95) and not lines, lines


def test_the_timed_next_passes_stop_iteration_and_the_datasets_errors_through() -> None:
    with running("loader_epochs.py") as proc:
        pid = str(proc.pid)
        code = ("import sys, __main__; m = sys.modules['torch.utils.data.dataloader']; "
                "(m._BaseDataLoaderIter.__next__.__name__, __main__.ended, __main__.caught)")

        def state() -> Any:
            answer = run_cli(pid, "eval", code)
            assert answer.code == 0, answer
            return ast.literal_eval(answer.out.strip())

        wrapped = _until(lambda: (lambda s: s if s[0] == "_timed_next" else None)(state()), scaled(30),
                         "DataLoader's __next__ timed (after the step counter's first refresh)")
        later = _until(lambda: (lambda s: s if s[1] >= wrapped[1] + 2 and s[2] >= wrapped[2] + 2 else None)(state()),
                       scaled(60), "epochs ending in StopIteration and errors caught, timed")
        assert proc.alive(), later
        # the extras are written at a step at most once a second: the batches timed show at a later refresh
        extras = _until(lambda: (lambda e: e if e is not None and e.batches and e.data_wait_total > 0 else None)(
            step_extras.read_extras(_paths.progress_path(proc.pid))), scaled(60), "the timed batches in the extras")
        assert proc.alive(), extras
