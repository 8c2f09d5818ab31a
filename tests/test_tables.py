"""Every table keeps its promise: described, typed, and producing rows that match its declared schema."""

import re

import pytest

import probe
from probe.errors import NotFound, TorchNotLoaded
from probe.tables import list_tables, produce_rows
from probe.tables.arrow import to_arrow
from procs import REPO


def test_every_table_and_column_is_described():
    tables = list_tables()
    assert {t.name for t in tables} >= {"python.backtrace", "python.threads", "python.modules", "process.info",
                                        "process.env"}
    for table in tables:
        assert table.description.strip(), table.name
        for column in table.columns:
            assert column.description.strip(), "%s.%s" % (table.name, column.name)


MAY_BE_EMPTY = ("python.workers", "probe.audit", "python.locks")  # no DataLoader workers; nothing audited yet; no `with` held


def test_builtin_rows_match_their_declared_schema():
    pytest.importorskip("pyarrow")
    import threading

    release = threading.Event()
    other = threading.Thread(target=release.wait, name="other", daemon=True)
    other.start()  # python.backtrace leaves out the thread that asks; this one it shows
    try:
        _check_all_tables()
    finally:
        release.set()
        other.join(5)


def _check_all_tables():
    for table in list_tables():
        try:
            produced = produce_rows(table)
        except TorchNotLoaded:
            continue  # this process has no torch: tests/test_torch_tables.py checks them on one that has
        except NotFound:
            assert table.name in ("python.torch_trace", "torch.anomalies"), table.name
            continue  # torch is loaded (an earlier test loaded it here) but no trace ran: test_torch_trace.py
        data = to_arrow([(c.name, c.type) for c in table.columns], produced)  # raises on a wrong type
        assert data.schema.names == list(table.column_names)
        # no model here: torch tables may be empty; no DataLoader either: python.workers is
        assert data.num_rows > 0 or "torch" in table.name or table.name in MAY_BE_EMPTY, table.name


def test_every_table_answers_select_star_in_a_real_agent(idle_target):
    client = probe.connect(str(idle_target.pid))
    for info in client.tables():
        try:
            table = client.query("SELECT * FROM %s" % info.name)
        except TorchNotLoaded:
            continue  # idle.py never imports torch; tests/test_torch_tables.py covers these tables
        assert table.schema.names == [c.name for c in info.columns], info.name
        assert table.num_rows > 0 or info.name in MAY_BE_EMPTY, info.name


def test_design_examples_run_unchanged(idle_target):
    client = probe.connect(str(idle_target.pid))
    rows = client.query_rows("SELECT func, file, lineno, depth FROM python.backtrace ORDER BY depth LIMIT 10")
    assert rows.column_names == ["func", "file", "lineno", "depth"] and len(rows.rows) == 10
    assert [r[3] for r in rows.rows] == sorted(r[3] for r in rows.rows)


def test_the_reference_names_every_command_and_table():
    from probe.cli.app import COMMANDS

    with open("%s/docs/reference.md" % REPO, encoding="utf-8") as handle:
        reference = handle.read()
    with open("%s/docs/tables.md" % REPO, encoding="utf-8") as handle:
        tables = handle.read()
    for name in COMMANDS:
        assert re.search(r"probe [^\n]*\b%s\b" % name, reference), "docs/reference.md does not show `%s`" % name
    for table in list_tables():
        assert "| `%s` |" % table.name in tables, "docs/tables.md has no row for %s" % table.name


def test_a_rows_function_may_return_arrow_and_every_path_still_answers():
    """A table whose rows function returns a pyarrow.Table (python.torch_trace does): passed through to
    SQL, cast where its types differ, turned back into rows for /v1/rows, refused when it does not fit."""
    import datetime

    import pyarrow as pa

    from probe.engine import Engine
    from probe.tables import register_table, unregister_table
    from probe.tables.registry import get_table, produce_arrow

    stamp = datetime.datetime(2026, 11, 22, 8, 0, 0)
    columns = [("step", "BIGINT", ""), ("loss", "DOUBLE", ""), ("at", "TIMESTAMP", "")]
    data = {"t": pa.table({"step": pa.array([1, 2], pa.int32()), "loss": [0.5, 0.25],
                           "at": pa.array([stamp, stamp], pa.timestamp("ns"))})}
    register_table("testarrow.steps", columns, lambda: data["t"], "rows as Arrow")
    try:
        spec = get_table("testarrow.steps")
        table = produce_arrow(spec)
        assert table.schema.field("step").type == pa.int64() and table.num_rows == 2  # cast to the declared type
        micros = int((stamp - datetime.datetime(1970, 1, 1)).total_seconds() * 1_000_000)
        assert produce_rows(spec) == [(1, 0.5, micros), (2, 0.25, micros)]  # /v1/rows: TIMESTAMP as microseconds
        engine = Engine(lambda name: produce_arrow(get_table(name)) if get_table(name) else None)
        try:
            result = engine.query("SELECT sum(step) AS s, max(loss) AS m FROM testarrow.steps")
            assert result.table.to_pylist() == [{"s": 3, "m": 0.5}]
        finally:
            engine.close()
        data["t"] = pa.table({"step": [1], "other": [2.0]})
        with pytest.raises(ValueError, match="does not fit the declared columns"):
            produce_arrow(spec)
    finally:
        unregister_table("testarrow.steps")


@pytest.mark.parametrize("path", ["direct", "public"])
def test_both_ways_the_engine_runs_a_query_give_the_same_answers_and_limits(path):
    """The engine runs a query through DuckDB's private ``_submit`` where it exists and passes its check
    (one bind instead of two), else through the public ``sql().to_arrow_reader()``: both give the same
    rows, row cap, errors, time limit, and no reading of the process's Python variables."""
    import duckdb

    from probe.engine import Engine, sandbox
    from probe.errors import SQLError, Timeout
    from probe.tables.registry import get_table, produce_arrow

    engine = Engine(lambda name: produce_arrow(get_table(name)) if get_table(name) else None, timeout=0.5)
    try:
        if path == "direct":
            if not hasattr(duckdb.connect(":memory:").cursor(), "_submit"):
                pytest.skip("this DuckDB has no _submit: the engine uses the public path only")
            assert engine._reader is sandbox._direct_reader, "DuckDB has _submit, but the engine's check refused it"
        else:
            engine._reader = sandbox._public_reader
        result = engine.query("SELECT count(*) AS n FROM python.threads WHERE is_main")
        assert result.table.to_pylist() == [{"n": 1}]
        result = engine.query("SELECT range AS r FROM range(5000)", max_rows=2100)
        assert result.table.num_rows == 2100 and result.truncated
        plan = engine.query("EXPLAIN SELECT thread_name FROM python.threads")
        assert plan.table.num_rows >= 1
        with pytest.raises(SQLError, match="nothere"):
            engine.query("SELECT * FROM nothere")
        hidden_python_value = [1, 2, 3]  # noqa: F841  a replacement scan would read it
        with pytest.raises(SQLError, match="hidden_python_value"):
            engine.query("SELECT * FROM hidden_python_value")
        with pytest.raises(Timeout):
            engine.query("SELECT sum(a.range * b.range) FROM range(100000) a, range(100000) b")
    finally:
        engine.close()
