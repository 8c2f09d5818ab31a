"""What every command shares: the targets, how to reach them, and how errors end the command."""

from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Tuple, TypeVar

import click

from probe.client import Client, connect
from probe.errors import ProbeError, UsageError

__all__ = ["CliContext", "pass_cli", "each_target"]

T = TypeVar("T")


@dataclass
class CliContext:
    targets: List[str] = field(default_factory=list)
    token: Optional[str] = None
    token_file: Optional[str] = None
    timeout: float = 30.0
    failures: int = 0
    exit_code: int = 0
    wait: Optional[float] = None
    executable: Optional[str] = None

    def clients(self) -> List[Client]:
        import os

        targets = self.targets or ([os.environ["PROBE_TARGET"]] if os.environ.get("PROBE_TARGET") else [])
        if not targets:
            raise UsageError("no target given", hint="write `probe PID COMMAND`, `probe HOST:PORT COMMAND`, "
                                                     "use -t, or set PROBE_TARGET")
        return [connect(t, token=self.token, token_file=self.token_file, timeout=self.timeout, wait=self.wait,
                        executable=self.executable) for t in targets]

    def record(self, exc: ProbeError, label: Optional[str] = None) -> None:
        """Report one target's error and remember the exit code; the other targets still run."""
        prefix = "probe: %s: " % label if label else "probe: "
        message = exc.message + (" -- %s" % exc.hint if exc.hint else "")
        click.echo(prefix + "error: " + message, err=True)
        self.failures += 1
        self.exit_code = self.exit_code or exc.exit_code


pass_cli = click.make_pass_decorator(CliContext)


def each_target(cli: CliContext, work: Callable[[Client], T]) -> Iterator[Tuple[Client, T]]:
    """Run ``work`` against each target in turn; an error is reported and the next target runs."""
    clients = cli.clients()
    for client in clients:
        label = client.target.label if len(clients) > 1 else None
        try:
            result = work(client)
        except ProbeError as exc:
            cli.record(exc, label)
            continue
        if getattr(client, "note", None):  # the answer did not come from the agent: say where from
            click.echo(("probe: %s: " % label if label else "probe: ") + str(client.note), err=True)
        yield client, result
