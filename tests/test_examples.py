"""The training-job examples in ``examples/``: each is started as its docstring says, its documented probe
commands run through the real CLI, and they must find the cause the example planted.

The commands are read from the docstring itself, so a docstring that drifts from what probe does fails
here. Each example runs in its own process group, killed as a whole at the end: a DataLoader worker
goes with its trainer.
"""

import ast
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional

import pytest

from procs import REPO, CliResult, Proc, run_cli, scaled, target_env, wait_for_socket

pytest.importorskip("torch", reason="the training examples need torch (CPU build, torch==2.13.0)")

EXAMPLES = os.path.join(REPO, "examples")
_STARTS = re.compile(r"^(probe |python |(\w+=\S* )+python )")


def documented_commands(script: str) -> List[List[str]]:
    """The shell commands of ``script``'s docstring: indented lines that start with ``probe``, ``python`` or
    ``VAR=... python``, each with its continuation lines, split as a shell would (``# ...`` dropped)."""
    with open(os.path.join(EXAMPLES, script)) as handle:
        doc = ast.get_docstring(ast.parse(handle.read())) or ""
    blocks: List[List[str]] = []
    current: Optional[List[str]] = None
    for line in doc.splitlines():
        if not line.startswith("    "):
            current = None
        elif _STARTS.match(line.strip()):
            current = [line]
            blocks.append(current)
        elif current is not None:
            current.append(line)
    return [shlex.split("\n".join(lines), comments=True) for lines in blocks]


@dataclass
class Example:
    """A running example and the commands its docstring documents."""

    proc: Proc
    commands: List[List[str]]
    subs: Dict[str, str]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def command(self, *words: str) -> List[str]:
        """The one documented command that contains every one of ``words``, with $PID etc. filled in."""
        found = [c for c in self.commands if all(w in " ".join(c) for w in words)]
        if len(found) > 1:  # "probe $W backtrace" beside "probe $W backtrace --native": the exact one
            found = [c for c in found if " ".join(c) == " ".join(words)]
        assert len(found) == 1, "%s: %d documented commands contain %s" % (self.proc.script, len(found), words)
        filled = []
        for arg in found[0]:
            for name in sorted(self.subs, key=len, reverse=True):
                arg = arg.replace(name, self.subs[name])
            filled.append(arg)
        return filled

    def probe(self, *words: str, extra: tuple = (), timeout: float = 60.0) -> CliResult:
        """Run the documented ``probe ...`` command through the real CLI (``extra`` appended)."""
        argv = self.command(*words)
        assert argv[0] == "probe", argv
        return run_cli(*argv[1:], *extra, timeout=timeout)

    def rows(self, *words: str) -> List[dict]:
        done = self.probe(*words, extra=("-f", "json"))
        assert done.code == 0, done.err
        return json.loads(done.out)


def _group(pgid: int) -> List[int]:
    """Live processes of the process group ``pgid`` (zombies left out)."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open("/proc/%s/stat" % name) as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(name))
    return pids


def _stop_group(popen: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM the example's process group, SIGKILL it once half of ``timeout`` has passed; reap the leader
    and wait until no member is left. The pgid stays ours while the leader is unreaped or a member lives."""
    deadline = time.monotonic() + timeout
    sig = signal.SIGTERM
    while popen.poll() is None or _group(popen.pid):
        assert time.monotonic() < deadline, "process group %d outlived %.0f s: %s" % (popen.pid, timeout,
                                                                                    _group(popen.pid))
        if time.monotonic() > deadline - timeout / 2:
            sig = signal.SIGKILL
        try:
            os.killpg(popen.pid, sig)
        except ProcessLookupError:
            pass
        try:
            popen.wait(0.2)
        except subprocess.TimeoutExpired:
            pass
    for stream in (popen.stdout, popen.stderr):
        if stream:
            stream.close()


@pytest.fixture
def example(tmp_path) -> Iterator[Callable[..., Example]]:
    """Start ``examples/<script>`` as its docstring's first command says (its environment variables
    included), in a new process group; wait for ``READY <pid>`` and the agent's socket; stop it at the end."""
    started: List[subprocess.Popen] = []

    def start(script: str, timeout: float = 30.0) -> Example:
        commands = documented_commands(script)
        launch = [c for c in commands if c[0] != "probe" and "examples/%s" % script in c]
        assert len(launch) == 1, "%s documents no start command" % script
        words = launch[0]
        at = words.index("python")
        env = target_env(probe=False, **dict(w.split("=", 1) for w in words[:at]))
        argv = [sys.executable, *[w for w in words[at + 1:] if w != "&"]]
        popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO,
                                 start_new_session=True)
        started.append(popen)
        proc = Proc(popen, script)
        line = proc.read_line(timeout)
        while not line.startswith("READY"):
            proc.lines.append(line)
            line = proc.read_line(timeout)
        assert int(line.split()[1]) == popen.pid
        wait_for_socket(popen.pid, timeout)
        return Example(proc, commands, {"$PID": str(popen.pid), "/tmp/ck.pt": str(tmp_path / "ck.pt")})

    yield start
    for popen in started:
        _stop_group(popen)


def wait_for(what: str, check: Callable[[], object], timeout: float = 30.0) -> object:
    """Poll ``check`` until it returns something true; fail after ``timeout`` seconds (scaled to the
    machine), naming ``what``."""
    timeout = scaled(timeout)
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, "waited %.0f s for %s" % (timeout, what)
        time.sleep(0.1)


def traced_steps(pid: int, at_least: int) -> None:
    def seen() -> bool:
        done = run_cli(str(pid), "trace", "status", "--json")
        assert done.code == 0, done.err
        return json.loads(done.out)["steps_seen"] >= at_least

    wait_for("%d traced steps of %d" % (at_least, pid), seen)


def test_slow_step_names_the_module_whose_time_grows(example):
    job = example("slow_step.py")
    # Load the agent's DuckDB first: the import holds the GIL in bursts, and the optimizer's many small
    # ops pay for each hand-over; read in the same window, Adam's steps could outweigh `memory` (seen:
    # 8.5 ms against 5.2 ms a step, 60 steps in). By 120 steps `memory` takes ~10 ms a step.
    assert run_cli(str(job.pid), "query", "SELECT 1").code == 0
    assert job.probe("trace", "start").code == 0
    traced_steps(job.pid, 120)
    top = job.rows("ORDER BY total_time DESC")
    assert (top[0]["module"], top[0]["stage"]) == ("memory", "forward"), top
    growth = job.rows("from_step")
    assert len(growth) >= 3, growth
    assert growth[-2]["ms"] > 1.3 * growth[0]["ms"], growth  # the last bucket may be a step or two
    shapes = [job.probe("bank.shape") for _ in range(2)]
    assert all(s.code == 0 for s in shapes), shapes
    rows = [int(re.search(r"torch.Size\(\[(\d+), 128\]\)", s.out).group(1)) for s in shapes]
    assert rows[1] > rows[0], shapes
    assert job.probe("trace", "stop").code == 0


def test_memory_growth_shows_rss_rising_and_the_list_of_graphs(example):
    job = example("memory_growth.py")
    activations = lambda: sum(r["n"] for r in job.rows("torch.tensors") if r["shape"] == "[128, 512]")  # noqa: E731
    before = activations()  # (this first query also loads the agent's DuckDB, before the trace starts)
    assert job.probe("trace", "start").code == 0
    traced_steps(job.pid, 22)
    memory = job.rows("memory_range")
    assert len(memory) == 20, memory
    peaks = [r["peak_memory"] for r in memory]
    assert peaks[-1] - peaks[0] > 5, memory  # ~0.5 MB of saved activations per step
    assert sum(b >= a for a, b in zip(peaks, peaks[1:])) >= 15, memory
    kept = job.rows("python.locals")
    assert [r["name"] for r in kept] == ["val_history"] and "Tensor(shape=[]" in kept[0]["value"], kept
    done = job.probe("val_history[-1].grad_fn")
    assert done.code == 0 and "NllLossBackward0" in done.out, done
    assert activations() >= before + 2 * 22  # two [128, 512] activations more for every step


def test_nan_loss_is_located_by_anomalies_and_parameters(example):
    job = example("nan_loss.py")
    first = job.rows("torch.anomalies")
    assert len(first) == 1, first
    assert (first[0]["step"], first[0]["module"], first[0]["stage"]) == (31, "Net", "input"), first
    assert first[0]["kind"] == "nan" and first[0]["nan_count"] == 16 and first[0]["shape"] == "[32, 16]"
    params = job.rows("torch.parameters")
    assert len(params) == 6 and all(p["has_nan"] for p in params), params
    done = job.probe("isnan().any()")
    assert done.code == 0 and done.out.strip() == "[1000]", done


def test_live_lr_is_changed_between_steps(example):
    job = example("live_lr.py")
    before = job.rows("params_of")
    assert [(r["group_index"], r["lr"]) for r in before] == [(0, 0.0001)], before
    done = job.probe("--between-steps")
    assert done.code == 0, done.err
    after = job.rows("SELECT class, group_index, lr FROM")
    assert [(r["group_index"], r["lr"]) for r in after] == [(0, 0.05)], after
    losses = {"0.0001": [], "0.05": []}  # type: Dict[str, List[float]]
    while not losses["0.05"] or losses["0.05"][-1] > 0.01:  # the loop's own log: the new rate, a falling loss
        match = re.match(r"step \d+ lr (\S+) loss (\S+)", job.proc.read_line(timeout=20))
        assert match, job.proc.lines
        losses[match.group(1)].append(float(match.group(2)))
        assert len(losses["0.05"]) < 30, losses
    assert all(loss > 1 for loss in losses["0.0001"]), losses


def test_dataloader_stall_backtraces_the_trainer_and_its_worker(example):
    job = example("dataloader_stall.py")
    done = job.probe("backtrace", "$PID")
    assert done.code == 0, done.err
    main = done.out.split("\n\n")[0]
    assert '"MainThread"' in main and "_try_get_data" in main and "Queue.get" in main, done.out
    assert "main (%s" % os.path.join(EXAMPLES, "dataloader_stall.py") in main, done.out
    done = job.probe("active_children")
    assert done.code == 0, done.err
    [(name, worker)] = ast.literal_eval(done.out.strip())
    job.subs["$WORKER_PID"] = str(worker)
    listed = [r for r in json.loads(job.probe("probe list", extra=("--json",)).out) if r["pid"] == worker]
    assert len(listed) == 1 and "inject" in json.dumps(listed[0]), listed

    plain = job.probe("probe $WORKER_PID backtrace")
    assert plain.code == 0 and "no agent in process %d" % worker in plain.err and "read from outside" in plain.err
    outside = job.probe("--native")
    assert outside.code == 0, outside.err
    for frame in ("_worker_loop", "Samples.__getitem__", "read_sample"):
        assert frame in plain.out and frame in outside.out, (plain.out, outside.out)
    assert "[C] " in outside.out and "[C] " not in plain.out
    if shutil.which("gdb") is None:
        pytest.skip("gdb is missing: probe WORKER_PID inject cannot run")
    assert job.probe("inject").code == 0
    index = job.rows("python.locals")
    values = {r["func"]: r["value"] for r in index}
    assert values["read_sample"] == values["Samples.__getitem__"] == "700", index
    assert values["_worker_loop"].startswith("[672, 673,"), index  # the batch it fetches

    job.proc.popen.terminate()  # the trainer alone: its stalled worker notices and leaves
    job.proc.popen.wait(10)
    wait_for("the worker to leave with its trainer", lambda: worker not in _group(job.pid), timeout=10)


def test_hung_job_checkpoint_holds_the_weights(example):
    job = example("hung_checkpoint.py")
    stacks = wait_for("the main thread in Queue.get", lambda: (lambda out: out if "Queue.get" in out else "")(
        job.probe("backtrace").out), timeout=10)
    assert "train (" in str(stacks).split("\n\n")[0] and '"prefetch"' not in str(stacks), stacks
    stuck = run_cli(str(job.pid), "eval", "--on", "main", "--start-within", "0.5", "step")
    assert stuck.code == 5, stuck  # the docstring's claim: the main thread never takes a snippet
    done = job.probe("$PID checkpoint")
    assert done.code == 0 and "no optimizer step came within 2 s" in done.out, done
    digest = ("import hashlib; h = hashlib.sha256(); "
              "[h.update(t.numpy().tobytes()) for t in {sd}.values()]; print(h.hexdigest())")
    live = run_cli(str(job.pid), "eval", digest.format(sd="model.state_dict()"))
    assert live.code == 0, live.err
    load = job.command("python", "torch.load")
    shown = subprocess.run([sys.executable, *load[1:]], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == "40 ['0.weight', '0.bias', '2.weight', '2.bias']", shown.stdout
    path = job.subs["/tmp/ck.pt"]
    saved = subprocess.run([sys.executable, "-c", "import torch; sd = torch.load(%r, weights_only=True)"
                            "['models']['model']; " % path + digest.format(sd="sd")],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
    assert saved.returncode == 0 and saved.stdout == live.out, (saved, live)


def test_the_demo_shows_its_hung_training_diagnosed_stuck_with_the_deadlock_it_has(tmp_path):
    """examples/demo.py runs examples/stuck.py and the CLI against it: diagnose says what the example
    planted (the trainer and the checkpoint writer deadlock on two locks), and every command succeeds."""
    done = subprocess.run([sys.executable, os.path.join(EXAMPLES, "demo.py")], capture_output=True, text=True,
                          timeout=scaled(180), env=target_env(probe=False), cwd=str(tmp_path))
    assert done.returncode == 0 and "all commands succeeded" in done.stdout, (done.stdout[-3000:], done.stderr)
    verdict = done.stdout.split("$ probe ", 1)[1].split("\n", 2)[1]
    assert verdict.startswith("STUCK: process ") and "a deadlock: thread MainThread waits for metrics, held by " \
        "thread checkpoint-writer; thread checkpoint-writer waits for weights, held by thread MainThread" in verdict, \
        verdict
