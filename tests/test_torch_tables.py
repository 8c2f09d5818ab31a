"""The torch.* tables on real training processes, through the CLI: NaN gradients, live hyperparameters,
tensors, memory, and a 2-rank gloo job for torch.distributed and the Flight Recorder."""

import csv
import io
import json
import math
import os

import pytest

import probe
from procs import run_cli, running

torch = pytest.importorskip("torch")

from torch_job import TORCHRUN, torchrun_job  # noqa: E402

TORCH_TABLES = ("torch.parameters", "torch.optimizers", "torch.tensors", "torch.memory", "torch.distributed",
                "torch.flight_recorder")


def _query(pid: int, sql: str) -> list:
    done = run_cli(str(pid), "query", sql, "-f", "csv")
    assert done.code == 0, done.err
    return list(csv.DictReader(io.StringIO(done.out)))


def _eval(pid: int, code: str) -> str:
    done = run_cli(str(pid), "eval", code)
    assert done.code == 0, done.err
    return done.out.strip()


@pytest.fixture(scope="module")
def trainer():
    """A job that keeps training (Adam), model and optimizer in __main__."""
    with running("train.py") as proc:
        yield proc


@pytest.fixture(scope="module")
def idle_trainer():
    """Trained 5 steps, then stopped: values stay put."""
    with running("train.py", "--idle") as proc:
        yield proc


def test_without_torch_the_tables_say_so_and_import_nothing():
    with running("train.py", "--no-torch") as proc:
        done = run_cli(str(proc.pid), "query", "SELECT name, grad_norm FROM torch.parameters")
        assert done.code == 2  # the request does not apply to this target (README: exit codes)
        lines = done.err.strip().splitlines()
        assert len(lines) == 1 and "torch is not loaded in the target" in lines[0], done.err
        client = probe.connect(str(proc.pid))
        for table in TORCH_TABLES:
            with pytest.raises(probe.ProbeError) as caught:
                client.query_rows("SELECT * FROM %s" % table)
            assert caught.value.code == "torch_not_loaded", table
        code = ("import sys, probe\nclass Net: pass\nnet = Net()\nprobe.watch(net)\n"
                "print('torch' in sys.modules)")
        assert _eval(proc.pid, code) == "False"


def test_nan_gradients_are_found():
    with running("train.py", "--poison") as proc:
        rows = _query(proc.pid, "SELECT name, grad_norm FROM torch.parameters WHERE grad_has_nan OR grad_has_inf")
        names = {r["name"] for r in rows}
        assert {"fc1.weight", "fc1.bias", "fc2.weight"} <= names, rows
        assert all(math.isnan(float(r["grad_norm"])) for r in rows)
        clean = _query(proc.pid, "SELECT count(*) AS n FROM torch.parameters WHERE has_nan OR has_inf")
        assert clean[0]["n"] == "0"  # the poisoned step stopped before optimizer.step()


def test_parameters_match_the_model(idle_trainer):
    rows = _query(idle_trainer.pid, "SELECT model, name, shape, dtype, device, numel, norm, grad_norm, has_grad "
                                    "FROM torch.parameters ORDER BY name")
    assert [r["name"] for r in rows] == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight", "norm.bias",
                                         "norm.weight"]
    assert {r["model"] for r in rows} == {"model"}
    weight = next(r for r in rows if r["name"] == "fc1.weight")
    assert (weight["shape"], weight["dtype"], weight["device"], weight["numel"]) == ("[32, 16]", "float32", "cpu",
                                                                                     "512")
    expected = float(_eval(idle_trainer.pid, "float(model.fc1.weight.norm())"))
    assert float(weight["norm"]) == pytest.approx(expected, rel=1e-5)
    assert weight["has_grad"] == "True" and float(weight["grad_norm"]) > 0


def test_an_lr_changed_by_eval_shows_at_once(trainer):
    assert _query(trainer.pid, "SELECT group_index, lr, weight_decay FROM torch.optimizers") == [
        {"group_index": "0", "lr": "0.001", "weight_decay": "0.01"}]
    _eval(trainer.pid, "optimizer.param_groups[0]['lr'] = 0.25")
    rows = _query(trainer.pid, "SELECT optimizer, class, lr, beta1, beta2, eps, params, step, params_of "
                               "FROM torch.optimizers")
    assert rows[0]["lr"] == "0.25" and rows[0]["class"] == "torch.optim.adam.Adam"
    assert (rows[0]["beta1"], rows[0]["beta2"], rows[0]["params"], rows[0]["params_of"]) == ("0.9", "0.999", "6",
                                                                                             "model")
    assert int(rows[0]["step"]) >= 5


def test_watched_objects_are_found_under_their_names():
    with running("train.py", "--watch", "--optim", "sgd", "--idle") as proc:
        assert _eval(proc.pid, "'model' in globals() or 'optimizer' in globals()") == "False"
        assert _query(proc.pid, "SELECT DISTINCT model FROM torch.parameters") == [{"model": "net"}]
        assert _query(proc.pid, "SELECT optimizer, momentum, betas FROM torch.optimizers") == [
            {"optimizer": "opt", "momentum": "0.9", "betas": ""}]


def test_tensors_tell_parameters_gradients_and_optimizer_state(idle_trainer):
    rows = _query(idle_trainer.pid, "SELECT device, dtype, count(*), sum(bytes) FROM torch.tensors "
                                    "GROUP BY ALL ORDER BY 4 DESC")
    assert rows[0]["device"] == "cpu" and rows[0]["dtype"] == "float32"
    kinds = _query(idle_trainer.pid, "SELECT kind, owner, bytes, complete FROM torch.tensors WHERE kind <> 'tensor'")
    owners = {(r["kind"], r["owner"]) for r in kinds}
    assert ("parameter", "model.fc1.weight") in owners
    assert ("gradient", "model.fc1.weight") in owners
    assert ("buffer", "model.norm.running_mean") in owners
    assert ("optimizer_state", "optimizer[model.fc1.weight].exp_avg") in owners
    assert next(r for r in kinds if r["owner"] == "model.fc1.weight")["bytes"] == str(512 * 4)
    assert {r["complete"] for r in kinds} == {"True"}


def test_memory_on_a_cpu_job_never_initialises_cuda(idle_trainer):
    rows = _query(idle_trainer.pid, "SELECT * FROM torch.memory")
    assert [r["device"] for r in rows] == ["cpu"]
    assert int(rows[0]["rss_bytes"]) > 10 ** 7 and int(rows[0]["tensors"]) > 10
    assert int(rows[0]["allocated_bytes"]) >= 684 * 4
    assert _eval(idle_trainer.pid, "import torch; torch.cuda.is_initialized()") == "False"


def test_not_distributed_and_no_flight_recorder(idle_trainer):
    assert _query(idle_trainer.pid, "SELECT initialized, backend FROM torch.distributed") == [
        {"initialized": "False", "backend": ""}]
    assert _query(idle_trainer.pid, "SELECT pg, collective_seq_id, op, state FROM torch.flight_recorder "
                                    "ORDER BY collective_seq_id DESC LIMIT 5") == []


def test_every_torch_table_matches_its_schema(idle_trainer):
    client = probe.connect(str(idle_trainer.pid))
    for name in TORCH_TABLES:
        info = client.schema(name)
        assert info.description and all(c.description for c in info.columns), name
        table = client.query("SELECT * FROM %s" % name)  # Arrow: every value checked against its type
        assert table.schema.names == [c.name for c in info.columns], name


@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun (torch) is not installed")
def test_distributed_and_flight_recorder_on_a_gloo_job():
    with torchrun_job("dist_train.py", TORCH_FR_BUFFER_SIZE="64") as ranks:
        seen = {}
        for rank, pid in ranks.items():
            rows = _query(pid, "SELECT initialized, backend, rank, world_size, local_rank, is_default, group_size, "
                               "group_ranks FROM torch.distributed")
            assert rows == [{"initialized": "True", "backend": "gloo", "rank": str(rank), "world_size": "2",
                             "local_rank": str(rank), "is_default": "True", "group_size": "2",
                             "group_ranks": "[0, 1]"}]
            recorded = _query(pid, "SELECT pg, collective_seq_id, op, state FROM torch.flight_recorder "
                                   "ORDER BY collective_seq_id DESC LIMIT 5")
            assert recorded and all(r["op"].startswith("gloo:") for r in recorded), recorded
            assert "gloo:all_reduce" in {r["op"] for r in recorded}
            seen[rank] = [(r["pg"], r["collective_seq_id"], r["op"]) for r in recorded]
        assert seen[0] == seen[1]  # the same collectives, in the same order, on both ranks
        detail = json.loads(run_cli(str(ranks[0]), "query", "SELECT input_sizes, input_dtypes FROM "
                                    "torch.flight_recorder WHERE op = 'gloo:all_reduce' LIMIT 1", "-f", "json").out)
        assert detail == [{"input_sizes": "[[4]]", "input_dtypes": "[\"Float\"]"}]


def test_querying_the_torch_tables_during_training_never_harms_it():
    """Autograd writes .grad and tensors from C++ without the GIL, and zero_grad frees a gradient while
    its parameter still points to it: reading them meanwhile crashed the target (SIGABRT "free():
    corrupted unsorted chunks", SIGSEGV) within a few hundred reads of torch.parameters, in 3 runs of 4."""
    import time as _time

    with running("grad_loop.py", timeout=60) as proc:
        client = probe.connect(str(proc.pid))
        deadline = _time.monotonic() + 15
        queries = 0
        while _time.monotonic() < deadline and queries < 400:
            rows = client.query_rows("SELECT has_grad, grad_norm, note FROM torch.parameters").rows
            assert rows and all(has_grad for has_grad, _, _ in rows), rows  # read at a step boundary: all set
            queries += 1
            if queries % 20 == 0:
                client.query_rows("SELECT kind, count(*) FROM torch.tensors GROUP BY 1")
                client.query_rows("SELECT * FROM torch.memory")
        assert proc.alive(), "the training process died after %d queries" % queries
        assert client.eval("1 + 1").value == "2"
