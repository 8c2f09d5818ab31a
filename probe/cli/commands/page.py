"""``probe TARGET page``: a live page for a process or a whole job, served from here until Ctrl-C."""

import socket
from typing import Any, Optional

import click

from probe.cli.context import CliContext, pass_cli
from probe.cli.options import TEXT, Seconds, output_format
from probe.cli.output import say
from probe.errors import UsageError


@click.command("page")
@click.option("--port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="Port to serve on; 0: a free one (printed).")
@click.option("--host", "host", default="127.0.0.1", show_default=True, metavar="ADDR",
              help="Address to serve on. Any address but a loopback one admits other machines too (with the page token).")
@click.option("--refresh", type=Seconds(1.0, 3600.0), default=5.0, show_default=True,
              help="Seconds between the page's refreshes (the page can pause them); answers younger than that "
                   "are given again to every tab.")
@click.option("--steps", type=click.IntRange(2, 1000), default=50, show_default=True,
              help="Steps per rank in the step time and memory charts.")
@output_format(*TEXT, json_help="the page's url, host, port and ssh -L line as one JSON line on stdout, then serve")
@pass_cli
def page(cli: CliContext, port: int, host: str, refresh: float, steps: int, fmt: Optional[str]) -> None:
    """Serve a live page of the job or the process: verdict, ranks, stacks, steps, SQL.

    \b
    TARGET as for diagnose: a pid, or a job (the master's HOST:PROBE_PORT, slurm:JOBID, --hosts FILE, -t
    several times). The page shows diagnose's verdict with its evidence; a grid of every rank coloured by
    state (running, silent, GIL held, stopped, dead) and by stack group (click one: its stacks and its
    process.info row); the grouped stacks of `--all-ranks backtrace` as a flame graph whose frames carry
    their ranks, where a minority departs marked; step time and memory per rank over the last --steps
    steps (the trace where it is on, else the step counter and RSS); a SQL box for one rank or all
    (with --merge), its table downloadable as CSV; and a button that exports the trace for Perfetto.
    It only reads (no eval; its SQL sees secret-looking locals masked, as a snapshot writes them). The
    job's token stays in this process. The page admits only you (your uid, as the kernel says) with the
    page token of the URL printed; for another machine, the ssh -L line printed forwards it. Ctrl-C ends it.
    """
    from probe.cli.commands.diagnose import _target
    from probe.page.data import JobSource, ProcessSource
    from probe.page.server import PageServer, is_loopback

    if any(t.strip().startswith("snapshot:") for t in cli.targets):
        raise UsageError("a snapshot does not change: the page is for a live job or process",
                         hint="read the snapshot with `probe snapshot:PATH diagnose` or `query`")
    from probe.client import transport

    transport.scope_cap = "control"  # trace export at most: its SQL sees secret-looking locals masked
    _, single, command = _target(cli)  # the same reading of TARGET as diagnose's
    label = " ".join(cli.targets) or (("--hosts %s" % cli.hosts) if cli.hosts else "$PROBE_TARGET")
    deadline = cli.deadline or min(10.0, cli.timeout)
    gather = min(deadline, 5.0)  # a refresh's fan-outs: what arrived by then is shown
    source: Any
    if single:
        source = ProcessSource(lambda: cli.clients()[0], command, label, gather, deadline)
    else:
        source = JobSource(_cluster_maker(cli), command, label, gather, deadline)
    try:
        server = PageServer(source, host, port, refresh, steps)
    except OSError as exc:
        raise UsageError("cannot serve on %s:%d: %s" % (host, port, exc.strerror or exc),
                         hint="pick another --port, or 0 for a free one") from None
    url = server.urls()["url"]
    tunnel = "ssh -L %d:127.0.0.1:%d %s" % (server.port, server.port, socket.gethostname())
    if fmt == "json":
        import json

        click.echo(json.dumps({"url": url, "host": host, "port": server.port, "token_needed": True,
                               "admits_uid": server.gate.owner, "ssh": tunnel if is_loopback(host) else None}))
    else:
        click.echo("page: %s" % url)
    if is_loopback(host):
        say("probe: serving the page of %s on this machine only: %s; from another machine: %s and open the URL "
            "there (Ctrl-C ends it)" % (label, server.gate.says(), tunnel), err=True)
    else:
        say("probe: serving on %s, not only this machine: whoever it admits reads the job's stacks and runs SQL in "
            "its ranks, so every request needs the page token (new each start; the job's own token stays here): "
            "%s. Ctrl-C ends it." % (host, server.gate.says()), err=True)
    try:
        server.serve()
    except KeyboardInterrupt:
        say("probe: page stopped", err=True)


def _cluster_maker(cli: CliContext) -> Any:
    """A function that discovers the job afresh (ranks restart, die, get listed), the first time using the
    cluster asked the same way as `probe ... --all-ranks`."""
    from probe.cli.context import _read_hosts
    from probe.client.cluster import DEFAULT_DEADLINE, connect_all, parse_rank_list
    import os

    targets = list(cli.targets) + (_read_hosts(cli.hosts) if cli.hosts else [])
    if not targets and os.environ.get("PROBE_TARGET"):
        targets = [os.environ["PROBE_TARGET"]]
    spec: Any = targets[0] if len(targets) == 1 and not cli.hosts else targets
    deadline = cli.deadline or min(DEFAULT_DEADLINE, cli.timeout)
    ranks: Optional[Any] = parse_rank_list(cli.ranks) if cli.ranks is not None else None

    def make() -> Any:
        cluster = connect_all(spec, cli.token, cli.token_file, cli.timeout, deadline, cli.max_in_flight)
        if ranks is not None:
            cluster = cluster.select(ranks)
        cluster.via = cli.via
        cluster.progress = None
        return cluster

    return make
