"""One rank of a job started by a real launcher, on the CPU with gloo, in the state the test asks for by rank.

    accelerate launch --multi_gpu --num_processes N ranks.py accelerate
    deepspeed --num_gpus N ranks.py env                 (torchrun's variables, torch.distributed from env://)
    python ranks.py lightning-ddp N | lightning-spawn N (Lightning's Trainer on N CPU devices)
    python ranks.py mp-spawn N                          (torch.multiprocessing.spawn; JOB_MASTER_PORT)
    mpirun -np N python ranks.py mpi                    (Open MPI's variables; torch.distributed is not used)
    srun -n N python ranks.py slurm                     (Slurm's variables; torch.distributed is not used)

With ``TRAIN=1`` every rank trains instead, once it printed READY: a small model, its gradients summed by
an all_reduce (gloo; under mpirun and srun the process group is set up from the launcher's rank, the world
size and ``JOB_MASTER_PORT``), an optimizer step and a sleep of ``STEP_SLEEP`` s a step; under Lightning
its Trainer trains, one such step a batch. ``TRAIN=alone`` under mpirun and srun: no process group, each
rank steps on its own (as a program whose ranks talk through MPI itself, Horovod's way). The rank named by
``SLOW_IMPORT_RANK`` imports a module that keeps the GIL 1.5 s in each step while torch.profiler runs.

Once a rank knows its rank it prints ``READY <pid> <rank> <local_rank>`` in one write (a launcher that
forwards its ranks' output would interleave a line printed piece by piece). Then the rank named by
``GIL_RANK`` holds the GIL in a C call (once the file ``GO_FILE`` exists, where that is set: later in the
job, as a real rank would, once the test saw it listed), the one named by ``HANG_RANK`` waits in
``stuck_in_rank_hang``, and every other rank in ``wait_for_work``. Options a launcher adds (DeepSpeed's ``--local_rank=0``, before
the mode) are ignored.
"""

import ctypes
import os
import sys
import threading
import time

ARGS = [arg for arg in sys.argv[1:] if not arg.startswith("--")]  # DeepSpeed's launcher puts --local_rank=N first
MODE = ARGS[0] if ARGS else "env"
COUNT = int(ARGS[1]) if len(ARGS) > 1 else 2


def hold_the_gil() -> None:
    ctypes.PyDLL(None).sleep(600)


def wait_for_the_go_ahead() -> None:
    go = os.environ.get("GO_FILE")
    while go and not os.path.exists(go):
        time.sleep(0.05)


def stuck_in_rank_hang() -> None:
    threading.Event().wait(600)


def wait_for_work() -> None:
    threading.Event().wait(600)


TRAIN = bool(os.environ.get("TRAIN"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.05"))


def train() -> None:
    """Steps until killed (bounded: 10 minutes): forward, backward, the gradients' all_reduce, the step."""
    import torch
    import torch.distributed as dist

    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(4, 8)
    slow = os.environ.get("SLOW_IMPORT_RANK") == str(dist.get_rank() if dist.is_initialized() else RANK)
    ends = time.monotonic() + 600
    while time.monotonic() < ends:
        if slow and torch._C._autograd._profiler_enabled():
            import_slowly()
        model(data).pow(2).mean().backward()
        for param in model.parameters() if dist.is_initialized() else ():
            dist.all_reduce(param.grad)
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(STEP_SLEEP)


def import_slowly() -> None:
    """Import a module afresh whose body keeps the GIL 1.5 s in a C call (as a lazy import of a big
    extension does on a loaded machine): the agent cannot answer meanwhile."""
    import importlib

    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # the job's work directory (the test's, temporary)
    with open("probe_slow_module.py", "w") as handle:
        handle.write("import ctypes\nctypes.PyDLL(None).usleep(1500000)\n")
    sys.modules.pop("probe_slow_module", None)
    importlib.invalidate_caches()
    importlib.import_module("probe_slow_module")


def gloo_from(rank: int, world: int) -> None:
    """The process group of a launcher that sets up none (mpirun, srun): tcp:// at ``JOB_MASTER_PORT``."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%s" % os.environ["JOB_MASTER_PORT"], rank=rank,
                            world_size=world)


RANK = -1  # this rank, once known


def ready(rank: int, local_rank: int) -> None:
    global RANK
    RANK = rank
    if TRAIN:
        import torch  # noqa: F401  (before READY: the test profiles it at once)
    sys.stdout.write("READY %d %d %d\n" % (os.getpid(), rank, local_rank))
    sys.stdout.flush()
    if TRAIN:
        if not MODE.startswith("lightning"):  # Lightning's Trainer trains once on_train_start returned
            train()
        return
    if str(rank) == os.environ.get("GIL_RANK"):
        wait_for_the_go_ahead()
        hold_the_gil()
    elif str(rank) == os.environ.get("HANG_RANK"):
        stuck_in_rank_hang()
    else:
        wait_for_work()


def from_env() -> None:
    """The launcher set RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (torchrun's variables)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    ready(dist.get_rank(), int(os.environ["LOCAL_RANK"]))


def with_accelerate() -> None:
    """As a Hugging Face script starts: the Accelerator sets up the process group from the launcher's variables."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    ready(accelerator.process_index, accelerator.local_process_index)


if MODE.startswith("lightning"):
    # At module level: ddp_spawn pickles the model for its ranks, which import this file again (same argv).
    import torch
    from lightning.pytorch import LightningModule, Trainer

    class Model(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def on_train_start(self) -> None:
            ready(self.global_rank, self.local_rank)

        def training_step(self, batch, batch_idx):
            if TRAIN:
                time.sleep(STEP_SLEEP)
            return self.layer(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.ones(20000 if TRAIN else 8, 2), batch_size=2)


def with_lightning(strategy: str) -> None:
    """Lightning's Trainer on ``COUNT`` CPU devices; each rank reports from ``on_train_start``, once the
    process group is up (under ``ddp`` this process is rank 0 and starts the others as ``python ranks.py``
    again; under ``ddp_spawn`` it only waits for the ranks it spawned)."""
    trainer = Trainer(accelerator="cpu", devices=COUNT, strategy=strategy, max_epochs=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model())


def spawned_rank(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=world)
    ready(rank, rank)


def with_mp_spawn() -> None:
    """torch.multiprocessing.spawn, as its documentation shows it: this process waits in join() for its
    ``COUNT`` children, which learn their rank from their argument and init_process_group alone."""
    import torch.multiprocessing as mp

    mp.spawn(spawned_rank, args=(COUNT, int(os.environ["JOB_MASTER_PORT"])), nprocs=COUNT, join=True)


def with_mpi() -> None:
    """A rank of ``mpirun``: Open MPI's variables say who it is; nothing else is set up (but for TRAIN)."""
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    if TRAIN and os.environ.get("TRAIN") != "alone":
        gloo_from(rank, int(os.environ["OMPI_COMM_WORLD_SIZE"]))
    ready(rank, int(os.environ["OMPI_COMM_WORLD_LOCAL_RANK"]))


def with_slurm() -> None:
    """A task of ``srun``: Slurm's variables say who it is; nothing else is set up (but for TRAIN)."""
    rank = int(os.environ["SLURM_PROCID"])
    if TRAIN and os.environ.get("TRAIN") != "alone":
        gloo_from(rank, int(os.environ["SLURM_NTASKS"]))
    ready(rank, int(os.environ["SLURM_LOCALID"]))


if __name__ == "__main__":
    if MODE == "env":
        from_env()
    elif MODE == "accelerate":
        with_accelerate()
    elif MODE == "lightning-ddp":
        with_lightning("ddp")
    elif MODE == "lightning-spawn":
        with_lightning("ddp_spawn")
    elif MODE == "mp-spawn":
        with_mp_spawn()
    elif MODE == "mpi":
        with_mpi()
    elif MODE == "slurm":
        with_slurm()
    else:
        sys.exit("ranks.py: unknown mode %r" % MODE)
