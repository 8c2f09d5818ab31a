"""The distribution's name is probe's own: `probe` on the package index is another project (so are torchprobe and
pyprobe), and a user who follows a hint must not get someone else's code. The command and the import stay `probe`."""

import glob
import os
import re
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = None

import probe
from procs import REPO

TAKEN = {"probe", "torchprobe", "pyprobe"}  # on the index, other projects (checked with `pip index versions`)
# A pip command naming a distribution: `pip install NAME`, `pip install 'NAME[extra]'`; paths and `-e .` are not names.
PIP = re.compile(r"pip install\s+(?:-[a-zA-Z-]+\s+)*['\"]?([A-Za-z][A-Za-z0-9_.-]*)(?:\[[a-z,]+\])?")


def test_the_distribution_has_a_name_of_its_own_and_every_hint_names_it():
    if tomllib is not None:
        with open(os.path.join(REPO, "pyproject.toml"), "rb") as handle:
            name = tomllib.load(handle)["project"]["name"]
        assert name == probe.DISTRIBUTION
    assert probe.DISTRIBUTION.lower() not in TAKEN
    wrong = []
    for folder, _, files in os.walk(os.path.join(REPO, "probe")):
        for file in files:
            if file.endswith((".py", ".md")):
                path = os.path.join(folder, file)
                with open(path, encoding="utf-8") as handle:
                    wrong += ["%s: %s" % (path, m.group(0)) for m in PIP.finditer(handle.read())
                              if m.group(1).lower() in TAKEN]
    for path in [os.path.join(REPO, "README.md")] + glob.glob(os.path.join(REPO, "docs", "*.md")):
        with open(path, encoding="utf-8") as handle:
            wrong += ["%s: %s" % (os.path.relpath(path, REPO), m.group(0)) for m in PIP.finditer(handle.read())
                      if m.group(1).lower() in TAKEN]
    assert not wrong, "hints that install another project's package:\n" + "\n".join(wrong)
