"""``probe mcp [TARGET]``: an MCP server over stdio, for coding agents (``probe.mcp.server``)."""

from typing import Optional

import click

from probe.cli.context import CliContext, pass_cli


@click.command("mcp")
@click.argument("target", required=False)
@click.option("--allow-eval", is_flag=True,
              help="Offer the eval tool too (the agent still wants a token of the eval scope). Default: read-only.")
@click.option("--max-chars", type=click.IntRange(min=200), default=20000, show_default=True,
              help="The most characters of one tool's answer; what is cut is said.")
@pass_cli
def mcp(cli: CliContext, target: Optional[str], allow_eval: bool, max_chars: int) -> None:
    """Serve probe's tools to a coding agent: an MCP server on stdin/stdout.

    \b
    Tools: list_targets, ranks, backtrace (one or all ranks, grouped), query, tables, schema, diagnose;
    eval only with --allow-eval. TARGET (or -t, $PROBE_TARGET) is the tools' default target; the global
    options (--token-file, --cacert, --timeout...) hold for every call. Needs the MCP SDK:
    pip install 'rankprobe[mcp]' (from a source tree: pip install -e '.[mcp]').
    """
    import os

    from probe.mcp.server import Settings, load_sdk, serve

    load_sdk()  # before anything is served: a clear error where the SDK is missing
    default = target or (cli.targets[0] if cli.targets else None) or os.environ.get("PROBE_TARGET") or None
    serve(Settings(cli, default, allow_eval, max_chars))
