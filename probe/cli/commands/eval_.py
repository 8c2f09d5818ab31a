"""``probe TARGET eval CODE``: run Python in the target's ``__main__`` (or in one of its frames)."""

import os
import sys
import uuid
from typing import Any, Callable, Dict, List, Optional

import click

from probe.cli.context import CliContext, each_target, pass_cli
from probe.cli.options import TEXT, Seconds, output_format
from probe.cli.output import emit, say
from probe.cli.render import render_eval
from probe.client import Client
from probe.client.results import EvalResult
from probe.errors import AgentBlocked, ProbeError, Timeout, UsageError

__all__ = ["eval_", "placement_options", "placement"]


def placement_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Where a snippet runs and whose names it sees: shared by ``eval`` and ``repl``."""
    options = [
        click.option("--on", "on", type=click.Choice(["agent", "main"]), default="agent", show_default=True,
                     help="agent: the agent's own thread, while the program runs on (what the snippet reads may "
                          "change under it). main: the main thread, at its next bytecode boundary; the main thread "
                          "waits while the snippet runs (it may have stopped in the middle of a Python-level "
                          "update)."),
        click.option("--between-steps", is_flag=True,
                     help="torch jobs: run right after the next optimizer step, on the thread that ran it."),
        click.option("--frame", metavar="THREAD:DEPTH",
                     help="Evaluate in that frame's namespace (THREAD: a name such as MainThread, or an ident; "
                          "DEPTH as python.backtrace counts it, or a function's name). Before Python 3.13 the "
                          "frame's local variables are read-only."),
        click.option("--start-within", "wait", type=Seconds(0.01, 600),
                     help="With --on main / --between-steps: how long to wait for that moment "
                          "(default 10 / 60); after it nothing runs."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def placement(on: str, between_steps: bool, frame: Optional[str], wait: Optional[float]) -> Dict[str, Any]:
    """The client's ``eval`` keyword arguments for these options."""
    if between_steps and on != "agent":
        raise UsageError("--on main and --between-steps exclude each other")
    return {"on": "step" if between_steps else on, "frame": frame, "wait": wait}


@click.command("eval")
@click.argument("code", required=False)
@click.option("-f", "--file", "path", type=click.Path(dir_okay=False), help="Read the snippet from a file.")
@click.option("--eval-timeout", type=Seconds(0.001), help="Seconds the snippet may run.")
@output_format(*TEXT, json_help="stdout, stderr, value and error, exact")
@placement_options
@pass_cli
def eval_(cli: CliContext, code: Optional[str], path: Optional[str], eval_timeout: Optional[float], fmt: Optional[str],
          on: str, between_steps: bool, frame: Optional[str], wait: Optional[float]) -> None:
    """Run CODE (or `-` for stdin, or -f FILE) in the target; a final expression's value is printed.

    By default the snippet runs on the agent's thread, concurrently with the program: a value it reads
    twice may differ. --on main or --between-steps run it where the program's state holds still.
    Exits non-zero when the snippet raises; its traceback goes to stderr.

    What the snippet prints is passed on exactly when stdout (stderr) is a pipe or a file; on a terminal
    its control characters are shown as escapes (ESC as \\x1b), so that its output cannot act on the
    terminal.
    """
    as_json = fmt == "json"
    where = placement(on, between_steps, frame, wait)
    if path and code is not None:
        raise UsageError("both CODE and -f %s were given" % path, hint="give the snippet one way: CODE, - or -f FILE")
    if path:
        code = _read_snippet(path)
    elif code == "-":
        code = sys.stdin.read()
    if code is None:
        raise UsageError("no code given", hint="probe TARGET eval 'print(1)', eval - (stdin), or eval -f FILE")
    if cli.is_cluster and not as_json:
        _across_ranks(cli, code, eval_timeout, where)
        return
    several = len(cli.targets) > 1
    eval_id = uuid.uuid4().hex  # names the run, so that Ctrl-C or a client timeout can stop it in the target
    running: List[Client] = []

    def work(client: Client) -> EvalResult:
        running.append(client)  # several targets run at once: Ctrl-C stops the snippet in each
        try:
            return client.eval(code or "", timeout=eval_timeout, eval_id=eval_id, **where)
        except (Timeout, AgentBlocked) as exc:  # gave up waiting: stop the snippet rather than leave it unseen
            if isinstance(exc, Timeout) or getattr(getattr(exc, "diagnosis", None), "state", None) == "no_answer":
                exc.message += "; %s" % _stop_in_target(client, eval_id)
            raise

    try:
        for client, result in each_target(cli, work):
            _show(cli, client, result, as_json, several)
    except KeyboardInterrupt:
        state = "; ".join(dict.fromkeys(_stop_in_target(c, eval_id) for c in running)) or "nothing was sent"
        raise KeyboardInterrupt("interrupted (Ctrl-C); %s" % state) from None


def _read_snippet(path: str) -> str:
    """The snippet in the file ``path``; ``-f json`` with no file of that name is taken for the output
    format it looks like."""
    try:
        with open(path) as handle:
            return handle.read()
    except OSError as exc:
        hint = "-f reads the snippet from a file"
        if not os.path.exists(path) and path in ("json", "text"):
            hint += "; for %s output write -F %s%s" % (path, path, " or --json" if path == "json" else "")
        raise UsageError("cannot read the snippet from %s: %s" % (path, exc.strerror or exc), hint=hint) from None


def _show(cli: CliContext, client: Client, result: EvalResult, as_json: bool, several: bool) -> None:
    """Print one target's outcome; a snippet that raised exits 1, one that ran out of time 5."""
    if result.error:  # the agent's words name no target: its hints are made the commands to type here
        from probe._words import for_target

        result = result._replace(error=for_target(result.error, client.target.label))
    if as_json:
        import json

        member = cli.cluster_member(client)
        where = {"rank": member.rank, "host": member.host} if member is not None else {"target": client.target.label}
        emit(json.dumps(dict(where, stdout=result.stdout, stderr=result.stderr, value=result.value,
                             error=result.error, ok=result.ok, timed_out=result.timed_out)))
    else:
        shown = render_eval(result)
        if several:
            say("== %s ==" % client.target.label)
        if shown["stdout"]:
            emit(shown["stdout"], nl=False)  # the snippet's own output: exact for a pipe, made visible on a terminal
        if shown["stderr"]:
            emit(shown["stderr"], nl=False, err=True)
    for note in eval_notes(result):
        say("probe: %s%s" % ("%s: " % client.target.label if several else "", note), err=True)
    if not result.ok:
        cli.exit_code = cli.exit_code or (5 if result.timed_out else 1)


def eval_notes(result: EvalResult) -> List[str]:
    """What the agent cut or limited, said on stderr (never mixed into the snippet's own output)."""
    notes = []
    for stream in ("stdout", "stderr"):
        dropped = (result.limits or {}).get(stream + "_dropped")
        if dropped:
            notes.append("the snippet's %s was cut: %d more characters than the agent keeps (%s characters, "
                         "PROBE_EVAL_OUTPUT in the target's environment); write big output to a file instead"
                         % (stream, dropped, (result.limits or {}).get("max_output")))
    if result.timed_out and result.limits:
        notes.append(_timeout_hint(result.limits))
    return notes


def _timeout_hint(limits: Dict[str, Any]) -> str:
    applied, ceiling = limits.get("timeout_s"), limits.get("timeout_ceiling_s")
    if applied is not None and ceiling is not None and applied < ceiling:
        return "it ran %g s, its limit; raise it with --eval-timeout (this agent allows up to %g s)" % (applied, ceiling)
    return "it ran %g s, the most this agent allows (PROBE_EVAL_TIMEOUT_CEILING in the target's environment)" % (
        applied or 0)


def _stop_in_target(client: Client, eval_id: str) -> str:
    """Ask the agent to interrupt the snippet; what became of it, in words. The request is not made to wait
    as the one that got no answer did (``--wait``): the quick decision says at once if it cannot answer."""
    client.wait = None
    try:
        answer = client.interrupt_eval_detail(eval_id)
    except ProbeError:
        return "the snippet may still run in the target, if it had started (asking the agent to stop it got no answer either)"
    return stop_words(str(answer.get("state")), answer.get("where"))


def stop_words(state: str, where: object = None) -> str:
    """What became of a snippet asked to stop, as the agent said it (shared with the repl)."""
    if state == "stopping":
        return ("the snippet was told to stop, but it is inside a call into C that the interrupt cannot enter%s: "
                "it stops once that call returns, and what the call does (a torch.save, say) completes first"
                % (" (called from %s)" % where if where else ""))
    return {"interrupted": "the snippet was interrupted in the target",
            "cancelled": "the snippet was cancelled before it started",
            "finished": "the snippet had already finished"}.get(state, "the agent knows no such snippet")


def _across_ranks(cli: CliContext, code: str, eval_timeout: Optional[float], where: Dict[str, Any]) -> None:
    """Every rank runs the snippet; identical outputs are printed once, headed by their ranks."""
    from probe.cli.context import report_failures, stop_where_unanswered, stopped_on_ranks
    from probe.cli.render_cluster import render_grouped_eval

    cluster = cli.cluster()
    eval_id = uuid.uuid4().hex  # the same on every rank: Ctrl-C interrupts it there
    try:
        answers = cluster.map(lambda c: c.eval(code, timeout=eval_timeout, eval_id=eval_id, **where))
    except KeyboardInterrupt:
        if cluster.progress is not None:
            cluster.progress(-1, 0, [])
        raise KeyboardInterrupt("interrupted (Ctrl-C); %s" % stopped_on_ranks(cluster, "eval", eval_id)) from None
    if cluster.progress is not None:
        cluster.progress(-1, 0, [])
    for line, to_stderr in render_grouped_eval([(a.member.rank, a.value) for a in answers]):
        emit(line, err=to_stderr)  # the ranks' outputs: exact for a pipe, as eval's own
    if any(not a.value.ok for a in answers):
        cli.exit_code = 1
    stop_where_unanswered(cluster, "eval", eval_id)  # after the output: the answers first
    report_failures(cli, cluster.failures, len(cluster.members))
