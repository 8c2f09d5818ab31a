"""The client layer stays below what is built on it (issue 35): no import statement in probe/client, deferred
ones included, names snapshot, diagnose, cli, page, host or mcp; no file of it passes 600 lines; and every
source kind answers the calls of the Source interface with the same parameters."""

import ast
import inspect
import os

from procs import REPO

from probe.client.sources import Source

ABOVE = ("probe.snapshot", "probe.diagnose", "probe.cli", "probe.page", "probe.host", "probe.mcp")
CLIENT = os.path.join(REPO, "probe", "client")


def _imports(path):
    """Every module an import statement in ``path`` names (anywhere in the file)."""
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module
            yield from ("%s.%s" % (node.module, a.name) for a in node.names)


def test_the_client_imports_nothing_built_on_it_and_no_file_of_it_is_long():
    wrong, long = [], []
    for name in sorted(os.listdir(CLIENT)):
        if not name.endswith(".py"):
            continue
        path = os.path.join(CLIENT, name)
        wrong += ["%s imports %s" % (name, m) for m in _imports(path) if m in ABOVE or m.startswith(tuple(a + "." for a in ABOVE))]
        lines = sum(1 for _ in open(path))
        if lines > 600:
            long.append("%s: %d lines" % (name, lines))
    assert wrong == [] and long == []


def test_every_source_kind_answers_the_source_calls():
    from probe.client import Client
    from probe.snapshot.target import RecordClient

    calls = [n for n, v in vars(Source).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert {"health", "tables", "schema", "table_rows", "backtrace", "query_rows", "query", "eval"} <= set(calls)
    for kind in (Client, RecordClient):
        for call in calls:
            wanted = list(inspect.signature(getattr(Source, call)).parameters)
            have = inspect.signature(getattr(kind, call)).parameters
            if any(p.kind == p.VAR_POSITIONAL for p in have.values()):
                continue  # a call the kind refuses whatever it is given
            assert list(have)[:len(wanted)] == wanted, (kind.__name__, call)
    assert Client.refuses == frozenset() and "eval" in RecordClient.refuses


def test_a_snapshot_target_opens_through_the_kind_its_module_registered():
    from probe.client.sources import kind_for, registered_prefixes

    import probe.snapshot.target  # noqa: F401  (registers snapshot:)

    assert "snapshot:" in registered_prefixes()
    kind = kind_for("snapshot:/nowhere")
    assert kind is not None and kind.every is not None
