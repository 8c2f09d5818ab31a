"""What SQL costs the target's memory: a query of the simplest shape over one table (columns, ORDER BY,
LIMIT) is answered without DuckDB and pyarrow, which add some 100 MB to a process once loaded, and
answers exactly what DuckDB answers; DuckDB's database, once loaded, is closed after a quiet period
(``PROBE_SQL_QUIET``) and opened again by the next query that needs it."""

import json
import time

import pytest

import probe
from probe.errors import SQLError
from procs import scaled, target_env

pytest.importorskip("duckdb")

SAME = [
    "SELECT * FROM plain.t",
    "SELECT name, score FROM plain.t ORDER BY id DESC",
    "select ok, n, id from plain.t order by ok, n desc, id limit 4",
    "SELECT big, name FROM plain.t ORDER BY name",
    "SELECT id FROM plain.t ORDER BY big DESC, id",
    "SELECT name, id FROM plain.t ORDER BY n LIMIT 0",
    "SELECT Name FROM plain.t ORDER BY NAME;",
    # WHERE terms joined by AND, and count(*) (issue 24: the shapes a client would run otherwise)
    "SELECT id, name FROM plain.t WHERE ok ORDER BY id",
    "SELECT id FROM plain.t WHERE NOT ok AND n >= 0 ORDER BY id DESC",
    "SELECT id FROM plain.t WHERE name = 'beta'",
    "SELECT id, name FROM plain.t WHERE name > 'b' AND name <> 'zeta' ORDER BY name",
    "SELECT id FROM plain.t WHERE name LIKE '%e%' AND name NOT LIKE '_m%' ORDER BY id",
    "SELECT id FROM plain.t WHERE n IS NULL",
    "SELECT id, big FROM plain.t WHERE big IS NOT NULL AND big < 1099511627776 ORDER BY big",
    "SELECT id FROM plain.t WHERE ok = false ORDER BY id LIMIT 1",
    "SELECT id FROM plain.t WHERE n != -3 AND n <= 10 ORDER BY n, id",
    "SELECT id, name FROM plain.t WHERE name = 'it''s' ORDER BY id",
    "select count(*) from plain.t",
    "SELECT count(*) AS Rows_Left FROM plain.t WHERE n > 0 AND ok",
    "SELECT count( * ) FROM plain.t WHERE name IS NULL LIMIT 0",
]
COUNTED = "SELECT id FROM plain.t WHERE score > 1.5 ORDER BY id"  # a NaN to compare: DuckDB answers
LOADED = "sorted(m for m in ('duckdb', 'pyarrow') if m in __import__('sys').modules)"


def _rows(client, sql: str, max_rows=None):
    rows = client.query_rows(sql, max_rows=max_rows)
    return rows.columns, json.dumps(rows.rows), rows.truncated


def test_simple_queries_need_no_duckdb_and_answer_as_duckdb_does(target_factory):
    proc = target_factory("plain_table.py")
    client = probe.connect(str(proc.pid))
    simple = {sql: _rows(client, sql) for sql in SAME}
    capped = _rows(client, "SELECT id FROM plain.t ORDER BY id", max_rows=2)
    assert capped[1] == "[[1], [2]]" and capped[2] is True
    assert client.eval(LOADED).value == "[]", "a simple query loaded DuckDB or pyarrow"
    for sql, answer in simple.items():  # the same query through DuckDB: a comment takes it off the simple path
        assert _rows(client, "-- through DuckDB\n" + sql) == answer, sql
    assert _rows(client, "-- through DuckDB\nSELECT id FROM plain.t ORDER BY id", max_rows=2) == capped
    assert client.eval(LOADED).value == "['pyarrow']"  # DuckDB runs in the agent's worker process
    assert _rows(client, COUNTED)[1] == "[[1], [2], [5], [6]]"  # NaN > 1.5 in DuckDB
    nan = _rows(client, "SELECT score FROM plain.t ORDER BY score")  # a NaN to sort by: DuckDB answers
    assert nan[1] == "[[-1.25], [2.5], [7.0], [1e+300], [NaN], [null]]", nan
    with pytest.raises(SQLError) as missing:
        client.query_rows("SELECT nope FROM plain.t")
    assert "nope" in str(missing.value)


def test_duckdb_is_closed_after_a_quiet_period_and_opened_again(target_factory):
    proc = target_factory("plain_table.py", env=target_env(PROBE_SQL_QUIET="1"))
    client = probe.connect(str(proc.pid))
    engine = "__import__('probe.agent', fromlist=['current']).current()._engine is not None"
    grouped = "SELECT ok, count(*) AS n FROM plain.t GROUP BY ok ORDER BY ok NULLS FIRST"
    first = client.query_rows(grouped).rows
    assert client.eval(engine).value == "True"
    deadline = time.monotonic() + scaled(10)
    while client.eval(engine).value == "True":
        assert time.monotonic() < deadline, "DuckDB's database was not closed after 1 s without a query"
        time.sleep(0.2)
    assert client.query_rows(grouped).rows == first
    assert client.eval(engine).value == "True"
