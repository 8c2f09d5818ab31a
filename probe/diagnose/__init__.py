"""``probe diagnose``: what is wrong with a process or a job, which rank, and where.

The rules can be tested on evidence alone, and the parts import one way: each only the parts before it
in this list (within the families, one may read another's evidence: the step counter, a stack's
collective), so no import circle forms:

* the words and the data: :mod:`probe.diagnose.verdict` (a verdict, its evidence, the report, the exit
  statuses, the words for ranks and places); :mod:`probe.diagnose.evidence` (one rank's evidence, a sample
  of every rank's; live or read back from a record); :mod:`probe.diagnose.library` (which frames are a
  library's).
* one module per family of verdicts, each with the evidence it reads and its rules: ``silent`` (dead, GIL
  held, stopped), ``collectives`` (hang, mismatch), ``progress`` (steps, stalls, healthy), ``locks`` and
  ``lockwaits``, ``straggler``, ``numerics`` and ``training``, ``memory``; ``unknown`` (what could not be had).
  They only read: no eval of user code, no collective, no device synchronisation.
* :mod:`probe.diagnose.gather` (one look at every rank, each family's evidence gathered by its module),
  :mod:`probe.diagnose.rules` (the judge: which families run over two such looks, in what order) and
  :mod:`probe.diagnose.engine` (when to look).
* ``probe.cli.commands.diagnose`` prints a verdict first, then its evidence (each with the probe command
  that shows it in full), then what to do next; ``--json`` and ``--watch``.
"""

from probe.diagnose.verdict import EXIT_CODES, STATUSES

__all__ = ["EXIT_CODES", "STATUSES"]
