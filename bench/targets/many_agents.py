"""A process hosting several agents: the usual one (PROBE=1, PROBE_LISTEN) plus N-1 more TCP listeners
on the same agent's dispatcher, so that a bench can fan out to 1024 agents on a small machine (one
process per agent would need ~100 MB each once DuckDB is loaded). Each listener has its own accept
thread and workers, as a real agent does; they share this process's GIL, which makes the figure
pessimistic. Prints ``READY <pid> <port> <port> ...``; also runs a main loop that records its longest
pause (``max_gap``), for the cost on a rank, unless ``BENCH_MAIN=idle``: then the main thread waits."""

import os
import sys
import time

import probe
from probe.agent.listener import Listener
from probe.agent.routes import Dispatcher

count = int(sys.argv[1])
agent = probe.start()
extra = [Listener.tcp("127.0.0.1", 0, Dispatcher(agent)) for _ in range(count - 1)]
for listener in extra:
    listener.start()
ports = [int(str(agent.tcp_address).rsplit(":", 1)[1])] + [listener.port for listener in extra]
sys.stdout.write("READY %d %s\n" % (os.getpid(), " ".join(map(str, ports))))
sys.stdout.flush()

if os.environ.get("BENCH_MAIN") == "idle":  # a rank whose main thread waits (in a collective, say)
    import threading

    threading.Event().wait()

max_gap = 0.0
last = time.perf_counter()
while True:
    now = time.perf_counter()
    max_gap = max(max_gap, now - last)
    last = now
    time.sleep(0.001)
