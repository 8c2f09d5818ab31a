"""``probe TARGET health``: is the agent there, and who is it."""

import json

import click

from probe.cli.context import CliContext, each_target, pass_cli
from probe.cli.render import render_unavailable


@click.command("health")
@click.option("--json", "as_json", is_flag=True, help="Print the agent's answer as JSON.")
@pass_cli
def health(cli: CliContext, as_json: bool) -> None:
    """Ask the agent who it is: pid, host, rank, Python, probe version, capabilities.

    \b
    When the agent cannot answer, says why instead (GIL held by which thread and where, stopped, dead
    and how, a core file) and exits 5 (blocked) or 3 (dead).
    """
    for client, info in each_target(cli, lambda c: c.health()):
        if as_json:
            click.echo(json.dumps(dict(info, target=client.target.label)))
            if "agent" in info and "probe_version" not in info:
                cli.exit_code = cli.exit_code or (3 if info.get("state") in ("dead", "core file") else 5)
            continue
        if "agent" in info and "probe_version" not in info:  # the agent could not answer: what is known
            click.echo(render_unavailable(client.target.label, info))
            cli.exit_code = cli.exit_code or (3 if info.get("state") in ("dead", "core file") else 5)
            continue
        caps = ", ".join(k for k, v in sorted(info.get("capabilities", {}).items()) if v)
        rank = "" if info.get("rank") is None else " rank %s/%s" % (info.get("rank"), info.get("world_size"))
        click.echo("%s: pid %s on %s%s, Python %s, probe %s, can: %s" % (
            client.target.label, info.get("pid"), info.get("host"), rank, info.get("python"),
            info.get("probe_version"), caps or "nothing"))
