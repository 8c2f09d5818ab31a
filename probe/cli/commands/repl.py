"""``probe TARGET repl``: an interactive console whose input runs in the target.

Python's own console decides when a block is complete (``code.InteractiveConsole``, ``codeop``); each
complete input goes to every target as one eval, and the outputs are shown grouped by identical text.
readline gives line editing, a history file and tab completion (names and attributes asked of the
first target). Ctrl-C while a snippet runs interrupts it in the target (a second request naming the
eval); a second Ctrl-C stops waiting for it. Ctrl-D leaves, and so do ``exit()`` and ``quit()`` (run here,
never in the target: there they would close its stdin) and an input that raised SystemExit in the target
(the agent caught it: the target runs on).
"""

import ast
import code
import re
import os
import threading
import uuid
from typing import Any, Dict, List, Optional, Tuple

import click

from probe.cli.commands.eval_ import placement, placement_options, stop_words
from probe.cli.context import CliContext, pass_cli
from probe.cli.options import Seconds
from probe.cli.output import emit
from probe.cli.render import render_eval, visible
from probe.client import Client
from probe.client.results import EvalResult
from probe.errors import ProbeError

__all__ = ["repl", "group_outputs"]

HISTORY = os.path.join(os.path.expanduser("~"), ".probe_history")


def group_outputs(outputs: List[Tuple[str, str]]) -> List[Tuple[List[str], str]]:
    """[(label, text)] -> [(labels, text)]: targets that printed the same text, together, in first-seen order."""
    groups: Dict[str, List[str]] = {}
    for label, text in outputs:
        groups.setdefault(text, []).append(label)
    return [(labels, text) for text, labels in groups.items()]


class Leave(Exception):
    """The console is left, as a console leaves on SystemExit; the targets run on."""


def is_exit_call(source: str) -> bool:
    """Whether the input is ``exit()`` or ``quit()`` alone (an argument allowed), as typed to leave a console."""
    try:
        body = ast.parse(source).body
    except (SyntaxError, ValueError):
        return False
    return (len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Call)
            and isinstance(body[0].value.func, ast.Name) and body[0].value.func.id in ("exit", "quit")
            and len(body[0].value.args) <= 1 and not body[0].value.keywords)


_SYSTEM_EXIT = re.compile(r"(?m)^SystemExit(?::.*)?\s*\Z")


def raised_system_exit(result: Any) -> bool:
    """Whether a snippet's traceback ends in SystemExit (``sys.exit()``, ``raise SystemExit``)."""
    return isinstance(result, EvalResult) and bool(result.error) and bool(_SYSTEM_EXIT.search(result.error or ""))


class RemoteConsole(code.InteractiveConsole):
    """A console whose ``runsource`` sends complete input to the targets instead of running it here."""

    def __init__(self, clients: List[Client], where: Dict[str, Any], timeout: Optional[float],
                 cluster: Optional[Any] = None) -> None:
        super().__init__(filename="<probe-repl>")
        self.clients = clients
        # Across ranks: each input fans out as the other commands do (bounded, within the deadline), and
        # outputs are headed by their ranks (0-6,8), not the targets.
        self.cluster = cluster
        self.ranks = [m.rank for m in cluster.members] if cluster is not None else None
        self.where = where
        self.timeout = timeout
        self.failed = False

    def runsource(self, source: str, filename: str = "<input>", symbol: str = "single") -> bool:
        try:
            if self.compile(source, filename, symbol) is None:
                return True  # an open block: ask for more
        except (OverflowError, SyntaxError, ValueError):
            pass  # the target's own parser says what is wrong (its Python may differ from ours)
        if is_exit_call(source):
            raise Leave()
        self.run_remote(source)
        return False

    def run_remote(self, source: str) -> None:
        eval_id = uuid.uuid4().hex
        results: Dict[int, Any] = {}
        if self.cluster is not None:
            if not self._run_on_ranks(source, eval_id, results):
                return
            self._show(results)
            return

        def send(index: int, client: Client) -> None:
            try:
                results[index] = client.eval(source, timeout=self.timeout, eval_id=eval_id, origin="repl", **self.where)
            except ProbeError as exc:
                results[index] = exc
            except Exception as exc:  # a bug of ours: show it, keep the console
                results[index] = ProbeError("%s: %s" % (type(exc).__name__, exc))
            finally:
                done[index].set()

        done = [threading.Event() for _ in self.clients]
        for i, client in enumerate(self.clients):
            threading.Thread(target=send, args=(i, client), daemon=True).start()
        self._wait(done, eval_id)
        self._show(results)

    def _run_on_ranks(self, source: str, eval_id: str, results: Dict[int, Any]) -> bool:
        """The input on every rank through the cluster's fan-out; False when Ctrl-C ended the wait (the
        snippet is then stopped on every rank, and the console says where)."""
        from probe.cli.context import stopped_on_ranks
        from probe.errors import error_from_code

        cluster: Any = self.cluster
        try:
            answers = cluster.map(lambda c: c.eval(source, timeout=self.timeout, eval_id=eval_id, origin="repl",
                                                       **self.where))
        except KeyboardInterrupt:
            self.write("\nKeyboardInterrupt: %s\n" % stopped_on_ranks(cluster, "eval", eval_id))
            return False
        finally:
            if cluster.progress is not None:
                cluster.progress(-1, 0, [])
        index = {m.rank: i for i, m in enumerate(cluster.members)}
        for answer in answers:
            results[index[answer.member.rank]] = answer.value
        for failure in cluster.failures:
            results[index[failure.rank]] = error_from_code(failure.code, failure.reason)
        return True

    def _show(self, results: Dict[int, Any]) -> None:
        """Each distinct output once, headed by the targets (ranks) that printed it; an input that printed
        nothing anywhere shows nothing, and where only some printed, the others are named as silent."""
        labels = [c.target.label for c in self.clients] if self.ranks is None else [str(r) for r in self.ranks]
        leave = any(raised_system_exit(r) for r in results.values())  # as a console leaves on SystemExit
        if leave:  # what the snippet printed is shown; its SystemExit is the leaving, not an error
            results = {i: r._replace(error=None) if raised_system_exit(r) else r for i, r in results.items()}
        outputs = [(label, _text(results.get(i))) for i, label in enumerate(labels)]
        groups = group_outputs(outputs)
        if leave:
            self._write_groups([(g, t) for g, t in groups if t])
            raise Leave()
        if all(not text for _, text in groups):
            return
        self._write_groups(groups)

    def _write_groups(self, groups: List[Tuple[List[str], str]]) -> None:
        for group, text in groups:
            if len(self.clients) > 1:
                who = ", ".join(group) if self.ranks is None else _ranks_heading(group)
                self.write("== %s ==\n" % who if text else "== %s: no output ==\n" % who)
            self.write(text)

    def _wait(self, done: List[threading.Event], eval_id: str) -> None:
        """Until every answer is in; Ctrl-C interrupts the snippet in the targets, a second one stops waiting.

        Events, not ``Thread.join``: a KeyboardInterrupt inside ``join`` marks a running thread stopped.
        """
        interrupted = False
        while not all(event.is_set() for event in done):
            try:
                for event in done:
                    event.wait(0.05)
            except KeyboardInterrupt:
                if interrupted:
                    self._stop_waiting()
                    return
                interrupted = True
                try:
                    self._interrupt(eval_id)
                except KeyboardInterrupt:  # the second Ctrl-C came while the first was being told
                    self._stop_waiting()
                    return

    def _interrupt(self, eval_id: str) -> None:
        """Ask every target to interrupt the snippet, and say what each answered."""
        self.write("\nKeyboardInterrupt: interrupting the snippet in the target\n")
        stopping = False
        for client in self.clients:
            try:
                answer = client.interrupt_eval_detail(eval_id)
            except ProbeError as exc:
                self.write("probe: %s: %s\n" % (client.target.label, exc.message))
                continue
            if answer.get("state") == "stopping":
                stopping = True
                self.write("probe: %s%s\n" % ("%s: " % client.target.label if len(self.clients) > 1 else "",
                                               stop_words("stopping", answer.get("where"))))
        if stopping:
            self.write("(waiting for it to stop; Ctrl-C again stops waiting)\n")

    def _stop_waiting(self) -> None:
        self.write("\n(not waiting for it any more; it may still run in the target until that call returns)\n")

    def write(self, data: str) -> None:
        emit(data, nl=False)  # the targets' output, as eval prints it: made visible on a terminal


def _ranks_heading(ranks: List[str]) -> str:
    from probe.cli.render_cluster import ranks_word

    return ranks_word([int(r) for r in ranks])


def _text(result: Any) -> str:
    if result is None:
        return "(no answer)\n"
    if isinstance(result, ProbeError):
        return "probe: error: %s%s\n" % (result.message, " -- %s" % result.hint if result.hint else "")
    assert isinstance(result, EvalResult)
    shown = render_eval(result)
    return shown["stdout"] + shown["stderr"]


def _completer(client: Client, frame: Optional[str]) -> Any:
    cache: Dict[str, List[str]] = {}

    def complete(text: str, state: int) -> Optional[str]:
        if state == 0 or text not in cache:
            try:
                cache.clear()
                cache[text] = client.complete(text, frame=frame)
            except ProbeError:
                cache[text] = []
        matches = cache.get(text, [])
        return matches[state] if state < len(matches) else None

    return complete


def _setup_readline(client: Client, frame: Optional[str]) -> Any:
    try:
        import readline
    except ImportError:
        return None
    try:
        readline.read_history_file(HISTORY)
    except OSError:
        pass
    readline.set_history_length(2000)
    readline.set_completer_delims(" \t\n`~!@#$%^&*()-=+[{]}\\|;:'\",<>/?")
    readline.set_completer(_completer(client, frame))
    readline.parse_and_bind("tab: complete")
    return readline


@click.command("repl")
@click.option("--eval-timeout", type=Seconds(0.001), help="Seconds each input may run.")
@placement_options
@pass_cli
def repl(cli: CliContext, eval_timeout: Optional[float], on: str, between_steps: bool, frame: Optional[str],
         wait: Optional[float]) -> None:
    """An interactive Python console whose input runs in the target (every -t target, or every rank
    with --all-ranks / --ranks, at once; identical outputs shown once).

    Names and attributes complete with Tab; history is kept in ~/.probe_history. Ctrl-C interrupts the
    running input in the target, Ctrl-D leaves. --on, --between-steps and --frame work as for eval.
    """
    where = placement(on, between_steps, frame, wait)
    place = {"agent": "on the agent's thread, concurrently", "main": "on the main thread",
             "step": "right after each optimizer step"}[where["on"]]
    if cli.is_cluster:  # every rank of the job: found through its master, as the other commands do
        from probe.cli.render_cluster import ranks_word

        cluster = cli.cluster()
        clients, ranks = cluster.clients, [m.rank for m in cluster.members]
        console = RemoteConsole(clients, where, eval_timeout, cluster)
        try:
            python = clients[0].health().get("python", "?")
        except ProbeError:
            python = "?"
        who = ranks_word(ranks) + (" (%d)" % len(ranks) if len(ranks) > 1 else "")
        banner = "probe repl: %s, Python %s; input runs %s in %s on every rank. Ctrl-D leaves." % (
            who, visible(str(python)), place, visible(frame or "__main__"))
    else:
        clients = cli.clients()
        console = RemoteConsole(clients, where, eval_timeout)
        health = clients[0].health()
        banner = "probe repl: %s (pid %s, Python %s); input runs %s in %s. Ctrl-D leaves." % (
            ", ".join(c.target.label for c in clients), health.get("pid"), visible(str(health.get("python", "?"))),
            place, visible(frame or "__main__"))
    readline = _setup_readline(clients[0], frame)
    try:
        console.interact(banner=banner, exitmsg="")
    except Leave:
        emit("")  # the prompt's line ends; the targets run on
    finally:
        if readline is not None:
            try:
                readline.write_history_file(HISTORY)
            except OSError:
                pass
