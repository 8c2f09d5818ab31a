"""A 2-rank torchrun job on the CPU (gloo) for the torch tests: started, handshaken, always killed and reaped."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Dict, Iterator, List, Sequence

from procs import TARGETS, Proc, target_env, wait_for_socket

TORCHRUN = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ready_lines(output: Proc, count: int, deadline: float) -> List[List[str]]:
    """The launcher's next ``count`` READY lines (one per rank: ``READY pid rank local_rank``), split,
    read until ``deadline``; every other line is kept in ``output.lines`` for the failure message."""
    found: List[List[str]] = []
    while len(found) < count:
        try:
            line = output.read_line(max(deadline - time.monotonic(), 0.1))
        except (TimeoutError, RuntimeError) as exc:
            raise AssertionError("the ranks did not start: %s; lines so far: %r" % (exc, output.lines)) from None
        output.lines.append(line)
        if line.startswith("READY"):
            found.append(line.split())
    return found


@contextmanager
def torchrun_job(script: str, args: Sequence[str] = (), timeout: float = 90.0,
                 **env: str) -> Iterator[Dict[int, int]]:
    """Run ``tests/targets/<script>`` on 2 ranks with an agent each; yields {rank: pid} once both are READY."""
    launcher = subprocess.Popen([TORCHRUN, "--nproc_per_node=2", "--master_port=%d" % _free_port(),
                                 os.path.join(TARGETS, script), *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=target_env(**env), start_new_session=True)
    try:
        output = Proc(launcher, "torchrun")
        ranks: Dict[int, int] = {int(words[2]): int(words[1])
                                 for words in ready_lines(output, 2, time.monotonic() + timeout)}
        for pid in ranks.values():
            wait_for_socket(pid, 30)
        yield ranks
    finally:
        stop_launcher(launcher)


def stop_launcher(launcher: subprocess.Popen) -> None:
    """SIGTERM to torchrun's process group (it stops its ranks), SIGKILL after 20 s; always reaped."""
    try:
        os.killpg(launcher.pid, signal.SIGTERM)
        launcher.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
    except ProcessLookupError:
        launcher.wait(10)
    for stream in (launcher.stdout, launcher.stderr):
        if stream:
            stream.close()
