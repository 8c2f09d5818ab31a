"""The families of a rank's step extras (``probe.tables.torch.step_extras``) for the node helper's
``/metrics`` (``probe.host.metrics``): the learning rate its optimizer holds, CUDA memory, the last
collective's sequence number, data wait.

Why from the progress file: the rank wrote them at a step boundary (at most once a second); the scrape
reads 128 more bytes of the file it reads already, and asks the rank nothing. Each family has a series only
for the ranks where the value is known (a CPU rank has no CUDA series; a loop without a DataLoader no
data wait).
"""

from typing import Any, Iterator, List, Sequence

__all__ = ["ExtrasFamilies"]


class ExtrasFamilies:
    """One scrape's families of the step extras: ``add`` each rank's, then ``families``."""

    def __init__(self, labels: Sequence[str]) -> None:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        names = list(labels)
        self.lr = GaugeMetricFamily("probe_lr", "The learning rate the rank's optimizer holds (param_groups[0], "
                                    "where a Python number), at its last step extras' refresh.", labels=names)
        self.allocated = GaugeMetricFamily("probe_cuda_memory_allocated_bytes", "CUDA memory the rank's tensors "
                                           "hold on its current device (torch's caching allocator).", labels=names)
        self.reserved = GaugeMetricFamily("probe_cuda_memory_reserved_bytes", "CUDA memory torch's caching "
                                          "allocator holds for the rank on its current device.", labels=names)
        self.total = GaugeMetricFamily("probe_cuda_memory_total_bytes", "The rank's current CUDA device's memory.",
                                       labels=names)
        self.collective = GaugeMetricFamily("probe_collective_seq", "The sequence number of the default process "
                                            "group: collectives the rank issued in it.", labels=names)
        self.wait = GaugeMetricFamily("probe_data_wait_seconds", "Time the rank's training thread waited in its "
                                      "DataLoader's next batch during its step before the last refresh.",
                                      labels=names)
        self.waited = CounterMetricFamily("probe_data_waited_seconds", "Time the rank's training thread waited in "
                                          "its DataLoader's next batch, in all.", labels=names)
        self.age = GaugeMetricFamily("probe_step_extras_age_seconds", "Seconds since the rank last refreshed "
                                     "these values (at a step, at most once a second).", labels=names)

    def add(self, extras: Any, labels: List[str], now: float) -> None:
        """A rank's extras (``step_extras.Extras``; None: nothing)."""
        if extras is None:
            return
        self.age.add_metric(labels, max(0.0, now - extras.refreshed))
        if extras.lr is not None:
            self.lr.add_metric(labels, extras.lr)
        if extras.cuda_reserved is not None:
            self.allocated.add_metric(labels, float(extras.cuda_allocated))
            self.reserved.add_metric(labels, float(extras.cuda_reserved))
            self.total.add_metric(labels, float(extras.cuda_total))
        if extras.collective_seq is not None:
            self.collective.add_metric(labels, float(extras.collective_seq))
        if extras.batches:  # a DataLoader's batch timed: its wait is known
            self.wait.add_metric(labels, extras.data_wait_last)
            self.waited.add_metric(labels, extras.data_wait_total)

    def families(self) -> Iterator[Any]:
        yield from (self.lr, self.allocated, self.reserved, self.total, self.collective, self.wait, self.waited,
                    self.age)
