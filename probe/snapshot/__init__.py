"""Snapshots: a job's evidence written to disk before the job is killed, read later like a live target.

* :mod:`probe.snapshot.record`: one rank's record (the format), written atomically and read back;
* :mod:`probe.snapshot.capture`: a rank's record taken from a live target (the same evidence ``diagnose``
  reads, twice a second apart, and a few bounded tables);
* :mod:`probe.snapshot.store`: a directory of snapshots: where, ids, listing, grouping, cleanup.

Client side only: the agent never imports this package.
"""

from probe.snapshot.record import FORMAT

__all__ = ["FORMAT"]
