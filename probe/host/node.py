"""The node helper as a process of its own: ``python -m probe.host --port PROBE_PORT``.

Why a process, and not a thread in a rank: a rank's threads stop when a C call holds its GIL, and die
with it; the helper must answer for exactly those ranks. Why not torchrun's launcher: most jobs have
none (accelerate, Lightning, ``mp.spawn``, srun, mpirun). So the first rank of a node that finds no helper
for its job starts this one (``probe.agent.registration``); the others register with it. It lives while
any rank it knows lives, and ``PROBE_HELPER_LINGER_S`` seconds (default 30) after the last one died, so
that a job that just died is still listed, then exits. One per job and node: whoever holds the lock file
``node-PORT.lock`` serves ``node-PORT.sock``; a second one started in the same instant finds the lock
taken and exits at once.

It holds none of the job's output streams (a launcher reading its ranks' pipes until they close must not
wait for it): it writes to ``node-PORT.log`` in the runtime directory.
"""

import argparse
import fcntl
import math
import os
import sys
import time
from typing import List, Optional

from probe import _paths
from probe._stderr import say as _say

__all__ = ["main", "LINGER_S", "UNREGISTERED_S"]

LINGER_S = 30.0  # after the last rank died ($PROBE_HELPER_LINGER_S)
UNREGISTERED_S = 20.0  # a helper that no rank registered with by then (or the linger, if longer) was started for nothing
WAKE_S = 1.0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m probe.host",
                                     description="The node helper of a job's ranks on this node (started by the "
                                                 "ranks themselves; not meant to be run by hand).")
    parser.add_argument("--port", type=int, required=True, help="the job's PROBE_PORT (its helper serves one below)")
    parser.add_argument("--host", default="127.0.0.1", help="the address to serve TCP on")
    args = parser.parse_args(argv)
    linger = _seconds(os.environ.get("PROBE_HELPER_LINGER_S"), LINGER_S)

    _paths.ensure_runtime_dir()
    lock = os.open(_paths.node_lock_path(args.port), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return 0  # another helper of this job serves this node
    if _paths.socket_state(_paths.node_socket_path(args.port)) == "listening":
        return 0  # torchrun's launcher serves this job's ranks here
    from probe.host.helper import Helper, job_token

    token, token_file = job_token(args.port)
    helper = Helper(args.port, token, token_file, kind="node")
    helper.serve(args.host)
    from probe.host import watch

    watching = watch.start(helper) is not None  # PROBE_SNAPSHOT=0: none
    from probe.host import history

    history.start(helper)  # where each rank has been (PROBE_STACK_EVERY=0: nowhere)
    _say("probe: node helper %d for PROBE_PORT=%d: unix %s, TCP %s" % (
        os.getpid(), args.port, _paths.node_socket_path(args.port), helper.tcp_address or "none"))
    started = last_alive = time.monotonic()
    while True:
        time.sleep(WAKE_S)
        if helper.tcp_address is None and helper.listen_tcp(args.host):
            _say("probe: node helper %d serves TCP on %s now" % (os.getpid(), helper.tcp_address))
        helper.report_once()
        now = time.monotonic()
        helper.members.scan()  # ranks that could not register (a C call took the GIL first) are found too
        solo = helper.members.solo() if watching else None  # a program alone: the watch watches it
        if helper.members.alive() or (solo is not None and solo.state != "dead"):
            last_alive = now
        elif helper.members.node_key() is None and solo is None:
            if now - started > max(UNREGISTERED_S, linger):
                _say("probe: node helper %d: no rank registered in %.0f s; exiting" % (os.getpid(), now - started))
                return 0
        elif now - last_alive > linger:
            _say("probe: node helper %d: every rank of this node has exited; exiting" % os.getpid())
            return 0


def _seconds(raw: Optional[str], default: float) -> float:
    try:
        value = float(raw) if raw else default
    except ValueError:
        return default
    return value if math.isfinite(value) and value >= 0 else default


if __name__ == "__main__":
    sys.exit(main())
