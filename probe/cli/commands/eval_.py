"""``probe TARGET eval CODE``: run Python in the target's ``__main__``."""

import sys
from typing import Optional

import click

from probe.cli.context import CliContext, each_target, pass_cli
from probe.cli.render import render_eval
from probe.errors import UsageError


@click.command("eval")
@click.argument("code", required=False)
@click.option("-f", "--file", "path", type=click.Path(exists=True, dir_okay=False), help="Read the snippet from a file.")
@click.option("--eval-timeout", type=click.FloatRange(min=0.001), help="Seconds the snippet may run.")
@click.option("--json", "as_json", is_flag=True, help="Print stdout, stderr, value and error as JSON.")
@pass_cli
def eval_(cli: CliContext, code: Optional[str], path: Optional[str], eval_timeout: Optional[float], as_json: bool) -> None:
    """Run CODE (or `-` for stdin, or -f FILE) in the target; a final expression's value is printed.

    Exits non-zero when the snippet raises; its traceback goes to stderr.
    """
    if path:
        with open(path) as handle:
            code = handle.read()
    elif code == "-":
        code = sys.stdin.read()
    if code is None:
        raise UsageError("no code given", hint="probe TARGET eval 'print(1)', eval - (stdin), or eval -f FILE")
    several = len(cli.targets) > 1
    for client, result in each_target(cli, lambda c: c.eval(code or "", timeout=eval_timeout)):
        if as_json:
            import json

            click.echo(json.dumps({"target": client.target.label, "stdout": result.stdout, "stderr": result.stderr,
                                   "value": result.value, "error": result.error, "ok": result.ok}))
        else:
            shown = render_eval(result)
            if several:
                click.echo("== %s ==" % client.target.label)
            if shown["stdout"]:
                click.echo(shown["stdout"], nl=False)
            if shown["stderr"]:
                click.echo(shown["stderr"], nl=False, err=True)
        if not result.ok:
            cli.exit_code = cli.exit_code or 1
