"""The step counter's cost (``torch.steps``): a small CPU training loop with and without the agent's
optimizer post-step hook.

    python bench/bench_step_counter.py [--rounds 15] [--steps 200] [--calls 200000]

In one process (CPU, one intra-op thread): an MLP (4 x Linear(256) + ReLU, batch 32) trained with SGD.
Blocks of ``--steps`` steps alternate (A B B A ...): without probe's hook, and with it registered as the
agent registers it (``probe.agent.placement._after_step`` through torch's global
``register_optimizer_step_post_hook``; removed again after its block, which only this bench does).
Each step is timed in CPU time of the training thread (``time.thread_time``; wall time on a shared
machine swings by tens of per cent). A block's figure is its median step; the ratio is a "with" block
over the mean of the "without" blocks on either side, median over rounds with its IQR. Beside it, the
hook's own cost: ``--calls`` calls of ``_after_step`` on one optimizer in a loop, ns a call (min of 5), with
its progress file written (``progress-<pid>.bin``, made on the first call as in an agent) and, interleaved,
without (the file switched off): what the file adds to a step.

The step extras (``probe.tables.torch.step_extras``: lr, CUDA memory, collective sequence number, data wait,
refreshed at a step at most once a second), in a 1-rank gloo group (so the sequence number is read) with
batches from a DataLoader: ``--rounds`` rounds of blocks of ``--steps`` steps, the extras on and off
interleaved (A B B A; off: the refresh never due and DataLoader's ``__next__`` unwrapped), each step's CPU
time; the hook alone with and without them (ns a call, 10 runs of ``--calls`` each, A B B A); one refresh
(us); what timing a batch's ``__next__`` adds (ns, interleaved: around a ``__next__`` that does nothing,
and that one alone).
"""

import argparse
import os
import statistics
import sys
import time
from typing import Any, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import Summary, figure, header, spread, table  # noqa: E402


def _loop(torch: Any) -> Any:
    torch.manual_seed(0)
    layers: List[Any] = []
    for _ in range(4):
        layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randn(32, 256)

    def block(steps: int) -> float:
        times = []
        for _ in range(steps):
            start = time.thread_time()
            loss = model(data).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.thread_time() - start)
        return statistics.median(times)
    return block, optimizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--calls", type=int, default=200000)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    from torch.optim import optimizer as optim_module

    from probe.agent import placement
    from probe.tables.torch import steps as counter

    header("The step counter (torch.steps): a CPU training loop with and without the optimizer post-step hook",
           ["torch %s, 1 intra-op thread; %d rounds of %d-step blocks, without / with interleaved (A B B A)"
            % (torch.__version__, args.rounds, args.steps)])
    block, optimizer = _loop(torch)
    block(args.steps)  # warm-up
    ratios, off, on = [], [], []
    for i in range(args.rounds):
        order = ("off", "on", "on", "off") if i % 2 == 0 else ("on", "off", "off", "on")
        got = {"off": [], "on": []}  # type: dict
        for what in order:
            handle = optim_module.register_optimizer_step_post_hook(placement._after_step) if what == "on" else None
            try:
                got[what].append(block(args.steps))
            finally:
                if handle is not None:
                    handle.remove()
        base = statistics.mean(got["off"])
        ratios += [t / base for t in got["on"]]
        off += got["off"]
        on += got["on"]
    # The hook alone, with its progress file written (as in an agent) and without (the file off), interleaved.
    calls, unwritten = [], []
    has_file = hasattr(counter, "_progress")
    for i in range(10 if has_file else 5):
        written = not has_file or i % 2 == 0
        if has_file and not written:
            saved, counter._progress = counter._progress, False
        start = time.perf_counter()
        for _ in range(args.calls):
            placement._after_step(optimizer, (), {})
        (calls if written else unwritten).append((time.perf_counter() - start) / args.calls)
        if has_file and not written:
            counter._progress = saved
    r, a, b = Summary.of(ratios), Summary.of(off), Summary.of(on)
    print(table([["without probe", str(a.n), "%.1f" % (a.median * 1e6), "%.1f-%.1f" % (a.q1 * 1e6, a.q3 * 1e6),
                  "%.1f-%.1f" % (a.low * 1e6, a.high * 1e6)],
                 ["with the step counter", str(b.n), "%.1f" % (b.median * 1e6), "%.1f-%.1f" % (b.q1 * 1e6, b.q3 * 1e6),
                  "%.1f-%.1f" % (b.low * 1e6, b.high * 1e6)]],
                ["median step (CPU)", "blocks", "median us", "IQR us", "min-max us"]))
    print()
    print("with / without (per round, neighbouring blocks): median %.4f, IQR %.4f-%.4f, min-max %.4f-%.4f"
          % (r.median, r.q1, r.q3, r.low, r.high))
    step = figure("median step (CPU), with the step counter", on, peer="without probe", peer_values=off, unit="us",
                  scale=1e6, ratio=r.median)
    step["per_round_ratio"] = spread(r)
    print("the hook alone: %.0f ns a call (min of 5 x %d calls; median %.0f ns, max %.0f)"
          % (min(calls) * 1e9, args.calls, statistics.median(calls) * 1e9, max(calls) * 1e9))
    if has_file:
        print("the hook alone without writing the progress file: %.0f ns a call (min of 5; median %.0f ns, max %.0f)"
              % (min(unwritten) * 1e9, statistics.median(unwritten) * 1e9, max(unwritten) * 1e9))
        print("  its file: %s" % (counter._where[0] or "none (could not be made)"))
        counter.remove_progress()
    print("counted: %s steps (the 'with' blocks and the calls alone)" % [c.steps for c in counter._counters.values()])
    _extras(torch, args)


def _loader_loop(torch: Any) -> Any:
    """The MLP fed by a DataLoader (no workers, batch 32 of a 4096-row TensorDataset, cycled)."""
    torch.manual_seed(0)
    layers: List[Any] = []
    for _ in range(4):
        layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4096, 256)), batch_size=32)
    batches = [iter(loader)]

    def batch() -> Any:
        try:
            return next(batches[0])[0]
        except StopIteration:
            batches[0] = iter(loader)
            return next(batches[0])[0]

    def block(steps: int) -> float:
        times = []
        for _ in range(steps):
            start = time.thread_time()
            loss = model(batch()).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.thread_time() - start)
        return statistics.median(times)
    return block, optimizer, loader


def _extras(torch: Any, args: Any) -> None:
    """The step extras' cost: a loop's step with them and without, the hook, a refresh, a batch."""
    import torch.distributed as dist
    from torch.optim import optimizer as optim_module
    from torch.utils.data import dataloader

    from probe.agent import placement
    from probe.tables.torch import step_extras
    from probe.tables.torch import steps as counter

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    dist.init_process_group("gloo", rank=0, world_size=1)
    dist.all_reduce(torch.ones(1))
    counter._progress = None  # a fresh progress file, with its extras' section
    counter._where[0] = None
    block, optimizer, loader = _loader_loop(torch)
    handle = optim_module.register_optimizer_step_post_hook(placement._after_step)
    base = dataloader._BaseDataLoaderIter
    block(args.steps)  # warm-up; makes the file and wraps the DataLoader
    timed, plain = base.__dict__["__next__"], step_extras._wrap_state["original"]
    assert plain is not None and timed is not plain, "the DataLoader was not wrapped"

    def extras(on: bool) -> None:
        counter._extras_next = 0.0 if on else float("inf")
        base.__next__ = timed if on else plain

    print()
    print("The step extras: a 1-rank gloo group, batches from a DataLoader; the hook in for every block")
    ratios, off, on = [], [], []
    for i in range(args.rounds):
        order = ("off", "on", "on", "off") if i % 2 == 0 else ("on", "off", "off", "on")
        got = {"off": [], "on": []}  # type: dict
        for what in order:
            extras(what == "on")
            got[what].append(block(args.steps))
        base_time = statistics.mean(got["off"])
        ratios += [t / base_time for t in got["on"]]
        off += got["off"]
        on += got["on"]
    hook = {"off": [], "on": []}  # type: dict
    for i in range(20):
        what = ("on", "off", "off", "on")[i % 4]  # A B B A: a drift of the machine's load falls on both
        extras(what == "on")
        start = time.perf_counter()
        for _ in range(args.calls):
            placement._after_step(optimizer, (), {})
        hook[what].append((time.perf_counter() - start) / args.calls)
    extras(True)
    refreshes = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(2000):
            step_extras.refresh(counter._progress, optimizer, counter._total, time.monotonic(), counter._steps_now)
        refreshes.append((time.perf_counter() - start) / 2000)
    # What the timed __next__ adds to a batch: it around a __next__ that does nothing, and that one alone.
    batch = {"timed": [], "plain": []}  # type: dict

    def nothing(self: Any) -> None:
        return None

    step_extras._wrap_state["original"] = nothing
    try:
        for i in range(10):
            what = "timed" if i % 2 == 0 else "plain"
            call = timed if what == "timed" else nothing
            start = time.perf_counter()
            for _ in range(args.calls):
                call(None)
            batch[what].append((time.perf_counter() - start) / args.calls)
    finally:
        step_extras._wrap_state["original"] = plain
    extras(True)
    handle.remove()
    found = step_extras.read_extras(counter._where[0])
    r, a, b = Summary.of(ratios), Summary.of(off), Summary.of(on)
    print(table([["extras off", str(a.n), "%.1f" % (a.median * 1e6), "%.1f-%.1f" % (a.q1 * 1e6, a.q3 * 1e6),
                  "%.1f-%.1f" % (a.low * 1e6, a.high * 1e6)],
                 ["extras on", str(b.n), "%.1f" % (b.median * 1e6), "%.1f-%.1f" % (b.q1 * 1e6, b.q3 * 1e6),
                  "%.1f-%.1f" % (b.low * 1e6, b.high * 1e6)]],
                ["median step (CPU), DataLoader", "blocks", "median us", "IQR us", "min-max us"]))
    print("on / off (per round, neighbouring blocks): median %.4f, IQR %.4f-%.4f, min-max %.4f-%.4f"
          % (r.median, r.q1, r.q3, r.low, r.high))
    step = figure("median step (CPU) with a DataLoader, step extras on", on, peer="step extras off", peer_values=off,
                  unit="us", scale=1e6, ratio=r.median)
    step["per_round_ratio"] = spread(r)
    print("the hook alone: %.0f ns a call with the extras (median of 10; min %.0f), %.0f without (min %.0f)"
          % (statistics.median(hook["on"]) * 1e9, min(hook["on"]) * 1e9, statistics.median(hook["off"]) * 1e9,
             min(hook["off"]) * 1e9))
    figure("the hook alone, step extras on", hook["on"], peer="step extras off", peer_values=hook["off"], unit="ns",
           scale=1e9)
    print("one refresh (lr, collective sequence number, data wait; no CUDA here): %.2f us (median of 5 x 2000; "
          "min %.2f, max %.2f): at most once a second" % (statistics.median(refreshes) * 1e6, min(refreshes) * 1e6,
                                                          max(refreshes) * 1e6))
    figure("one refresh of the step extras (no CUDA)", refreshes, unit="us", scale=1e6)
    print("a batch's __next__ timed, around a __next__ that does nothing: %.0f ns a call, %.0f for that one alone "
          "(median of 5 x %d; min %.0f and %.0f): what the timing adds to each batch"
          % (statistics.median(batch["timed"]) * 1e9, statistics.median(batch["plain"]) * 1e9, args.calls,
             min(batch["timed"]) * 1e9, min(batch["plain"]) * 1e9))
    figure("a batch's __next__ timed (around one that does nothing)", batch["timed"], peer="that __next__ alone",
           peer_values=batch["plain"], unit="ns", scale=1e9)
    print("the file's extras at the end: %s" % (found,))
    counter.remove_progress()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
