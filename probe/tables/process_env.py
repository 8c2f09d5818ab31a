"""``process.env``: the environment of this process, with secrets masked (the rules: :mod:`probe.tables.redact`)."""

import os
from typing import Any, Iterator, Tuple

from probe.tables.redact import MASK, looks_secret, mask_env_value
from probe.tables.spec import Column

__all__ = ["NAME", "DESCRIPTION", "COLUMNS", "EXAMPLE", "rows", "looks_secret", "MASK"]

NAME = "process.env"
DESCRIPTION = ("Environment variables; secrets masked unless the agent shows them: values of secret-looking names, "
               "URL passwords, secret query parameters and PEM private keys.")
COLUMNS = (
    Column("name", "VARCHAR", "Variable name."),
    Column("value", "VARCHAR",
           "Its value, or '********' where the name looks secret (TOKEN, SECRET, PASSWORD, API_KEY, GITHUB_PAT, "
           "WEBHOOK, ...; CERT is not secret; a *_FILE/_DIR/_PATH name shows a value that is a path); in any value, "
           "the password of scheme://user:password@host, secret-named parameters (?token=, password=) and PEM "
           "private keys are replaced by '********', the rest stays readable."),
    Column("masked", "BOOLEAN", "True when anything in the value was masked."),
)
EXAMPLE = "SELECT name, value FROM process.env WHERE name LIKE 'NCCL%' OR name LIKE 'CUDA%'"

#: Set by the agent from its options (``PROBE_SHOW_SECRETS=1``); tables know nothing else of the agent.
#: ``process.info`` reads it too, for the command line.
show_secrets = False


def rows() -> Iterator[Tuple[Any, ...]]:
    for name, value in sorted(os.environ.items()):
        if show_secrets:
            yield (name, value, False)
        else:
            shown, masked = mask_env_value(name, value)
            yield (name, shown, masked)
