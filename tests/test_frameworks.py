"""Real training frameworks (issue 19): a Hugging Face Trainer built inside ``main()`` and a Lightning
module, each in its own process on CPU, and each on two ranks (DDP, gloo): the Trainer under torchrun, the
module under Lightning's own ddp launch (``python lightning_train.py``, rank 0 starting rank 1).
probe finds their model, optimizer, scheduler and trainer wherever they live (a local of ``main()``
included), lists each once under a stable name, and its
checkpoint, taken with no option, loads strictly into the model class; the framework formats resume
with the framework itself to the same weights and learning rates as the run that was not stopped."""

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from contextlib import contextmanager
from typing import Iterator

import pytest

from launch import _job, free_ports, tool
from procs import REPO, TARGETS, run_cli, scaled, spawn, target_env

pytest.importorskip("torch")


def _checkpoint(pid: int, path: str, *options: str) -> dict:
    done = run_cli(str(pid), "checkpoint", path, "--json", *options, timeout=scaled(60))
    assert done.code == 0, done.err
    return json.loads(done.out)


def _rows(pid: int, sql: str) -> list:
    done = run_cli(str(pid), "query", sql, "--json", timeout=scaled(60))
    assert done.code == 0, done.err
    return json.loads(done.out)


def _log(path: str) -> dict:
    """global_step -> (lr, weight sum) from a target's log."""
    out = {}
    with open(path) as handle:
        for line in handle:
            step, lr, weights = line.split()
            out[int(step)] = (lr, weights)
    return out


@contextmanager
def _run_to_the_end(script: str, args: list) -> Iterator[None]:
    """The same job started again (without probe) to resume: it must finish on its own. It runs while the
    ``with`` block checks the other files (each its own process: two imports of torch at once, not one after
    the other)."""
    with tempfile.TemporaryFile() as err:
        popen = subprocess.Popen([sys.executable, os.path.join(TARGETS, script), *args], stdout=subprocess.DEVNULL,
                                 stderr=err, env=target_env(probe=False), cwd=REPO)
        try:
            yield
            code = popen.wait(scaled(120))
        finally:
            if popen.poll() is None:
                popen.kill()
                popen.wait(10)
        err.seek(0)
        assert code == 0, err.read().decode("utf-8", "replace")[-3000:]


def _in_fresh_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=scaled(90), env=target_env(probe=False), cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def _same_run_after(step: int, first: dict, resumed: dict, last: int) -> None:
    assert step in first and last in first, sorted(first)
    assert sorted(resumed) == list(range(step + 1, last + 1)), sorted(resumed)
    for at in range(step + 1, last + 1):
        assert resumed[at] == first[at], (at, resumed[at], first[at])


def test_hf_trainer_in_main_is_found_and_its_checkpoints_resume(tmp_path):
    pytest.importorskip("transformers")
    log, resumed_log = str(tmp_path / "run.log"), str(tmp_path / "resumed.log")
    plain, hf_dir, named = str(tmp_path / "ck.pt"), str(tmp_path / "hf-ck"), str(tmp_path / "named.pt")
    proc = spawn("hf_trainer.py", [log, "--max-steps", "14", "--sleep", "0.3"], timeout=scaled(90))
    try:
        pid = proc.pid
        models = _rows(pid, "SELECT DISTINCT model FROM torch.parameters")
        optimizers = _rows(pid, "SELECT DISTINCT optimizer, class FROM torch.optimizers")
        trainers = _rows(pid, "SELECT trainer, kind, max_steps, grad_accumulation, precision, callbacks, model, "
                              "optimizers, schedulers FROM torch.trainer")
        saved = _checkpoint(pid, plain)
        hf = _checkpoint(pid, hf_dir, "-F", "hf")
        by_name = _checkpoint(pid, named, "--model", "trainer.model", "--optimizer", "trainer.optimizer")
        framed = run_cli(str(pid), "eval", "--frame", "MainThread:main", "import __main__; __main__.seen = trainer")
        assert framed.code == 0 and framed.err == "", framed.err  # no false "changed only in the snippet's copy"
        assert run_cli(str(pid), "eval", "type(seen).__name__").out.strip() == "'Trainer'"
        # One model, one optimizer (not AcceleratedOptimizer and AdamW), no activation instances, stable names.
        assert models == [{"model": "model"}], models
        assert optimizers == [{"optimizer": "trainer.optimizer", "class": "torch.optim.adamw.AdamW"}], optimizers
        assert trainers == [{"trainer": "trainer", "kind": "transformers", "max_steps": 14, "grad_accumulation": 1,
                             "precision": "no", "callbacks": "DefaultFlowCallback, Log, PrinterCallback",
                             "model": "model", "optimizers": "trainer.optimizer",
                             "schedulers": "trainer.lr_scheduler"}]
        assert [m["name"] for m in saved["models"]] == ["model"] and by_name["models"][0]["name"] == "trainer.model"
        assert [o["name"] for o in saved["optimizers"]] == ["trainer.optimizer"]
        assert saved["schedulers"] == [{"name": "trainer.lr_scheduler", "class": "LambdaLR"}]
        assert saved["taken"].startswith("between optimizer steps") and hf["taken"].startswith("between optimizer steps")
        assert saved["step_source"] == "trainer global_step" and saved["trainer"]["global_step"] == saved["step"]
        # (beside them the marker by which the ranks of one save know the directory as theirs:
        # probe.tables.torch.checkpoint_files)
        assert sorted(f for f in os.listdir(hf_dir) if not f.startswith(".probe-save-")) == [
            "config.json", "optimizer.pt", "pytorch_model.bin", "rng_state.pth",
                                              "scheduler.pt", "trainer_state.json"]
        # --format hf: transformers' own resume continues exactly as the run that was not stopped (run meanwhile,
        # as that run sleeps through its last steps).
        with _run_to_the_end("hf_trainer.py", [resumed_log, "--max-steps", "14", "--sleep", "0", "--resume", hf_dir]):
            # The default file: a strict load into the model class, and the scheduler and progress of that step.
            out = _in_fresh_python("""
                import sys, torch
                sys.path.insert(0, %r)
                from hf_trainer import tiny_config
                from transformers import GPT2LMHeadModel
                ck = torch.load(%r)
                model = GPT2LMHeadModel(tiny_config())
                model.load_state_dict(ck["models"]["model"], strict=True)
                scheduler = ck["schedulers"]["trainer.lr_scheduler"]
                print(sorted(ck["models"]), scheduler["last_epoch"] == ck["step"], ck["trainer"]["state"]["global_step"])
            """ % (TARGETS, plain))
            assert out == "['model'] True %d" % saved["step"], out
            assert proc.popen.wait(scaled(120)) == 0  # the run that was not stopped ends on its own
    finally:
        proc.kill()
    _same_run_after(hf["step"], _log(log), _log(resumed_log), 14)


def _across_ranks(address: str, *args: str) -> list:
    """A command's --json rows from every rank (a query prints one array, a checkpoint one object a line)."""
    done = run_cli(address, "--all-ranks", *args, "--json", timeout=scaled(60))
    assert done.code == 0, (done.out, done.err)
    return json.loads(done.out) if done.out.startswith("[") else [json.loads(line) for line in done.out.splitlines()]


def test_hf_trainer_on_two_ranks_checkpoints_each_rank_unwrapped(tmp_path):
    """torchrun, 2 ranks: the Trainer wraps the model in DDP; each rank's file holds GPT2LMHeadModel's own keys
    (no ``module.``), its optimizer, scheduler and progress, and the two replicas' weights are the same."""
    pytest.importorskip("transformers")
    if not tool("torchrun"):
        pytest.skip("torchrun (torch) is not installed")
    argv = [tool("torchrun"), "--nproc-per-node=2", "--master-port=%d" % free_ports(1),
            os.path.join(TARGETS, "hf_trainer.py"), str(tmp_path / "run.log"), "--max-steps", "100000",
            "--sleep", "0.5"]
    with _job("torchrun hf_trainer.py", argv, 2, 90, {}) as job:
        assert sorted(job.ranks) == [0, 1]
        models = _across_ranks(job.address, "query", "SELECT model, count(*) AS n, min(name) AS first "
                               "FROM torch.parameters GROUP BY model")
        trainers = _across_ranks(job.address, "query", "SELECT trainer, model, world_size FROM torch.trainer")
        # Each rank is written right before its next optimizer step; a request that reaches one rank just
        # before a step and the other just after it saves them a step apart (the files are each rank's own).
        for attempt in range(3):  # a try after the first replaces the files of the one before, as asked
            saved = _across_ranks(job.address, "checkpoint", str(tmp_path / "ck-{rank}.pt"),
                                  *(("--overwrite",) if attempt else ()))
            if len({row["step"] for row in saved}) == 1:
                break
    # One model a rank, the user's (not DistributedDataParallel), under main()'s name, its keys unprefixed.
    assert [(m["rank"], m["model"], m["n"], m["first"]) for m in models] == \
        [(0, "model", 28, "transformer.h.0.attn.c_attn.bias"), (1, "model", 28, "transformer.h.0.attn.c_attn.bias")]
    assert [(t["rank"], t["model"], t["world_size"]) for t in trainers] == [(0, "model", 2), (1, "model", 2)]
    assert [(row["rank"], [m["name"] for m in row["models"]], [o["name"] for o in row["optimizers"]],
             row["schedulers"], row["step_source"]) for row in saved] == \
        [(rank, ["model"], ["trainer.optimizer"], [{"name": "trainer.lr_scheduler", "class": "LambdaLR"}],
          "trainer global_step") for rank in (0, 1)], saved
    assert saved[0]["step"] == saved[1]["step"] >= 2, saved
    assert all(row["taken"].startswith("between optimizer steps") for row in saved), saved
    out = _in_fresh_python("""
        import sys, torch
        sys.path.insert(0, %r)
        from hf_trainer import tiny_config
        from transformers import GPT2LMHeadModel
        weights = []
        for rank in (0, 1):
            ck = torch.load("%s/ck-%%d.pt" %% rank)
            model = GPT2LMHeadModel(tiny_config())
            model.load_state_dict(ck["models"]["model"], strict=True)
            weights.append(model.state_dict())
            optimizer = ck["optimizers"]["trainer.optimizer"]
            print(ck["meta"]["rank"], ck["meta"]["world_size"], ck["step"], ck["trainer"]["global_step"],
                  ck["trainer"]["state"]["global_step"], ck["schedulers"]["trainer.lr_scheduler"]["last_epoch"],
                  len(optimizer["state"]), optimizer["state"][0]["step"].item())
        print(all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0]))
    """ % (TARGETS, tmp_path))
    step = saved[0]["step"]
    assert out.splitlines() == ["%d 2 %d %d %d %d 28 %.1f" % (rank, step, step, step, step, step) for rank in (0, 1)] + \
        ["True"], out


def test_lightning_module_is_found_and_its_checkpoints_resume(tmp_path):
    pytest.importorskip("lightning")
    log, resumed_log = str(tmp_path / "run.log"), str(tmp_path / "resumed.log")
    plain, own = str(tmp_path / "ck.pt"), str(tmp_path / "lightning.ckpt")
    # A step a third of a second on a quiet box, longer under load: the queries and checkpoints below run
    # within the 12 steps after READY (at load 10 on 2 cores, 0.3 s steps ended the run before them).
    proc = spawn("lightning_train.py", [log, "--max-steps", "14", "--sleep", "%.2f" % scaled(0.3)], timeout=scaled(90))
    try:
        pid = proc.pid
        models = _rows(pid, "SELECT DISTINCT model FROM torch.parameters")
        optimizers = _rows(pid, "SELECT DISTINCT optimizer FROM torch.optimizers")
        trainers = _rows(pid, "SELECT trainer, kind, max_steps, precision, model, schedulers FROM torch.trainer")
        saved = _checkpoint(pid, plain)
        lightning = _checkpoint(pid, own, "-F", "lightning")
        # No _ResultMetric, no LightningAdamW beside its AdamW; the names of main()'s locals.
        assert models == [{"model": "model"}], models
        assert optimizers == [{"optimizer": "trainer.optimizers[0]"}], optimizers
        assert trainers == [{"trainer": "trainer", "kind": "lightning", "max_steps": 14, "precision": "32-true",
                             "model": "model", "schedulers": "trainer.lr_scheduler_configs[0].scheduler"}], trainers
        assert saved["trainer"]["kind"] == "lightning" and saved["step"] == saved["trainer"]["global_step"]
        # Lightning's own resume (run meanwhile, as the first run sleeps through its last steps) continues
        # exactly as the run that was not stopped.
        with _run_to_the_end("lightning_train.py", [resumed_log, "--max-steps", "14", "--sleep", "0", "--resume", own]):
            out = _in_fresh_python("""
                import sys, torch
                sys.path.insert(0, %r)
                sys.argv = ["x", "unused"]
                from lightning_train import Regression
                ck = torch.load(%r)
                Regression().load_state_dict(ck["models"]["model"], strict=True)
                print(list(ck["optimizers"]), ck["schedulers"]["trainer.lr_scheduler_configs[0].scheduler"]["last_epoch"]
                      == ck["step"])
            """ % (TARGETS, plain))
            assert out == "['trainer.optimizers[0]'] True", out
            assert proc.popen.wait(scaled(120)) == 0  # the run that was not stopped ends on its own
    finally:
        proc.kill()
    _same_run_after(lightning["step"], _log(log), _log(resumed_log), 14)


def test_lightning_module_on_two_ranks_checkpoints_each_rank_unwrapped(tmp_path):
    """Lightning's Trainer(devices=2, strategy="ddp") on the CPU, started as ``python lightning_train.py``
    (rank 0 starts rank 1 with the same command line): through the job's address alone, each rank lists the
    LightningModule once (not the DDP wrapper, no ``module.`` keys, no _ResultMetric); each rank's file loads
    strictly into the module's class with its optimizer, scheduler and progress, the replicas' weights
    equal; and -F lightning writes, under DDP, what Lightning's Trainer.fit(ckpt_path=...) resumes from."""
    pytest.importorskip("lightning")
    argv = [sys.executable, os.path.join(TARGETS, "lightning_train.py"), str(tmp_path / "run.log"), "--ddp",
            "--max-steps", "100000", "--sleep", "0.3"]
    with _job("lightning ddp lightning_train.py", argv, 2, 90, {}) as job:
        assert sorted(job.ranks) == [0, 1]
        # Asked at once, some 0.3 s after init_process_group, which alone numbers these ranks: each must be
        # listed by then (while ranks looked for their number every 0.5 s, one was left out, exit 0, in about
        # half the runs).
        models = _across_ranks(job.address, "query", "SELECT model, count(*) AS n, min(name) AS first "
                               "FROM torch.parameters GROUP BY model")
        trainers = _across_ranks(job.address, "query", "SELECT trainer, kind, model, world_size, schedulers "
                                 "FROM torch.trainer")
        # As for the HF job: a request that straddles a step boundary saves the ranks a step apart; again.
        for attempt in range(3):  # a try after the first replaces the files of the one before, as asked
            saved = _across_ranks(job.address, "checkpoint", str(tmp_path / "ck-{rank}.pt"),
                                  *(("--overwrite",) if attempt else ()))
            if len({row["step"] for row in saved}) == 1:
                break
        own = _across_ranks(job.address, "checkpoint", str(tmp_path / "l-{rank}.ckpt"), "-F", "lightning")
    assert [(m["rank"], m["model"], m["n"], m["first"]) for m in models] == \
        [(0, "model", 4, "net.0.bias"), (1, "model", 4, "net.0.bias")], models
    assert [(t["rank"], t["trainer"], t["kind"], t["model"], t["world_size"], t["schedulers"]) for t in trainers] == \
        [(rank, "trainer", "lightning", "model", 2, "trainer.lr_scheduler_configs[0].scheduler") for rank in (0, 1)]
    assert [(row["rank"], [m["name"] for m in row["models"]], [o["name"] for o in row["optimizers"]],
             row["schedulers"], row["trainer"]["kind"]) for row in saved] == \
        [(rank, ["model"], ["trainer.optimizers[0]"],
          [{"name": "trainer.lr_scheduler_configs[0].scheduler", "class": "LambdaLR"}], "lightning")
         for rank in (0, 1)], saved
    assert saved[0]["step"] == saved[1]["step"] >= 2, saved
    assert all(row["taken"].startswith("between optimizer steps") for row in saved + own), (saved, own)
    assert [row["rank"] for row in own] == [0, 1] and all(row["step"] >= saved[0]["step"] for row in own), own
    step, own_step = saved[0]["step"], own[0]["step"]
    # Lightning's own resume, in one process (run meanwhile): it goes on from the step saved.
    resumed_log = str(tmp_path / "resumed.log")
    with _run_to_the_end("lightning_train.py", [resumed_log, "--max-steps", str(own_step + 2), "--sleep", "0",
                                                "--resume", str(tmp_path / "l-0.ckpt")]):
        out = _in_fresh_python("""
            import sys, torch
            sys.path.insert(0, %r)
            sys.argv = ["x", "unused"]
            from lightning_train import Regression
            weights = []
            for rank in (0, 1):
                ck = torch.load("%s/ck-%%d.pt" %% rank)
                model = Regression()
                model.load_state_dict(ck["models"]["model"], strict=True)
                weights.append(model.state_dict())
                optimizer = ck["optimizers"]["trainer.optimizers[0]"]
                print(ck["meta"]["rank"], ck["meta"]["world_size"], ck["step"], ck["trainer"]["global_step"],
                      ck["schedulers"]["trainer.lr_scheduler_configs[0].scheduler"]["last_epoch"],
                      len(optimizer["state"]), optimizer["state"][0]["step"].item())
            print(all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0]))
            own = torch.load("%s/l-0.ckpt", weights_only=False)
            Regression().load_state_dict(own["state_dict"], strict=True)
            print(own["global_step"])
        """ % (TARGETS, tmp_path, tmp_path))
        assert out.splitlines() == ["%d 2 %d %d %d 4 %.1f" % (rank, step, step, step, step) for rank in (0, 1)] + \
            ["True", str(own_step)], out
    assert sorted(_log(resumed_log)) == [own_step + 1, own_step + 2], _log(resumed_log)
