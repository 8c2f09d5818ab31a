"""``probe list``: local Python processes, which run an agent, and how to reach each."""

import json
import os
from typing import Any, Dict, List, Optional

import click

from probe.cli.options import output_format
from probe.cli.render import render_rows, terminal_width
from probe.client.discovery import local_agents, remove_stale_files
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
        job = _helper_reach(pid)
        out.append({"pid": pid, "agent": "no" if job is None else "helper",
                    "rank": None, "python": getattr(proc, "python_version", None),
                    "command": " ".join(getattr(proc, "cmdline", []) or [])[:100],
                    "reach": "probe %d inject" % pid if job is None else job})
    return out


def _helper_reach(pid: int) -> Optional[str]:
    """For a torchrun launcher that runs a host helper (it has no agent, by design): the command that lists
    its job's ranks through it. None for any other process."""
    from probe import _paths
    from probe.agent.options import binds_every_interface, probe_port_binding

    if not os.path.exists(_paths.helper_socket_path(pid)):
        return None
    try:
        with open("/proc/%d/environ" % pid, "rb") as handle:
            pairs = [item.split(b"=", 1) for item in handle.read().split(b"\0") if b"=" in item]
        environ = {k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, v in pairs}
        host, port = probe_port_binding(environ)
    except (OSError, ValueError):
        return "host helper of a torchrun job: probe MASTER:PROBE_PORT ranks"
    shown = "127.0.0.1" if binds_every_interface(host) else ("[%s]" % host if ":" in host else host)
    return "probe %s:%d ranks  (its job's host helper)" % (shown, port)


def _remove_unused_package_dirs() -> None:
    """The injector's copies of probe (``pkg-*``) that no live process imports from any more."""
    try:
        from probe.injector.exposure_users import remove_unused
    except ImportError:
        return
    remove_unused()


def _dead() -> List[Dict[str, Any]]:
    """Processes that died with an agent, from the crash records their agents left (old ones cleaned up)."""
    import time

    from probe.reader import crash

    crash.clean_up()
    out = []
    for record in crash.records():
        if record.alive:
            continue
        when = " " + time.strftime("%m-%d %H:%M:%S", time.localtime(record.died_at)) if record.died_at else ""
        out.append({"pid": record.pid, "agent": "dead", "state": "died%s: %s" % (when, record.cause),
                    "rank": None, "python": record.header.get("python"),
                    "command": record.header.get("command", "")[:100],
                    "reach": "probe %d backtrace  (its last stacks)" % record.pid if record.has_stacks else "-"})
    return out


@click.command("list")
@output_format("table", "json", json_help="the processes as JSON rows")
@click.option("--agents-only", is_flag=True, help="Only processes that run (or ran) an agent.")
@click.option("-x", "--vertical", is_flag=True, help="One column per line, each process in its block, values whole.")
@click.option("--wide", is_flag=True, help="Cut no cell and do not fit the table to the terminal.")
def list_(fmt: Optional[str], agents_only: bool, vertical: bool, wide: bool) -> None:
    """Local Python processes: those running an agent, those that could be attached, and those that
    died with an agent (how, and when: their crash records are kept 7 days, the newest 20)."""
    records: List[Dict[str, Any]] = []
    remove_stale_files()  # sockets and tokens of agents and host helpers that died without their exit hooks
    _remove_unused_package_dirs()
    for agent in local_agents():
        if agent.blocked:
            records.append({"pid": agent.pid, "agent": "blocked", "state": agent.error, "rank": None,
                            "python": None, "command": _command_of(agent.pid)[:100],
                            "reach": "probe %d backtrace  (read from outside)" % agent.pid})
            continue
        if not agent.alive:
            continue
        info = agent.health or {}
        reach = "probe %d ..." % agent.pid
        if info.get("tcp"):
            reach += "  or  probe %s%s ..." % (info.get("tcp_reach") or info["tcp"],
                                              " --token-file %s" % info["token_file"] if info.get("token_file") else "")
        records.append({"pid": agent.pid, "agent": "yes", "state": "running", "rank": info.get("rank"),
                        "python": info.get("python"), "command": _command_of(agent.pid)[:100], "reach": reach})
    if not agents_only:
        records.extend(dict(r, state="running") for r in _attachable({r["pid"] for r in records}))
    records.extend(_dead())
    if fmt == "json":
        click.echo(json.dumps(records))
        return
    if not records:
        click.echo("no agents found; start one with PROBE=1 in a process's environment, or `probe PID inject`")
        return
    columns = tuple((c, "") for c in ("pid", "agent", "state", "rank", "python", "command", "reach"))
    table = Rows(columns, [["-" if r[c] is None else r[c] for c, _ in columns] for r in records])
    click.echo(render_rows(table, "vertical" if vertical else "table", terminal_width(), wide))
