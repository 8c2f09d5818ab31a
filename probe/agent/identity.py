"""Who this agent is: pid, host, and the rank it holds in a distributed job (see ``probe._rank``: from the
launcher's variables, or from torch.distributed once the program initialised it)."""

import os
import socket
import sys
from typing import Dict

from probe import _rank

__all__ = ["identity"]


def identity() -> Dict[str, object]:
    """The facts ``/v1/health`` reports; read afresh each time (cheap, and a fork changes the pid)."""
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        **_rank.as_fields(_rank.current()),
        "python": "%d.%d.%d" % sys.version_info[:3],
        "executable": sys.executable,
    }
