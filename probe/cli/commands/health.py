"""``probe TARGET health``: is the agent there, and who is it."""

import json
from typing import Any, Dict, Iterator, Optional

from probe.cli.commands import made_on_first_use
from probe.cli.context import CliContext, each_target
from probe.cli.output import emit, say
from probe.cli.render import render_unavailable, visible
from probe.cli.spec import TEXT_FORMATS, output_params

PARAMS = output_params(*TEXT_FORMATS, json_help="the agent's answer")
"""The command's options, which click and ``probe.cli.fast`` both read (``probe.cli.spec``)."""


def _command() -> Any:
    import click

    from probe.cli.context import pass_cli
    from probe.cli.options import with_params

    @click.command("health")
    @with_params(PARAMS)
    @pass_cli
    def health(cli: CliContext, fmt: Optional[str]) -> None:
        """Ask the agent who it is: pid, host, rank, Python, probe version, capabilities.

        \b
        When the agent cannot answer, says why instead (GIL held by which thread and where, stopped, dead
        and how, a core file) and exits 5 (blocked) or 3 (dead).
        """
        run(cli, fmt)

    return health


__getattr__ = made_on_first_use("health", _command)


def run(cli: CliContext, fmt: Optional[str] = None) -> None:
    """The command (``probe.cli.fast`` calls it without click)."""
    as_json = fmt == "json"
    for client, info in each_target(cli, lambda c: c.health()):
        if as_json:
            emit(json.dumps(dict(info, target=client.target.label)))
            if "agent" in info and "probe_version" not in info:
                cli.exit_code = cli.exit_code or (3 if info.get("state") in ("dead", "core file") else 5)
            continue
        if "agent" in info and "probe_version" not in info:  # the agent could not answer: what is known
            say(render_unavailable(client.target.label, info))
            cli.exit_code = cli.exit_code or (3 if info.get("state") in ("dead", "core file") else 5)
            continue
        caps = ", ".join(k for k, v in sorted(info.get("capabilities", {}).items()) if v)
        rank = "" if info.get("rank") is None else " rank %s/%s" % (info.get("rank"), info.get("world_size"))
        if rank and info.get("rank_source"):
            rank += " (from %s)" % info["rank_source"]
        say(visible("%s: pid %s on %s%s, Python %s, probe %s, can: %s" % (
            client.target.label, info.get("pid"), info.get("host"), rank, info.get("python"),
            info.get("probe_version"), caps or "nothing")))
        for line in detail_lines(info):
            say("  " + visible(line))


def detail_lines(info: Dict[str, Any]) -> Iterator[str]:
    """Where the agent can be reached, and the limits in force with how far a request may raise them."""
    if info.get("tcp"):
        yield "tcp: %s (bound to %s); token in %s" % (info.get("tcp_reach") or info["tcp"], info["tcp"],
                                                     info.get("token_file") or "the token given to the agent")
    elif info.get("tcp_error"):
        yield "tcp: not served: %s" % info["tcp_error"]
    if info.get("tcp_note"):
        yield "tcp: %s" % info["tcp_note"]
    limits = info.get("limits") or {}
    if "query_timeout_ceiling_s" in limits:
        yield ("limits: query %gs (--query-timeout up to %gs), %d rows (--max-rows up to %d), eval %gs "
               "(--eval-timeout up to %gs), eval output %d characters per stream, results %d MiB"
               % (limits["query_timeout_s"], limits["query_timeout_ceiling_s"], limits["max_rows"],
                  limits["max_rows_ceiling"], limits["eval_timeout_s"], limits["eval_timeout_ceiling_s"],
                  limits["eval_output"], limits["max_result_bytes"] >> 20))
