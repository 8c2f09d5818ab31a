"""A small CPU training job: an MLP and an optimizer in ``__main__``, as in most training scripts.

    train.py [--optim adam|sgd] [--poison] [--idle] [--watch] [--no-torch]

Trains a few steps, prints ``READY <pid>``, then keeps training (``--idle``: stops, so that weights stay
put for comparisons). ``--poison``: the batch of step 3 holds a NaN; the loop stops after its backward,
before the optimizer step, as a NaN guard would, leaving NaN gradients in place. ``--watch``: registers
the model and optimizer with ``probe.watch`` under the names ``net`` and ``opt``. ``--no-torch``: never
imports torch (for the "torch is not loaded" test). ``gate`` (a module of the model) can be armed by an
eval to block a checkpoint in the middle of ``torch.save`` and say so through a file.
``--die-on-fsize``: a write past RLIMIT_FSIZE kills the process (SIGXFSZ), as the kernel does by
default for programs that do not ignore it (CPython ignores it): a crash at an exact byte of a file.
"""

import collections
import os
import sys
import threading
import time

if "--no-torch" in sys.argv:
    sys.stdout.write("READY %d\n" % os.getpid())
    sys.stdout.flush()
    threading.Event().wait()

if "--die-on-fsize" in sys.argv:
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)

import torch  # noqa: E402
from torch import nn  # noqa: E402


class Gate:
    """Pickled inside torch.save; when armed, writes ``path`` and blocks (the checkpoint is mid-write)."""

    def __init__(self) -> None:
        self.armed = False
        self.path = ""

    def __reduce__(self):  # type: ignore[no-untyped-def]
        if self.armed:
            with open(self.path, "w") as handle:
                handle.write("saving\n")
            threading.Event().wait()
        return (collections.OrderedDict, ())  # loads as an empty OrderedDict, even with weights_only


class GateModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()

    def get_extra_state(self):  # type: ignore[no-untyped-def]
        return self.gate

    def set_extra_state(self, state) -> None:  # type: ignore[no-untyped-def]
        pass

    def forward(self, x):  # type: ignore[no-untyped-def]
        return x


class MLP(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, width)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(width, 4)
        self.norm = nn.BatchNorm1d(4)
        self.gate = GateModule()

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.gate(self.norm(self.fc2(self.act(self.fc1(x)))))


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    if "--optim" in sys.argv and sys.argv[sys.argv.index("--optim") + 1] == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    return torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=0.01)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, poisoned: bool = False) -> None:
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    if poisoned:
        x[0, 0] = float("nan")
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    if not poisoned:
        optimizer.step()


def main() -> None:
    global step
    torch.manual_seed(0)
    net = MLP()
    opt = _optimizer(net)
    if "--watch" in sys.argv:
        import probe

        probe.watch(net=net, opt=opt)  # __main__ does not hold them: only this frame and the registry do
    else:
        globals().update(model=net, optimizer=opt)
    poison = "--poison" in sys.argv
    for step in range(5):
        _step(net, opt, poisoned=poison and step == 3)
        if poison and step == 3:
            break
    sys.stdout.write("READY %d\n" % os.getpid())
    sys.stdout.flush()
    if poison or "--idle" in sys.argv:
        threading.Event().wait()
    while True:
        step += 1
        _step(net, opt)
        time.sleep(0.005)


if __name__ == "__main__":
    main()
