"""The collector's objects are read without ever letting the program run while probe holds them all
(``probe.tables.tracked``). A thread of the target keeps a tuple half built (tests/targets/tuple_builder.py);
every table that looks through the collector is asked again and again, and the target must live on, its
builder still building. Before, a Lightning rank died so (SystemError in tuple()) while the node helper
read its trainer."""

import pytest

from procs import run_cli, running, scaled

pytest.importorskip("torch")

# each reaches the collector: the tensors, the models and optimizers (none in __main__ or the frames) and
# their schedulers, the DataLoader iterators
QUERIES = ("SELECT count(*) AS n FROM torch.tensors", "SELECT count(*) AS n FROM torch.parameters",
           "SELECT count(*) AS n FROM torch.optimizers", "SELECT count(*) AS n FROM python.workers")


def test_scans_of_every_tracked_object_never_expose_an_unfinished_tuple():
    with running("tuple_builder.py") as proc:
        before = int(run_cli(str(proc.pid), "eval", "built").out.strip() or 0)
        for round_ in range(4):
            for sql in QUERIES:
                done = run_cli(str(proc.pid), "query", sql, "-f", "csv", timeout=scaled(60))
                assert proc.alive(), "the target died at round %d of %r: %s" % (
                    round_, sql, proc.popen.stderr.read().decode() if proc.popen.stderr else "")
                assert done.code == 0, done.err
        assert run_cli(str(proc.pid), "query", QUERIES[0], "-f", "csv").out.split() == ["n", "50"]
        after = run_cli(str(proc.pid), "eval", "built")
        assert after.code == 0 and int(after.out.strip()) > before, after.out + after.err
