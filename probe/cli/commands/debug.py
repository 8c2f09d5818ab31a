"""``probe TARGET debug``: start debugpy in the target and say how to attach an IDE; ``--stop`` ends it."""

import json
import shlex
from typing import Any, Dict, Iterator, Optional

import click

from probe.cli.context import CliContext, each_target, pass_cli
from probe.cli.output import say
from probe.client import Client
from probe.errors import UsageError

__all__ = ["debug", "render_attach"]


def render_attach(label: str, answer: Dict[str, Any], remote_host: Optional[str],
                  stop_command: Optional[str] = None) -> Iterator[str]:
    """What to tell the user: where debugpy listens, the launch.json entry, the tunnel for a remote target,
    and how to stop it (``stop_command``; default ``probe LABEL debug --stop``)."""
    from probe.agent.debugger import is_loopback

    host, port = answer["host"], answer["port"]
    yield "debugpy %s in process %s on %s:%s" % ("already listens" if answer.get("already") else "listens",
                                                 answer.get("pid"), host, port)
    uid = answer.get("uid")
    who = ("root's processes" if uid == 0 else "the processes of uid %s (and root's)" % uid if uid is not None
           else "the processes of the target's user")
    yield "  it admits only connections from %s on that host%s" % (
        who, "" if is_loopback(str(host)) else ", and, with --insecure, from other hosts")
    if answer.get("window_s"):
        yield "  it stops by itself once no IDE has been attached for %s (and is not started twice in a process)" \
              % _duration(float(answer["window_s"]))
    if answer.get("refused"):
        yield "  it has refused %d connection(s) from other users" % answer["refused"]
    connect_host = host
    if remote_host:
        yield ""
        yield "The target is on %s; forward the port first:" % remote_host
        yield "  ssh -N -L %s:%s:%s %s" % (port, host if host not in ("0.0.0.0", "::") else "127.0.0.1", port,
                                          remote_host)
        connect_host = "127.0.0.1"
    entry = {"name": "probe: attach to %s" % label, "type": "debugpy", "request": "attach",
             "connect": {"host": connect_host, "port": port}, "justMyCode": False}
    yield ""
    yield "VS Code, .vscode/launch.json, under \"configurations\":"
    for line in json.dumps(entry, indent=2).splitlines():
        yield "  " + line
    yield ""
    yield "Stop it with: %s" % (stop_command or "probe %s debug --stop" % label)


def _duration(seconds: float) -> str:
    if seconds >= 120 and seconds % 60 == 0:
        return "%d minutes" % (seconds // 60)
    return "%g s" % seconds


def _remote_host(client: Client) -> Optional[str]:
    """The host to tunnel through, for a target on another host (not a unix socket, not loopback)."""
    from probe.agent.debugger import is_loopback

    if not client.target.is_tcp:
        return None
    host = str(getattr(client.target.address, "host", None) or client.target.label.rsplit(":", 1)[0])
    return None if is_loopback(host) else host


def _stop_command(cli: CliContext, client: Client) -> Optional[str]:
    """How to stop debugpy in this target, as a command that works when followed: across a discovered job,
    through the master's address with ``--ranks`` (discovery finds the job's token); a TCP target listed
    by hand, with the token file given."""
    rank = getattr(cli.cluster_member(client), "rank", None) if cli.is_cluster else None
    if rank is not None and len(cli.targets) == 1 and not cli.hosts:
        return "probe %s --ranks %d debug --stop" % (shlex.quote(cli.targets[0]), rank)
    if client.target.is_tcp and cli.token_file:
        return "probe %s --token-file %s debug --stop" % (shlex.quote(client.target.label), shlex.quote(cli.token_file))
    return None


@click.command("debug")
@click.option("--port", type=click.IntRange(0, 65535), default=None,
              help="Port debugpy listens on in the target (0: any free one). Default: 5678; across ranks or "
                   "several targets 0, since ranks on one host cannot share a port.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface debugpy listens on in the target.")
@click.option("--insecure", is_flag=True,
              help="Allow an interface other than loopback: debugpy has no authentication of its own, so anyone "
                   "who reaches it from another host can run code in the target.")
@click.option("--window", "window", type=click.FloatRange(1, 7 * 86400), default=None, metavar="SECONDS",
              help="Stop by itself once no IDE has been attached for this long.  [default: 600]")
@click.option("--stop", is_flag=True, help="Stop debugpy in the target.")
@pass_cli
def debug(cli: CliContext, port: Optional[int], host: str, insecure: bool, window: Optional[float], stop: bool) -> None:
    """Start debugpy in the target, for VS Code (or any DAP client) to attach to.

    It listens on 127.0.0.1 unless --host and --insecure say otherwise, and admits only connections from
    the target's user (or root), as the kernel's socket table says: other local users are refused. An IDE
    on another host comes in through the printed ssh -L tunnel. It stops by itself once no IDE has been
    attached for --window seconds. debugpy starts once in a process: after --stop it cannot start again
    there, so keep it while you may want it (IDEs attach and detach freely). Refused where eval is off.
    """
    from probe.agent.debugger import is_loopback

    if not stop and not is_loopback(host) and not insecure:
        raise UsageError("debugpy has no authentication of its own: listening on %s lets anyone who reaches it from "
                         "another host run code in the target" % host,
                         hint="keep 127.0.0.1 and tunnel with ssh -L, or insist with --insecure")
    if stop:
        for client, answer in each_target(cli, lambda c: c.debug_stop()):
            say("%s: debugpy %s" % (client.target.label, "stopped" if answer.get("stopped")
                                            else "was not running"))
        return
    several = cli.is_cluster or len(cli.targets) > 1
    chosen = port if port is not None else 0 if several else 5678
    for client, answer in each_target(cli, lambda c: c.debug_start(host, chosen, insecure, window)):
        if several:
            say("== %s ==" % cli.label(client))
        for line in render_attach(client.target.label, answer, _remote_host(client), _stop_command(cli, client)):
            say(line)
