"""``probe diagnose``: what is wrong with a process or a job, which rank, and where.

Kept apart so that the rules can be tested on evidence alone, and imported one way (each module only
those above it in this list):

* :mod:`probe.diagnose.verdict`: what every rule speaks in (a verdict, its evidence, the report, the exit
  statuses, the words for ranks and places); :mod:`probe.diagnose.evidence`: one rank's evidence and a
  sample of every rank's (the data, read back from a record as well); :mod:`probe.diagnose.library`:
  which frames are a library's.
* one module per family of verdicts, each with the evidence it reads and its rules: ``silent`` (dead, GIL
  held, stopped), ``collectives`` (hang, mismatch), ``progress`` (steps, stalls, healthy), ``lockwaits``
  and ``locks``, ``straggler``, ``training`` and ``numerics``, ``memory``; ``unknown`` (what could not be
  had). It reads only: no eval of user code, no collective, no device synchronisation.
* :mod:`probe.diagnose.gather`: one look at every rank, each family's evidence gathered by its module;
  :mod:`probe.diagnose.rules`: the judge, which families run over two such samples and in what order;
  :mod:`probe.diagnose.engine`: when to look.
* ``probe.cli.commands.diagnose`` prints a verdict first, then its evidence (each with the probe command
  that shows it in full), then what to do next; ``--json`` and ``--watch``.
"""

from probe.diagnose.verdict import EXIT_CODES, STATUSES

__all__ = ["EXIT_CODES", "STATUSES"]
