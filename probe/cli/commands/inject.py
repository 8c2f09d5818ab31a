"""``probe PID inject``: start the agent inside a running Python process (gdb, ptrace)."""

import json
from typing import Optional

import click

from probe.agent.options import AgentOptions
from probe.cli.context import CliContext, pass_cli
from probe.cli.options import TEXT, Seconds, output_format
from probe.cli.output import emit, say
from probe.errors import ProbeError, UsageError


@click.command("inject")
@click.option("--listen", metavar="HOST:PORT", help="Also serve on TCP (a token is required and written to a file).")
@click.option("--token-file", "agent_token_file", metavar="FILE", help="Where the agent reads or writes its TCP token.")
@click.option("--no-eval", is_flag=True, help="Start a read-only agent: eval requests are refused.")
@click.option("--timeout", "--wait", "wait", type=Seconds(0.1), default=None,
              help="Give up after this long, leaving the process running and untraced (default: the global "
                   "--timeout when given, else 5, stretched up to 4x by the machine's load).")
@output_format(*TEXT, json_help="what was done")
@pass_cli
def inject(cli: CliContext, listen: Optional[str], agent_token_file: Optional[str], no_eval: bool,
           wait: Optional[float], fmt: Optional[str]) -> None:
    """Start the probe agent in the process PID (or report the one already there)."""
    import os

    from probe.injector import inject as inject_into

    targets = cli.targets or ([os.environ["PROBE_TARGET"]] if os.environ.get("PROBE_TARGET") else [])
    if not targets:
        raise UsageError("no process given", hint="write `probe PID inject` (`probe list` shows the candidates)")
    if wait is None:
        wait = cli.timeout if cli.timeout_given else None  # None: the injector's default, scaled by the load
    options = AgentOptions(listen=listen, token_file=agent_token_file, eval_enabled=not no_eval)
    for target in targets:
        try:
            if not target.isdigit():
                raise UsageError("inject needs a pid, got %r" % target, hint="write `probe PID inject`")
            result = inject_into(int(target), options, timeout=wait, notice=lambda words: say("probe: " + words,
                                                                                             err=True))
        except ProbeError as exc:
            cli.record(exc, target if len(targets) > 1 else None)
            continue
        if fmt == "json":
            emit(json.dumps({"pid": result.pid, "socket": result.socket_path, "method": result.method,
                                   "elapsed_s": round(result.elapsed, 3), "already_attached": result.already_attached,
                                   "token_file": result.token_file}))
        elif result.already_attached:
            say("%d: an agent already runs there (%s); nothing changed" % (result.pid, result.socket_path))
        else:
            tcp = "; TCP on %s, token in %s" % (listen, result.token_file) if listen else ""
            say("%d: agent started in %.2f s (%s) at %s%s" % (result.pid, result.elapsed, result.method,
                                                                  result.socket_path, tcp))
            say("next: probe %d backtrace | query SQL | eval CODE" % result.pid)
