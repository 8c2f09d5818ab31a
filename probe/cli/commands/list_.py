"""``probe list``: local Python processes, which run an agent, and how to reach each."""

import json
from typing import Any, Dict, List

import click

from probe.cli.render import render_rows
from probe.client.discovery import local_agents
from probe.client.results import Rows


def _command_of(pid: int) -> str:
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _attachable(exclude: set) -> List[Dict[str, Any]]:
    """Python processes without an agent, from the injector's scan (when the injector is available)."""
    try:
        from probe.injector import candidates
    except ImportError:
        return []
    out = []
    for proc in candidates():
        pid = getattr(proc, "pid", None)
        if pid is None or pid in exclude or getattr(proc, "has_agent", False):
            continue
        out.append({"pid": pid, "agent": "no", "rank": None, "python": getattr(proc, "python_version", None),
                    "command": " ".join(getattr(proc, "cmdline", []) or [])[:100],
                    "reach": "probe %d inject" % pid})
    return out


@click.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the processes as JSON rows.")
@click.option("--agents-only", is_flag=True, help="Only processes that run an agent.")
def list_(as_json: bool, agents_only: bool) -> None:
    """Local Python processes: those running an agent, and those that could be attached."""
    records: List[Dict[str, Any]] = []
    for agent in local_agents():
        if not agent.alive:
            continue
        info = agent.health or {}
        reach = "probe %d ..." % agent.pid
        if info.get("tcp"):
            reach += "  or  probe %s ..." % info["tcp"]
        records.append({"pid": agent.pid, "agent": "yes", "rank": info.get("rank"), "python": info.get("python"),
                        "command": _command_of(agent.pid)[:100], "reach": reach})
    if not agents_only:
        records.extend(_attachable({r["pid"] for r in records}))
    if as_json:
        click.echo(json.dumps(records))
        return
    if not records:
        click.echo("no agents found; start one with PROBE=1 in a process's environment, or `probe PID inject`")
        return
    columns = tuple((c, "") for c in ("pid", "agent", "rank", "python", "command", "reach"))
    click.echo(render_rows(Rows(columns, [[r[c] for c, _ in columns] for r in records]), "table"))
