"""The reference page's tables of exit codes and wire error codes (docs/reference.md) say what the code does (no
process needed)."""

import os
import re

import probe.errors as errors
from procs import REPO

REFERENCE = open(os.path.join(REPO, "docs", "reference.md"), encoding="utf-8").read()


def _error_classes():
    return [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.ProbeError)]


def test_every_exit_code_the_code_uses_is_in_the_reference_table_and_no_other():
    table = {int(m) for m in re.findall(r"^\| (\d+) \|", REFERENCE, re.M)}
    from probe.cli import INTERRUPTED
    from probe.cli.context import PARTIAL

    used = {0, 1, PARTIAL, INTERRUPTED} | {c.exit_code for c in _error_classes()}
    assert table == used, "docs/reference.md exit table %s, code %s" % (sorted(table), sorted(used))


def test_the_wire_error_codes_in_the_reference_are_those_an_agent_sends():
    block = REFERENCE[REFERENCE.index("Errors: `{\"error\""):]
    block = block.split("\n\n")[0]
    listed = set(re.findall(r"`([a-z_]+)`", block.split("with codes", 1)[1].split(".", 1)[0]))
    sent = set(errors._BY_CODE)  # what error_from_code rebuilds: the codes an agent puts on the wire
    assert listed == sent, "docs/reference.md lists %s, agents send %s" % (sorted(listed), sorted(sent))
