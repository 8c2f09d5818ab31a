"""``probe mcp`` (issue 22): the MCP SDK's own client over stdio against a real agent (TCP, with a full and a
read token): the tools listed, a backtrace and a query, a bounded answer, eval refused without --allow-eval,
run with it and the full token, refused to the read token."""

import asyncio
import socket
import sys

import pytest

from procs import REPO, running, scaled, target_env
from test_node_helper import ranks_of

mcp = pytest.importorskip("mcp", reason="the MCP Python SDK is not installed (pip install 'probe[mcp]', Python 3.10+)")
from mcp import ClientSession, StdioServerParameters  # noqa: E402
from mcp.client.stdio import stdio_client  # noqa: E402


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokens")
    files = {}
    for scope in ("full", "read"):
        path = directory / scope
        path.write_text("mcp-test-%s-token\n" % scope)
        path.chmod(0o600)
        files[scope] = str(path)
    port = _free_port()
    env = target_env(PROBE_LISTEN="127.0.0.1:%d" % port, PROBE_TOKEN_FILE=files["full"],
                     PROBE_READ_TOKEN_FILE=files["read"])
    with running("idle.py", env=env) as proc:
        yield {"address": "127.0.0.1:%d" % port, "files": files, "pid": proc.pid}


def _text(result) -> str:
    return "\n".join(getattr(block, "text", "") for block in result.content)


def _is_error(result) -> bool:
    return bool(getattr(result, "is_error", None) or getattr(result, "isError", None))


def _session(args, calls, env=None):
    """Start ``probe ARGS`` as an MCP server, run ``calls(session)`` (a coroutine function) on a fresh
    session, and return what it returns; bounded: the server is ended with the client."""
    params = StdioServerParameters(command=sys.executable, args=["-m", "probe", *args], cwd=REPO,
                                   env=env or target_env(probe=False))

    async def main():
        async with stdio_client(params) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                return await calls(session)

    return asyncio.run(asyncio.wait_for(main(), scaled(90)))


def test_the_tools_read_a_live_target_and_eval_is_off(target):
    address, full = target["address"], target["files"]["full"]

    async def calls(session):
        tools = sorted(tool.name for tool in (await session.list_tools()).tools)
        stacks = await session.call_tool("backtrace", {})
        rows = await session.call_tool("query", {"sql": "SELECT pid, 6 * 7 AS answer FROM process.info"})
        long = await session.call_tool("query", {"sql": "SELECT repeat('x', 100) AS s FROM range(1000)",
                                                 "max_rows": 1000})
        tables = await session.call_tool("tables", {})
        schema = await session.call_tool("schema", {"table": "process.info"})
        refused = await session.call_tool("eval", {"code": "6 * 7"})
        missing = await session.call_tool("backtrace", {"target": "127.0.0.1:1"})
        listed = await session.call_tool("list_targets", {})
        return tools, stacks, rows, long, tables, schema, refused, missing, listed

    tools, stacks, rows, long, tables, schema, refused, missing, listed = _session(
        ["--token-file", full, "mcp", address, "--max-chars", "2000"], calls)
    assert tools == ["backtrace", "diagnose", "list_targets", "query", "ranks", "schema", "tables"]
    assert not _is_error(stacks) and "MainThread" in _text(stacks) and "data_loader_wait" in _text(stacks), _text(stacks)
    assert not _is_error(rows)
    assert _text(rows).splitlines()[:2] == ["pid,answer", "%d,42" % target["pid"]], _text(rows)
    assert len(_text(long)) < 2300 and "[cut: " in _text(long) and "LIMIT" in _text(long), _text(long)[-300:]
    assert "probe." in _text(tables) and "pid" in _text(schema), (_text(tables), _text(schema))
    assert _is_error(refused) and "eval" in _text(refused), _text(refused)
    assert _is_error(missing) and "127.0.0.1:1" in _text(missing), _text(missing)
    assert not _is_error(listed) and str(target["pid"]) in _text(listed), _text(listed)


def test_eval_with_allow_eval_needs_the_eval_scope(target):
    address, files = target["address"], target["files"]

    async def calls(session):
        tools = [tool.name for tool in (await session.list_tools()).tools]
        return tools, await session.call_tool("eval", {"code": "6 * 7"})

    tools, ran = _session(["--token-file", files["full"], "mcp", "--allow-eval", address], calls)
    assert "eval" in tools
    assert not _is_error(ran) and _text(ran).strip() == "42", _text(ran)

    _, refused = _session(["--token-file", files["read"], "mcp", "--allow-eval", address], calls)
    assert _is_error(refused) and "needs the eval scope" in _text(refused), _text(refused)


def test_a_job_s_ranks_and_their_grouped_stacks(tmp_path):
    with ranks_of(tmp_path, 2, GIL_RANK="none") as job:
        master = "127.0.0.1:%d" % job["port"]

        async def calls(session):
            async def listed():
                return await session.call_tool("ranks", {})

            ranks = await listed()
            for _ in range(int(scaled(30) / 0.5)):  # the node helper may still be gathering its ranks
                if not _is_error(ranks) and _text(ranks).count("running") == 2:
                    break
                await asyncio.sleep(0.5)
                ranks = await listed()
            return ranks, await session.call_tool("backtrace", {"all_ranks": True})

        ranks, stacks = _session(["mcp", master], calls, env=job["env"])
        assert not _is_error(ranks) and _text(ranks).count("running") == 2, _text(ranks)
        assert not _is_error(stacks) and "ranks 0-1 (2)" in _text(stacks), _text(stacks)
