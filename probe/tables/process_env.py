"""``process.env``: the environment of this process, with secret-looking values masked."""

import os
import re
from typing import Any, Iterator, Tuple

from probe.tables.spec import Column

__all__ = ["NAME", "DESCRIPTION", "COLUMNS", "EXAMPLE", "rows", "looks_secret", "MASK"]

NAME = "process.env"
DESCRIPTION = "Environment variables; values of names that look like secrets are masked unless the agent shows them."
COLUMNS = (
    Column("name", "VARCHAR", "Variable name."),
    Column("value", "VARCHAR", "Its value, or '********' where the name looks like a secret."),
    Column("masked", "BOOLEAN", "True when the value was masked."),
)
EXAMPLE = "SELECT name, value FROM process.env WHERE name LIKE 'NCCL%' OR name LIKE 'CUDA%'"

MASK = "********"
_SECRET = re.compile(r"TOKEN|SECRET|PASSW|PASSPHRASE|KEY|CREDENTIAL|AUTH|PRIVATE|SESSION|COOKIE|SIGNATURE|CERT",
                     re.IGNORECASE)

#: Set by the agent from its options (``PROBE_SHOW_SECRETS=1``); tables know nothing else of the agent.
show_secrets = False


def looks_secret(name: str) -> bool:
    return bool(_SECRET.search(name))


def rows() -> Iterator[Tuple[Any, ...]]:
    for name, value in sorted(os.environ.items()):
        masked = not show_secrets and looks_secret(name)
        yield (name, MASK if masked else value, masked)
