"""``probe diagnose``: what is wrong with a process or a job, which rank, and where.

Three parts, kept apart so that the rules can be tested on evidence alone:

* :mod:`probe.diagnose.evidence` gathers, per rank, what probe can read without harming it: the stacks
  (from the agent, or read from outside when it cannot answer; a dead one's from its crash record), its
  threads' CPU time, the Flight Recorder's last collective per process group and the trace's steps. It
  reads only: no eval of user code, no collective, no device synchronisation. Evidence that could not be
  had is kept with why.
* :mod:`probe.diagnose.rules` judges two or more such samples, taken a moment apart, with plain rules:
  each verdict names its ranks and place and carries the evidence it rests on.
* ``probe.cli.commands.diagnose`` prints a verdict first, then its evidence (each with the probe command
  that shows it in full), then what to do next; ``--json`` and ``--watch``.
"""

from probe.diagnose.rules import EXIT_CODES, STATUSES

__all__ = ["EXIT_CODES", "STATUSES"]
