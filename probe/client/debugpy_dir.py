"""A directory that exposes this process's debugpy, and nothing else, to a target on the same host.

The injector makes probe importable in a target whose environment lacks it the same way (see
``probe.injector.bootstrap_line``): a private directory holding one symbolic link to the package. The
agent puts it on ``sys.path`` only for the import. Nothing is imported here: ``find_spec`` locates
debugpy without running it.
"""

import hashlib
import importlib.util
import os
from typing import Optional

from probe import _paths

__all__ = ["exposure_dir"]


def exposure_dir() -> Optional[str]:
    """``<runtime dir>/pkg-debugpy-<hash>`` with ``debugpy`` -> this process's debugpy; None without one."""
    try:
        spec = importlib.util.find_spec("debugpy")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    source = os.path.dirname(os.path.realpath(spec.origin))
    try:
        path = os.path.join(_paths.ensure_runtime_dir(),
                            "pkg-debugpy-" + hashlib.sha256(source.encode()).hexdigest()[:16])
        os.makedirs(path, mode=0o700, exist_ok=True)
        link = os.path.join(path, "debugpy")
        if os.path.realpath(link) != source:
            tmp = "%s.%d.tmp" % (link, os.getpid())
            os.symlink(source, tmp)
            os.replace(tmp, link)
    except OSError:
        return None
    return path
