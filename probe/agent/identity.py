"""Who this agent is: pid, host, and the rank it holds in a distributed job (from the environment)."""

import os
import socket
import sys
from typing import Dict, Optional

__all__ = ["identity"]


def _int_env(name: str) -> Optional[int]:
    value = os.environ.get(name, "")
    try:
        return int(value)
    except ValueError:
        return None


def identity() -> Dict[str, object]:
    """The facts ``/v1/health`` reports; read afresh each time (cheap, and a fork changes the pid)."""
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "rank": _int_env("RANK"),
        "local_rank": _int_env("LOCAL_RANK"),
        "world_size": _int_env("WORLD_SIZE"),
        "python": "%d.%d.%d" % sys.version_info[:3],
        "executable": sys.executable,
    }
