"""The record of a job that served at an address and has died: what ``probe HOST:PORT diagnose`` reads where
nothing answers there any more.

A launcher ends a whole job within a second of one rank's death (torchrun's SIGTERM to the rest), so by the
time someone asks the job's address, nothing listens there; the node helper's watch has written a record
of the death (``probe.host.watch``) whose meta says where the job served: ``probe_port``, ``helper_port``,
``ports`` (every rank's), ``node_host`` and ``host``. A record is found for ``HOST:PORT`` where PORT is one
of those, HOST is that node (or this host, for a local address and a record this host wrote), a rank of
it died (a record made at a death, or a stall's record whose ranks died after), and it was last written
within :data:`RECENT_S`. The newest such wins. Stdlib only.
"""

import os
import socket
import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

from probe.errors import UsageError

__all__ = ["DeadJob", "find_dead_job", "RECENT_S"]

RECENT_S = 3600.0
_LOCAL = ("localhost", "127.0.0.1", "::1", "0.0.0.0", "::")


class DeadJob(NamedTuple):
    """A record of a job that died at the address asked: the snapshot, when it was last written."""

    info: Any  # store.SnapshotInfo
    written: float  # epoch s: its newest file (a death copied in after a stall's record counts)


def _metas(directory: str) -> List[Dict[str, Any]]:
    from probe.snapshot.record import read_meta

    out = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return out
    for name in names:
        if name.startswith("meta-") and name.endswith(".json"):
            try:
                out.append(read_meta(os.path.join(directory, name)))
            except UsageError:
                continue
    return out


def _is_local(host: str) -> bool:
    if host.lower() in _LOCAL or host.startswith("127."):
        return True
    names = {socket.gethostname().lower(), socket.getfqdn().lower(), os.environ.get("PROBE_HOST", "").lower()}
    return host.lower() in names - {""}


def _served_here(meta: Dict[str, Any], host: str, port: int) -> bool:
    """Whether the job a meta is of served at ``host:port``."""
    if meta.get("by") != "watch":
        return False
    ports = [p for p in [meta.get("probe_port"), meta.get("helper_port")] + list(meta.get("ports") or [])
             if isinstance(p, int)]
    if port not in ports and meta.get("job") != "port%d" % port:
        return False
    names = {str(meta.get(k) or "").lower() for k in ("host", "node_host")} - {""}
    if host.lower() in names:
        return True
    return _is_local(host) and str(meta.get("host") or "") == socket.gethostname()


def _newest_write(dirs: Sequence[str]) -> float:
    newest = 0.0
    for directory in dirs:
        try:
            for name in os.listdir(directory):
                newest = max(newest, os.stat(os.path.join(directory, name)).st_mtime)
        except OSError:
            continue
    return newest


def _ranks_died(dirs: Sequence[str]) -> bool:
    """A rank of the record died after it was made (its death copied in: ``died``)."""
    from probe.snapshot.record import read_rank

    for directory in dirs:
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue
        for name in names:
            if name.startswith("rank-") and name.endswith(".json"):
                try:
                    if read_rank(os.path.join(directory, name)).get("died"):
                        return True
                except UsageError:
                    continue
    return False


def find_dead_job(host: str, port: int, roots: Sequence[str], now: Optional[float] = None) -> Optional[DeadJob]:
    """The newest record, in any of ``roots``, of a job that served at ``host:port`` and was last written
    within RECENT_S; None where there is none."""
    from probe.snapshot.store import list_snapshots

    now = time.time() if now is None else now
    best: Optional[DeadJob] = None
    seen = set()
    for root in roots:
        root = os.path.realpath(root)
        if root in seen:
            continue
        seen.add(root)
        try:
            found = list_snapshots(root)
        except UsageError:
            continue
        for info in found:
            metas = [m for d in info.dirs for m in _metas(d)]
            if not any(_served_here(m, host, port) for m in metas):
                continue
            written = _newest_write(info.dirs)
            if now - written > RECENT_S or (best is not None and written <= best.written):
                continue
            if " died: " in (info.reason or "") or _ranks_died(info.dirs):
                best = DeadJob(info, written)
    return best
