"""The commands, one module each, registered in one explicit list (see ``probe.cli.app``)."""
