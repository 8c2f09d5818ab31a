"""The NaN/Inf check of a trace: which module's output (or input gradient) first held a non-finite value.

One cheap screen per tensor: its sum in float32 (``sum`` of a tensor holding NaN or Inf is not finite;
one reduction, no boolean tensor the size of the input, about 10x cheaper on CPU than
``isfinite().all()``). Only a sum that is not finite leads to the exact count of NaN and Inf elements
(the overflow of a finite float32 sum past 3.4e38 would be reported too, with 0 non-finite elements).

* CPU tensors: the screen runs in the hook; a hit is recorded at once.
* CUDA tensors: the screen's result stays on the device (no sync); at the step's end the step's
  results are stacked into one tensor and copied to the host without blocking, with an event; a later
  step end (or a query) reads them once that event has completed. Only the first module of a step
  with a hit is reported then, without the exact count.

Only the first anomaly of each stage in a step is recorded: after it the values spread to every later
module, and it is the first one that tells where they came from.

The batch: the positional inputs of the top-level module's call are screened too, before any module
runs (tensors, and one level into the tuples, lists and dicts that hold them). A non-finite value there
came with the data: it is recorded as stage ``input`` of the top-level module, and no module is blamed
for that step (every module's output shows it after the first). Inputs passed by keyword
(``model(**batch)``) are not seen: torch's global forward pre-hooks get only the positional ones.

The loss: the last scalar a top-level module call returned in the step, or the ``loss`` of a dict it
returned (a Hugging Face ``ModelOutput`` is a dict).
"""

import math
import time
from typing import Any, List, Optional, Tuple

from probe.tables.torch.anomalies import AnomalyStore

__all__ = ["AnomalyCheck"]


class AnomalyCheck:
    def __init__(self, torch: Any, store: AnomalyStore) -> None:
        self._torch = torch
        self._float32 = torch.float32
        self._store = store
        self._reported: set = set()  # (step, stage) already recorded
        self._device: List[Tuple[Any, str, str, int, int, float, float]] = []  # CUDA sums of the current step
        self._copies: List[Tuple[Any, Any, List[Tuple[str, str, int, int, float, float]]]] = []
        self.last_loss: Any = None

    def check(self, tensors: Any, module: str, stage: str, step: int, seq: int, offset: float) -> None:
        """Screen every floating-point tensor of ``tensors`` (a tensor, or a tuple/list of them)."""
        if (step, stage) in self._reported:
            return
        Tensor = self._torch.Tensor
        items = (tensors,) if isinstance(tensors, Tensor) else tensors if isinstance(tensors, (tuple, list)) else ()
        for tensor in items:
            if not isinstance(tensor, Tensor) or not tensor.is_floating_point() or tensor.numel() == 0:
                continue
            total = tensor.detach().sum(dtype=self._float32)
            if tensor.device.type == "cpu":
                if not math.isfinite(float(total)):
                    self._record(tensor, module, stage, step, seq, offset)
                    return
            elif len(self._device) < 100_000:
                self._device.append((total, module, stage, step, seq, offset, time.time()))

    def check_inputs(self, inputs: Any, module: str, step: int, seq: int, offset: float) -> None:
        """Screen the top-level module's positional inputs (the batch) before any module ran."""
        if (step, "forward") in self._reported or (step, "input") in self._reported:
            return  # a module's output held one already (this is a criterion's call), or the batch did
        Tensor = self._torch.Tensor
        for tensor in _batch_tensors(inputs, Tensor):
            if not tensor.is_floating_point() or tensor.numel() == 0:
                continue
            total = tensor.detach().sum(dtype=self._float32)
            if tensor.device.type == "cpu":
                if not math.isfinite(float(total)):
                    self._record(tensor, module, "input", step, seq, offset)
                    self._reported.update(((step, "forward"), (step, "backward")))  # no module is to blame
                    return
            elif len(self._device) < 100_000:
                self._device.append((total, module, "input", step, seq, offset, time.time()))

    def note_loss(self, output: Any) -> None:
        """At the end of a top-level module call: keep its loss, a scalar output or a dict's ``loss``."""
        loss = dict.get(output, "loss") if isinstance(output, dict) else output
        if isinstance(loss, self._torch.Tensor) and loss.dim() == 0 and loss.is_floating_point():
            self.last_loss = loss.detach()

    def _record(self, tensor: Any, module: str, stage: str, step: int, seq: int, offset: float) -> None:
        torch = self._torch
        data = tensor.detach()
        nans = int(torch.isnan(data).sum())
        infs = int(torch.isinf(data).sum())
        self._reported.add((step, stage))
        self._store.add(step, seq, module, stage, nans, infs, data.numel(), list(data.shape), str(data.dtype),
                        str(data.device), offset, time.time())

    def step_ended(self, step: int) -> None:
        """At an optimizer step's end: note the loss, start the copy of this step's CUDA sums, read older ones."""
        self._store.set_loss(step, self._loss_value())
        self._reported = {key for key in self._reported if key[0] >= step}
        if self._device:
            sums = [entry[0] for entry in self._device]
            where = [entry[1:] for entry in self._device]
            self._device = []
            host = self._torch.stack(sums).to("cpu", non_blocking=True)
            event = self._torch.cuda.Event()
            event.record()
            if len(self._copies) < 64:
                self._copies.append((host, event, where))
        self.resolve()

    def resolve(self) -> None:
        """Report the first non-finite CUDA sum of each step whose copy has arrived (never waits)."""
        while self._copies and self._copies[0][1].query():
            host, _, where = self._copies.pop(0)
            batch_steps = set()  # steps whose batch held one: no module is blamed for them
            for value, (module, stage, step, seq, offset, wall) in zip(host.tolist(), where):
                if math.isfinite(value) or step in batch_steps or self._store.has(step, stage):
                    continue
                if stage == "input":
                    if self._store.has(step, "forward"):
                        continue  # a criterion's inputs: a module's output held it first
                    batch_steps.add(step)
                self._store.add(step, seq, module, stage, None, None, None, None, None, "cuda", offset, wall)

    def _loss_value(self) -> Optional[float]:
        loss, self.last_loss = self.last_loss, None
        if loss is None or loss.device.type != "cpu":
            return None
        return float(loss)


def _batch_tensors(inputs: Any, tensor_type: Any) -> List[Any]:
    """The tensors of a call's positional inputs, and one level into the tuples, lists and dicts there."""
    out: List[Any] = []
    for item in inputs if isinstance(inputs, (tuple, list)) else (inputs,):
        if isinstance(item, tensor_type):
            out.append(item)
        elif isinstance(item, (tuple, list)):
            out.extend(v for v in item if isinstance(v, tensor_type))
        elif isinstance(item, dict):
            out.extend(v for v in dict.values(item) if isinstance(v, tensor_type))
    return out
