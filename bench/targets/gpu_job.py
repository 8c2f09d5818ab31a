"""The targets of ``bench/gpu_check.sh``: ``gpu_job.py MODE DEVICE [ARGS]`` (DEVICE: ``cuda`` or ``cpu``).

Each mode prints ``READY <pid>`` once it is in the state the check reads, then stays there until killed:

* ``train DEVICE [IDLE_AFTER]``: an MLP and SGD with momentum on DEVICE, 2 ms between steps; with
  IDLE_AFTER, stops stepping after that many steps (weights and optimizer state stay put, so a checkpoint
  can be compared with them) and prints READY then.
* ``blocked DEVICE SECONDS``: the main thread waits on the device: on CUDA a kernel spinning for about
  SECONDS (``torch.cuda._sleep``) and ``torch.cuda.synchronize()``; on CPU (a stand-in, to try the check
  where there is no GPU) one matrix product long enough to last, which also leaves the GIL.
* ``fr DEVICE STORE [COLLECTIVES]``: a 1-rank process group (NCCL on CUDA, gloo on CPU; rendezvous in the
  file STORE, no port) that runs COLLECTIVES all_reduces (default 6) and then idles; run with
  ``TORCH_FR_BUFFER_SIZE`` set, torch's Flight Recorder keeps them.
* ``compiled DEVICE BACKEND``: ``torch.compile(model, backend=BACKEND)`` trained for a few steps; READY
  once the compiled steps ran, then trains on, 20 ms between steps. ``dynamo_counts()`` says what Dynamo
  did (read with ``probe PID eval``).
"""

import os
import sys
import time

import torch
from torch import nn

MODE, DEVICE = sys.argv[1], torch.device(sys.argv[2])
STEPS = [0]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU())
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def ready() -> None:
    print("READY", os.getpid(), flush=True)


def step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x = torch.randn(16, 32, device=DEVICE)
    y = torch.randint(0, 10, (16,), device=DEVICE)
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    STEPS[0] += 1


def idle() -> None:
    while True:
        time.sleep(1.0)


def train(idle_after: int) -> None:
    global model, optimizer
    model = Net().to(DEVICE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if not idle_after:
        step(model, optimizer)
        ready()
    while not idle_after or STEPS[0] < idle_after:
        step(model, optimizer)
        time.sleep(0.002)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    ready()
    idle()


def blocked(seconds: float) -> None:
    if DEVICE.type == "cuda":
        torch.cuda.init()
        torch.cuda._sleep(1000)  # CUDA context and the kernel's module loaded before timing the clock
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        cycles_per_s = 10_000_000 / (start.elapsed_time(end) / 1000.0)
        torch.cuda._sleep(int(cycles_per_s * seconds))
        ready()
        torch.cuda.synchronize()  # the main thread waits here, in the CUDA driver, GIL released
    else:
        a = torch.randn(3000, 3000)
        torch.set_num_threads(1)
        ready()
        while True:
            a = torch.mm(a, a).clamp_(-1.0, 1.0)  # seconds per product on one thread, GIL released
    idle()


def flight_recorder(store: str, collectives: int) -> None:
    import torch.distributed as dist

    backend = "nccl" if DEVICE.type == "cuda" else "gloo"
    if DEVICE.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method="file://" + store, rank=0, world_size=1)
    tensor = torch.ones(1024, device=DEVICE)
    for _ in range(collectives):
        dist.all_reduce(tensor)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    ready()
    idle()


def dynamo_counts() -> dict:
    """Graph breaks, graphs Dynamo compiled, and versions of ``Net.forward`` compiled (1: never recompiled)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    return {"graph_breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"],
            "forward_versions": len(_debug_get_cache_entry_list(Net.forward.__code__)), "steps": STEPS[0]}


def compiled(backend: str) -> None:
    global model, optimizer
    torch.set_num_threads(1)
    net = Net().to(DEVICE)
    model = torch.compile(net, backend=backend)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    for _ in range(3):
        step(model, optimizer)
    ready()
    while True:
        step(model, optimizer)
        time.sleep(0.02)


if __name__ == "__main__":
    torch.manual_seed(0)
    if MODE == "train":
        train(int(sys.argv[3]) if len(sys.argv) > 3 else 0)
    elif MODE == "blocked":
        blocked(float(sys.argv[3]))
    elif MODE == "fr":
        flight_recorder(sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 6)
    elif MODE == "compiled":
        compiled(sys.argv[3])
    else:
        raise SystemExit("unknown mode %r" % MODE)
