"""The agent skill file skills/probe-debug-hang/SKILL.md is true: its front matter is an agent skill's,
every ``probe ...`` command in it runs against real targets (a process in a lock cycle for PID, a
torchrun job with a rank that skips a collective for MASTER:PORT, a record made here for snapshot:DIR/ID)
and exits as its ``# exit N`` says, and the MCP tools it names are the ones ``probe mcp`` serves."""

import asyncio
import os
import re
import shlex
import sys
import time
from typing import List, Tuple

import pytest

from procs import REPO, run_cli, running, scaled, target_env
from test_cluster import TORCHRUN, torchrun_job

SKILL = os.path.join(REPO, "skills", "probe-debug-hang", "SKILL.md")
_EXIT = re.compile(r"#\s*exit (\d+)\b")


def _text() -> str:
    with open(SKILL) as handle:
        return handle.read()


def commands() -> List[Tuple[List[str], int]]:
    """Every ``probe ...`` line of the file's sh blocks: its words and the exit status its comment says."""
    out, block = [], None
    for line in _text().splitlines():
        if line.startswith("```"):
            block = line[3:].strip() if block is None else None
            continue
        if block == "sh" and line.startswith("probe "):
            said = _EXIT.search(line)
            assert said, "no '# exit N' on: %s" % line
            out.append((shlex.split(line, comments=True), int(said.group(1))))
    return out


def test_front_matter_is_an_agent_skills():
    text = _text()
    assert text.startswith("---\n"), "no front matter"
    head = text.split("---\n", 2)[1]
    fields = dict(line.split(": ", 1) for line in head.strip().splitlines())
    assert fields["name"] == os.path.basename(os.path.dirname(SKILL)) == "probe-debug-hang", fields
    assert 50 < len(fields["description"]) <= 1024 and "diagnose" in fields["description"], fields
    assert len(commands()) >= 10


def _fill(words: List[str], pid: int, master: str, records: str) -> List[str]:
    """The placeholders made real; ID is the newest record in DIR when the command runs."""
    newest = sorted(os.listdir(records), key=lambda n: os.stat(os.path.join(records, n)).st_mtime)[-1:] \
        if os.path.isdir(records) else []
    out = []
    for word in words:
        if word.startswith("snapshot:DIR/ID"):
            assert newest, "a snapshot:DIR/ID command before any record was made"
            word = "snapshot:%s/%s" % (records, newest[0]) + word[len("snapshot:DIR/ID"):]
        out.append({"PID": str(pid), "MASTER:PORT": master, "DIR": records}.get(word, word))
    return out


def _exits_as_said(argv: List[str], code: int) -> None:
    """Run it until it exits as said (a hang's verdict may take a look or two to show), within bounds."""
    deadline = time.monotonic() + scaled(90)
    while True:
        done = run_cli(*argv, timeout=scaled(120))
        if done.code == code or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert done.code == code, "probe %s: exit %d, the skill says %d\n%s\n%s" % (
        " ".join(argv), done.code, code, done.out[-2000:], done.err[-2000:])


@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun (torch) is not installed")
def test_every_probe_command_of_the_skill_exits_as_it_says(tmp_path):
    records = str(tmp_path / "records")
    with running("lock_cycle.py") as proc, \
            torchrun_job("dist_hang.py", 4, timeout=scaled(180), TORCH_FR_BUFFER_SIZE="0") as (port, _):
        master = "127.0.0.1:%d" % port
        for words, code in commands():
            _exits_as_said(_fill(words[1:], proc.pid, master, records), code)


def test_the_mcp_tools_it_names_are_served_and_diagnose_finds_the_hang():
    mcp = pytest.importorskip("mcp", reason="the MCP Python SDK is not installed")
    from mcp.client.stdio import stdio_client

    named = set(re.findall(r"`(\w+)`", _text().split("The tools: ", 1)[1].split(", each taking", 1)[0]))
    with running("lock_cycle.py") as proc:
        params = mcp.StdioServerParameters(command=sys.executable, args=["-m", "probe", "mcp", str(proc.pid)],
                                           cwd=REPO, env=target_env(probe=False))

        async def main():
            async with stdio_client(params) as (read, write):
                async with mcp.ClientSession(read, write) as session:
                    await session.initialize()
                    tools = {tool.name for tool in (await session.list_tools()).tools}
                    verdict = await session.call_tool("diagnose", {})
                    return tools, verdict

        tools, verdict = asyncio.run(asyncio.wait_for(main(), scaled(120)))
    assert named == tools, (named, tools)
    text = "".join(getattr(part, "text", "") for part in verdict.content)
    assert "STUCK" in text and "lock" in text, text[:2000]
