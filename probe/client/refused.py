"""What to say where nothing listens at a HOST:PORT the user gave: where the job's ranks are, or how a job
comes to serve there.

A refused connection has two common causes. The job serves, but not on that port: under Lightning's ``ddp``
rank 0 learns its rank only after it started, so it serves on a free port and registers with its node's
helper (on PROBE_PORT - 1), which still answers for the job. Or no job with an agent runs there at all."""

from typing import Optional

from probe.client.connection import read_token as _read_token
from probe.client.listing import discover, job_token as _job_token
from probe.client.targets import parse_target
from probe.errors import ProbeError

__all__ = ["where_to_ask"]

_ASK_S = 2.0  # the node helper is asked this long at most: the user is waiting on an error already


def where_to_ask(target: str, token: Optional[str] = None, token_file: Optional[str] = None) -> Optional[str]:
    """The hint for ``target`` (``HOST:PORT``) refusing connections; None where it is no TCP address."""
    try:
        address = parse_target(target).address
    except ProbeError:
        return None
    port = getattr(address, "port", None)
    if port is None:
        return None
    try:
        secret = _read_token(token, token_file) or _job_token(port)
        found = discover(target, secret, _ASK_S)
    except ProbeError:
        found = None
    if found is not None and found.members:
        first = min(found.members, key=lambda m: (m.local_rank is None, m.local_rank or 0, m.rank))
        elsewhere = (" (rank %d serves on %s: it learned its rank after it started, as under Lightning's ddp)"
                     % (first.rank, first.address) if first.address != target else "")
        return ("the job's node helper on port %d answers for its ranks%s: ask through it, "
                "`probe %s --ranks %d COMMAND`, or every rank with --all-ranks" % (port - 1, elsewhere, target, first.rank))
    return ("nothing listens there: a job serves there when started with PROBE=1 PROBE_PORT=%d (rank N on "
            "PROBE_PORT + LOCAL_RANK, its node helper on PROBE_PORT - 1), one process with PROBE_LISTEN=HOST:%d; "
            "on that host, `probe list` shows the processes with an agent" % (port, port))
