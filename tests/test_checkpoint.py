"""``probe T checkpoint``: the file restores the same weights, optimizer and RNG in another process; a
crash mid-write never harms the file already at the path; refused when eval is off; FSDP2 shards."""

import glob
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from procs import REPO, TARGETS, run_cli, running, spawn, target_env

torch = pytest.importorskip("torch")

from torch_job import TORCHRUN, torchrun_job  # noqa: E402


def _sha256(path: str) -> str:
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


def _checkpoint(pid: int, path: str, *options: str) -> dict:
    done = run_cli(str(pid), "checkpoint", path, "--json", *options)
    assert done.code == 0, done.err
    return json.loads(done.out)


def _eval(pid: int, code: str) -> str:
    done = run_cli(str(pid), "eval", code)
    assert done.code == 0, done.err
    return done.out.strip()


def _in_fresh_python(code: str) -> str:
    """Run ``code`` in a separate interpreter (no agent); its stdout."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60,
                          env=target_env(probe=False), cwd=REPO)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture(scope="module")
def idle_trainer():
    """One ``train.py --idle`` (a torch import: seconds under load) for the tests that only save it and read
    it: none arms its gate, changes its limits or kills it (those start their own)."""
    with running("train.py", "--idle") as proc:
        yield proc


def test_the_file_restores_the_same_weights_optimizer_and_rng(tmp_path, idle_trainer):
    path, ref = str(tmp_path / "ck.pt"), str(tmp_path / "ref.pt")
    proc = idle_trainer
    saved = _checkpoint(proc.pid, path)
    _eval(proc.pid, "torch.save({'model': model.state_dict(), 'opt': optimizer.state_dict()}, %r)" % ref)
    # the RNG's state is put back after the draws: the target is as it was for the next test
    draws = _eval(proc.pid, "g = torch.get_rng_state(); x = torch.rand(3).tolist(); torch.set_rng_state(g); x")
    assert saved["path"] == path and saved["bytes"] == os.path.getsize(path) and saved["sha256"] == _sha256(path)
    assert os.stat(path).st_mode & 0o777 == 0o600  # the weights are the owner's alone, whatever the umask
    assert saved["models"] == [{"name": "model", "tensors": 10, "parameters": 684}]
    assert saved["optimizers"] == [{"name": "optimizer", "class": "Adam", "param_groups": 1}]
    assert (saved["step"], saved["step_source"]) == (4, "__main__.step")
    assert saved["rng"] == ["numpy", "python", "torch"]
    out = _in_fresh_python("""
        import importlib.util, torch
        spec = importlib.util.spec_from_file_location("train", %r)
        train = importlib.util.module_from_spec(spec); spec.loader.exec_module(train)
        ck = torch.load(%r)  # weights_only: plain tensors and containers only
        ref = torch.load(%r, weights_only=False)
        model = train.MLP(); model.load_state_dict(ck["models"]["model"])
        for name, value in ref["model"].items():
            if torch.is_tensor(value):
                assert torch.equal(model.state_dict()[name], value), name
        optimizer = torch.optim.Adam(model.parameters()); optimizer.load_state_dict(ck["optimizers"]["optimizer"])
        for index, state in ref["opt"]["state"].items():
            assert torch.equal(optimizer.state_dict()["state"][index]["exp_avg"], state["exp_avg"])
        torch.set_rng_state(ck["rng"]["torch"])
        print(ck["format"], torch.rand(3).tolist())
    """ % (os.path.join(TARGETS, "train.py"), path, ref))
    assert out == "probe.checkpoint/1 %s" % draws


def test_rank_in_the_path_and_named_objects(tmp_path):
    with running("train.py", "--idle", env=target_env(RANK="3")) as proc:
        saved = _checkpoint(proc.pid, str(tmp_path / "ck-{rank}.pt"), "--model", "model", "--optimizer", "optimizer")
        assert saved["path"] == str(tmp_path / "ck-3.pt") and os.path.exists(saved["path"])
        assert [m["name"] for m in saved["models"]] == ["model"]
        done = run_cli(str(proc.pid), "checkpoint", str(tmp_path / "x.pt"), "--model", "no_such_model")
        assert done.code == 2 and "NameError" in done.err, done.err
        done = run_cli(str(proc.pid), "checkpoint", str(tmp_path / "x.pt"), "--model", "optimizer")
        assert done.code == 2 and "not a torch.nn.modules.module.Module" in done.err, done.err
        done = run_cli(str(proc.pid), "checkpoint", str(tmp_path / "nodir" / "x.pt"))
        assert done.code == 2 and "does not exist" in done.err, done.err
    assert not os.path.exists(tmp_path / "x.pt")


def test_refused_when_eval_is_off(tmp_path):
    with running("train.py", "--idle", env=target_env(PROBE_EVAL="0")) as proc:
        done = run_cli(str(proc.pid), "checkpoint", str(tmp_path / "ck.pt"))
    assert done.code == 4 and "switched off with eval" in done.err and "writes files" in done.err, done.err
    assert os.listdir(tmp_path) == []


def test_sigkill_mid_write_leaves_the_old_file(tmp_path, idle_trainer):
    path, entered = str(tmp_path / "ck.pt"), str(tmp_path / "entered")
    proc = spawn("train.py", ["--idle"])
    try:
        old = _checkpoint(proc.pid, path)["sha256"]
        _eval(proc.pid, "model.gate.gate.path = %r; model.gate.gate.armed = True" % entered)
        cli = subprocess.Popen([sys.executable, "-m", "probe", str(proc.pid), "checkpoint", path, "--overwrite"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=target_env(probe=False), cwd=REPO)
        try:
            deadline = time.monotonic() + 30
            while not os.path.exists(entered):  # the target writes it from inside torch.save, then blocks
                assert time.monotonic() < deadline and cli.poll() is None, "the checkpoint never reached torch.save"
                time.sleep(0.01)
            assert glob.glob(str(tmp_path / (".ck.pt.probe-%d-*.tmp" % proc.pid))), os.listdir(tmp_path)
            os.kill(proc.pid, signal.SIGKILL)
            proc.popen.wait(10)
            _, err = cli.communicate(timeout=30)
        finally:
            if cli.poll() is None:
                cli.kill()
                cli.communicate(timeout=10)
        assert cli.returncode != 0 and b"died while answering" in err, err
    finally:
        proc.kill()
    assert _sha256(path) == old
    assert torch.load(path)["format"] == "probe.checkpoint/1"
    _checkpoint(idle_trainer.pid, path, "--overwrite")  # the next checkpoint there (another process's) removes
    # the dead one's leftover
    assert sorted(os.listdir(tmp_path)) == ["ck.pt", "entered"]


def test_death_at_an_exact_byte_mid_write_leaves_the_old_file(tmp_path):
    path = str(tmp_path / "ck.pt")
    with running("train.py", "--idle", "--die-on-fsize") as proc:
        saved = _checkpoint(proc.pid, path)
        limit = saved["bytes"] // 2
        _eval(proc.pid, "import resource; resource.setrlimit(resource.RLIMIT_FSIZE, (%d, %d))" % (limit, limit))
        done = run_cli(str(proc.pid), "checkpoint", path, "--overwrite")
        assert done.code != 0
        assert proc.popen.wait(10) == -signal.SIGXFSZ  # killed by the kernel while writing byte `limit`
    leftovers = glob.glob(str(tmp_path / ".ck.pt.probe-*.tmp"))
    assert len(leftovers) == 1 and os.path.getsize(leftovers[0]) == limit
    assert _sha256(path) == saved["sha256"]


@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun (torch) is not installed")
def test_fsdp2_ranks_save_their_own_shards_without_a_collective(tmp_path):
    path = str(tmp_path / "ck-{rank}.pt")
    with torchrun_job("dist_train.py", ["--fsdp"], TORCH_FR_BUFFER_SIZE="256") as ranks:
        sums = {}
        for rank, pid in sorted(ranks.items()):
            before = _eval(pid, "import torch.distributed as d; d.get_rank()")
            assert before == str(rank)
            recorded = "SELECT count(*) AS n FROM torch.flight_recorder"
            count = run_cli(str(pid), "query", recorded, "-f", "csv").out
            # One rank alone: a collective would wait for the other rank forever, and time out.
            saved = _checkpoint(pid, path, "--checkpoint-timeout", "30")
            assert saved["dtensors"] > 0 and saved["rank"] == rank
            assert run_cli(str(pid), "query", recorded, "-f", "csv").out == count  # nothing new recorded
            sums[rank] = _eval(pid, "float(model[0].weight._local_tensor.sum())")
    for rank in (0, 1):
        out = _in_fresh_python("""
            import torch
            ck = torch.load(%r)
            weight = ck["models"]["model"]["0.weight"]
            info = ck["dtensors"]["models/model/0.weight"]
            print(type(weight).__name__, list(weight.shape), info["placements"], info["global_shape"], float(weight.sum()))
        """ % (str(tmp_path / ("ck-%d.pt" % rank)),))
        assert out == "Tensor [8, 8] (Shard(dim=0),) [16, 8] %s" % sums[rank]


def test_a_save_past_its_time_limit_is_stopped_and_the_old_file_stays(tmp_path):
    path, entered = str(tmp_path / "ck.pt"), str(tmp_path / "entered")
    with running("train.py", "--idle") as proc:
        old = _checkpoint(proc.pid, path)["sha256"]
        _eval(proc.pid, "model.gate.gate.path = %r; model.gate.gate.armed = True" % entered)
        done = run_cli(str(proc.pid), "checkpoint", path, "--checkpoint-timeout", "1", "--overwrite")
        assert done.code == 5 and "did not finish within 1 s" in done.err, done.err
        _eval(proc.pid, "model.gate.gate.armed = False")
        assert _sha256(path) == old
        again = run_cli(str(proc.pid), "query", "SELECT count(*) AS n FROM torch.parameters", "-f", "csv")
        assert again.code == 0 and again.out.split() == ["n", "6"]  # the agent serves on


def test_taken_between_steps_when_the_job_steps_and_concurrently_when_it_does_not(tmp_path, idle_trainer):
    with running("train.py") as proc:  # keeps training: the save waits for the next optimizer step
        saved = _checkpoint(proc.pid, str(tmp_path / "steps.pt"))
        assert saved["taken"].startswith("between optimizer steps"), saved["taken"]
        assert _eval(proc.pid, "1 + 1") == "2"  # and the loop went on
        saved = _checkpoint(proc.pid, str(tmp_path / "asked.pt"), "--concurrent")
        assert saved["taken"] == "concurrently with the training loop (as asked)", saved["taken"]
    # the idle one makes no step, as a hung job: saved concurrently, said so
    started = time.monotonic()
    saved = _checkpoint(idle_trainer.pid, str(tmp_path / "idle.pt"))
    assert "no optimizer step came within 2 s" in saved["taken"], saved["taken"]
    assert time.monotonic() - started < 30
    restored = _in_fresh_python("""
        import torch
        print(sorted(torch.load(%r, weights_only=True)["models"]))
    """ % str(tmp_path / "steps.pt"))
    assert restored.startswith("["), restored
