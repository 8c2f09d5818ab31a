"""python.locals below the eval scope (issue 33, item 8): a read token, the page and a snapshot see the values
of secret-looking locals masked by the one rule of probe.tables.redact (the name kept), in the main thread and
in a worker's deeper frames, whether the agent or the client runs the SQL; the eval scope still sees them."""

import json
import socket
import urllib.error
import urllib.request
from typing import Dict, Iterator

import pytest
import hmac_auth
from procs import Proc, run_cli, running, scaled, target_env
from test_page import _end, _post, _serve

from probe.tables.redact import MASK

SECRETS = {"password": "hunter2-main", "secret_token": "tok-main-7f3a", "SECRET_API": "api-main-99",
           "myApiKey": "key-worker-5150", "db_password": "pw-worker-8"}
PLAIN = {"lr": "0.125", "note": "'harmless text'", "batch": "[1, 2, 3]"}
SQL = ("SELECT DISTINCT name, value FROM python.locals WHERE name IN (%s) ORDER BY name"
       % ", ".join("'%s'" % n for n in list(SECRETS) + list(PLAIN) + ["config"]))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module", params=["1", ""], ids=["sql-in-agent", "sql-in-client"])
def target(request, tmp_path_factory) -> Iterator[Dict[str, object]]:
    directory = tmp_path_factory.mktemp("tokens")
    files = {}
    for scope in ("full", "read"):
        path = directory / scope
        path.write_text("locals-test-%s-token\n" % scope)
        path.chmod(0o600)
        files[scope] = str(path)
    port = _free_port()
    env = target_env(PROBE_LISTEN="127.0.0.1:%d" % port, PROBE_TOKEN_FILE=files["full"],
                     PROBE_READ_TOKEN_FILE=files["read"], PROBE_SQL_IN_AGENT=request.param)
    with running("hostile_locals.py", env=env) as proc:
        yield {"address": "127.0.0.1:%d" % port, "files": files, "proc": proc}


def _values(*args: str) -> Dict[str, str]:
    result = run_cli(*args, "query", SQL, "-f", "json", timeout=scaled(60))
    assert result.code == 0, result.err
    return {row["name"]: row["value"] for row in json.loads(result.out)}


def _masked(values: Dict[str, str]) -> None:
    for name in SECRETS:
        assert values.get(name) == MASK, (name, values)  # the name is there, its value masked
    for name, shown in PLAIN.items():
        assert values.get(name) == shown, (name, values)
    assert "dict-pw-42" not in values["config"] and "'user': 'ada'" in values["config"], values["config"]
    assert not any(secret in json.dumps(values) for secret in SECRETS.values()), values


def test_a_read_token_sees_secret_locals_masked_and_eval_sees_them(target) -> None:
    address, files = str(target["address"]), target["files"]
    _masked(_values("--token-file", files["read"], address))
    full = _values("--token-file", files["full"], address)
    assert {n: full[n] for n in SECRETS} == {n: repr(v) for n, v in SECRETS.items()}, full
    mine = _values(str(target["proc"].pid))  # the owner's unix socket: the eval scope
    assert mine["password"] == repr(SECRETS["password"]) and mine["lr"] == "0.125", mine


def test_a_client_may_ask_for_less_and_not_for_more(target) -> None:
    """X-Probe-Scope lowers a request's scope (what probe mcp and the page send); it never raises it."""
    address, files = str(target["address"]), target["files"]
    body = json.dumps({"table": "python.locals"}).encode()  # the raw rows: whatever the agent runs SQL or not

    def ask(token_file: str, scope: str) -> urllib.request.Request:
        with open(token_file) as handle:
            token = handle.read().strip()
        port = int(address.rsplit(":", 1)[1])
        return urllib.request.Request("http://%s/v1/rows" % address, data=body, method="POST", headers={
            "Authorization": hmac_auth.authorization(port, token, "POST", "/v1/rows", body), "X-Probe-Scope": scope,
            "Content-Type": "application/json"})

    with urllib.request.urlopen(ask(files["full"], "read"), timeout=scaled(30)) as answer:
        text = answer.read().decode()
    assert MASK in text and SECRETS["password"] not in text, text[:500]
    with urllib.request.urlopen(ask(files["read"], "eval"), timeout=scaled(30)) as answer:
        text = answer.read().decode()
    assert MASK in text and SECRETS["password"] not in text, text[:500]
    with pytest.raises(urllib.error.HTTPError) as wrong:
        urllib.request.urlopen(ask(files["full"], "root"), timeout=scaled(30))
    assert wrong.value.code == 400 and "X-Probe-Scope" in wrong.value.read().decode()


def test_the_page_s_sql_and_a_snapshot_mask_as_the_read_scope_does(target, tmp_path) -> None:
    proc = target["proc"]
    assert isinstance(proc, Proc)
    page, url = _serve(str(proc.pid), "page", "--refresh", "60")  # the owner's unix socket: eval, capped
    try:
        answer = _post(url, "/api/sql", {"sql": SQL})
    finally:
        _end(page)
    _masked({row[0]: row[1] for row in answer["rows"]})
    made = run_cli(str(proc.pid), "snapshot", "--dir", str(tmp_path), "--json", timeout=scaled(90))
    assert made.code == 0, made.err
    recorded = _values("snapshot:" + json.loads(made.out)["path"])
    _masked(recorded)
    read = _values("--token-file", target["files"]["read"], str(target["address"]))
    assert {n: read[n] for n in recorded} == recorded  # one rule: the snapshot and the read scope agree


def test_every_rank_through_its_node_helper_answers_a_read_token_masked(tmp_path) -> None:
    """--all-ranks goes through the node helper, which asks its ranks over their unix sockets (where it has
    every scope): it asks with the scope of whoever asked it, so a read token still sees masks."""
    from test_node_helper import _ranks, _until, ranks_of

    read = tmp_path / "read"
    read.write_text("locals-test-job-read-token\n")
    read.chmod(0o600)
    with ranks_of(tmp_path, 2, "hostile_locals.py", PROBE_READ_TOKEN_FILE=str(read)) as job:
        master = "127.0.0.1:%d" % job["port"]
        env = job["env"]
        # the helper is the ranks' to start: READY from each rank does not mean it listens yet
        _until(lambda: len(_ranks(job)) == 2, 30, "both ranks listed by the node's helper")
        masked = run_cli("--token-file", str(read), master, "--via", "helpers", "--all-ranks", "query", SQL, "-f",
                         "json", env=env, timeout=scaled(90))
        full = run_cli(master, "--via", "helpers", "--all-ranks", "query", SQL, "-f", "json", env=env,
                       timeout=scaled(90))
    assert masked.code == 0 and full.code == 0, (masked.err, full.err)
    rows = json.loads(masked.out)
    assert sorted({row["rank"] for row in rows}) == [0, 1], rows
    for rank in (0, 1):
        _masked({row["name"]: row["value"] for row in rows if row["rank"] == rank})
    shown = {row["name"]: row["value"] for row in json.loads(full.out) if row["rank"] == 1}
    assert shown["password"] == repr(SECRETS["password"]), shown
