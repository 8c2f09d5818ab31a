"""A fleet of agent processes for the fan-out bench: PROCESSES children, each a real process with its
own agent (PROBE_LISTEN, PROBE_TOKEN from the environment) and PER_PROCESS - 1 more TCP listeners on
that agent's dispatcher (own accept thread and workers each, one GIL and one SQL engine shared).

The parent imports probe, DuckDB and pyarrow once and forks: the children share those pages, so that
1024 agents fit in this machine's memory (a child costs ~22 MB once its SQL engine is up, a process
started afresh ~100 MB). Nothing of DuckDB exists before the fork (its databases start threads); each
child builds its own engine on its first query, as a rank does.

Prints one ``AGENT <pid> <port> [<port> ...]`` line per child, then ``READY <pid>``. Each child's main
thread runs a 1 kHz loop (a training loop's stand-in), or waits with ``BENCH_MAIN=idle`` (a rank
blocked in a collective). The children die with the parent (PR_SET_PDEATHSIG).
"""

import ctypes
import os
import signal
import sys
import threading
import time

import duckdb  # noqa: F401  loaded before the fork, shared by every child
import pyarrow  # noqa: F401
import pyarrow.ipc  # noqa: F401

import probe
import probe.agent.agent  # noqa: F401
import probe.engine  # noqa: F401
import probe.tables  # noqa: F401
from probe.agent.listener import Listener
from probe.agent.routes import Dispatcher

_PR_SET_PDEATHSIG = 1


def child(write_fd: int, per_process: int) -> None:
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    agent = probe.start()
    extra = [Listener.tcp("127.0.0.1", 0, Dispatcher(agent)) for _ in range(per_process - 1)]
    for listener in extra:
        listener.start()
    ports = [str(agent.tcp_address).rsplit(":", 1)[1]] + [str(listener.port) for listener in extra]
    os.write(write_fd, ("AGENT %d %s\n" % (os.getpid(), " ".join(ports))).encode())
    os.close(write_fd)
    if os.environ.get("BENCH_MAIN") == "idle":
        threading.Event().wait()
    while True:
        time.sleep(0.001)


def main() -> None:
    processes, per_process = int(sys.argv[1]), int(sys.argv[2])
    read_fd, write_fd = os.pipe()
    for _ in range(processes):
        if os.fork() == 0:
            os.close(read_fd)
            try:
                child(write_fd, per_process)
            finally:
                os._exit(1)
    os.close(write_fd)
    with os.fdopen(read_fd) as lines:
        for _ in range(processes):
            sys.stdout.write(lines.readline())
    sys.stdout.write("READY %d\n" % os.getpid())
    sys.stdout.flush()
    threading.Event().wait()


if __name__ == "__main__":
    main()
