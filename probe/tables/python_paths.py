"""``python.paths``: where this interpreter keeps library code (its prefixes, standard library,
site-packages, user site) and where probe's own package is, so that a reader elsewhere (``diagnose``)
tells the program's own frames from a library's by the target's layout, not by a folder's name.
Runs in the target: stdlib only, nothing imported that the interpreter does not have already but
``sysconfig`` and ``site`` (both loaded at start-up by almost every interpreter)."""

import os
import sys
from typing import List, Tuple

from probe.tables.spec import Column

__all__ = ["NAME", "DESCRIPTION", "COLUMNS", "EXAMPLE", "rows"]

NAME = "python.paths"
DESCRIPTION = "Where this interpreter keeps library code, and probe's own package: one row a directory."
COLUMNS = (
    Column("kind", "VARCHAR", "What the directory is: prefix, base_prefix, exec_prefix (sys), stdlib, platstdlib, "
                              "purelib, platlib (sysconfig), site (site.getsitepackages()), user_site, or probe "
                              "(probe's own package)."),
    Column("path", "VARCHAR", "The directory."),
)
EXAMPLE = "SELECT kind, path FROM python.paths"


def rows() -> List[Tuple[str, str]]:
    import site
    import sysconfig

    out: List[Tuple[str, str]] = []
    for kind in ("prefix", "base_prefix", "exec_prefix"):
        value = getattr(sys, kind, None)
        if isinstance(value, str) and value:
            out.append((kind, value))
    try:
        paths = sysconfig.get_paths()
    except Exception:  # a broken sysconfig: the other kinds still say something
        paths = {}
    for kind in ("stdlib", "platstdlib", "purelib", "platlib"):
        if paths.get(kind):
            out.append((kind, str(paths[kind])))
    try:
        out += [("site", str(p)) for p in site.getsitepackages()]
    except Exception:  # an embedded or -S interpreter's site may lack it
        pass
    try:
        out.append(("user_site", str(site.getusersitepackages())))
    except Exception:
        pass
    out.append(("probe", os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # probe/tables/.. : the package
    return out
