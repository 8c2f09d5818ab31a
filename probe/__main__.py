"""``python -m probe`` is the ``probe`` command."""

from probe.cli import main

main()
