"""A directory of snapshots: where it is, a new snapshot's id, what it holds, which files a snapshot is,
and cleanup.

::

    $PROBE_SNAPSHOT_DIR/          0700 (default: <runtime dir>/snapshots)
      <job>-<yyyymmddTHHMMSSZ>/   0700, one a node and a recording; the UTC time recording began
        meta-<host>.json          the node's account, written last (a directory without one is incomplete)
        rank-00000.json           a rank's record (probe.snapshot.record)

Nodes that record the same stall on a shared file system each make their own directory. When read, the
directories of one job whose recordings began within :data:`GROUP_WINDOW_S` of the first of them are one
snapshot, named by that first directory, where they can be one recording (``probe.snapshot.runs``: each by
the watch of another node, of the same run where both name theirs); any other directory is a snapshot of
its own: a snapshot taken by hand, another run of the job on the same port, a later record of this node.

Directories another user made (or that hold another user's files) in a shared root are no record of
yours: they are listed apart, with their owner, never grouped with yours, read only when named by path
(with a warning: see :func:`foreign_owner`), never cleaned. A file that cannot be read (damaged, not
probe's, too deep or too big) is named in the listing, and the rest is listed.

Cleanup (after a node writes): of the snapshots of the same job that this host wrote, only the newest
``PROBE_SNAPSHOT_KEEP`` (default 20) are kept, and any of this host's older than
``PROBE_SNAPSHOT_MAX_AGE_DAYS`` (default 14) are removed. Only directories that hold nothing but probe's
files are ever removed.
"""

import calendar
import os
import re
import shutil
import socket
import time
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from probe.errors import UsageError
from probe.snapshot.record import read_meta, read_rank

__all__ = ["SnapshotInfo", "snapshot_root", "new_snapshot_dir", "list_snapshots", "resolve", "clean", "GROUP_WINDOW_S",
           "job_id", "snapshot_id", "save_snapshot", "foreign_owner"]

GROUP_WINDOW_S = 120.0
KEEP = 20
MAX_AGE_DAYS = 14.0
_ID = re.compile(r"^(?P<job>.+)-(?P<when>\d{8}T\d{6}Z)(?:-(?P<n>\d+))?$")
_RANK = re.compile(r"^rank-(\d+)\.json$")
_OURS = re.compile(r"^(rank-\d+\.json|meta-[A-Za-z0-9._-]+\.json|\.(rank-\d+|meta-[A-Za-z0-9._-]+)\.json\.tmp-\d+)$")


class SnapshotInfo(NamedTuple):
    """One snapshot: ``id`` (its first directory's name), ``path`` (that directory), ``dirs`` (every
    directory of it, one per node that recorded), ``job``, ``when`` (epoch s, recording began), ``reason``,
    ``ranks`` (recorded), ``failed`` (rank -> why it could not be recorded), ``bytes``, ``complete`` (every
    node's meta written and each rank it names has its file), ``hosts``, ``owner`` (``user (uid N)`` for
    a snapshot another user made: nothing of it was read; None for yours), ``problems`` (``file: why``
    for each file that could not be read)."""

    id: str
    path: str
    dirs: List[str]
    job: str
    when: float
    reason: str
    ranks: List[int]
    failed: Dict[int, str]
    bytes: int
    complete: bool
    hosts: List[str]
    owner: Optional[str] = None
    problems: Tuple[str, ...] = ()
    held: Tuple[int, ...] = ()  # the ranks it holds a file of (recorded or not)

    def as_json(self) -> Dict[str, Any]:
        return {"id": self.id, "path": self.path, "dirs": self.dirs, "job": self.job, "when": self.when,
                "when_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.when)), "reason": self.reason,
                "ranks": self.ranks, "failed": {str(k): v for k, v in sorted(self.failed.items())},
                "bytes": self.bytes, "complete": self.complete, "hosts": self.hosts, "owner": self.owner,
                "problems": list(self.problems), "held": list(self.held)}


def snapshot_root(explicit: Optional[str] = None) -> str:
    """Where snapshots go: ``--dir``, else ``$PROBE_SNAPSHOT_DIR``, else ``<runtime dir>/snapshots``."""
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    env = os.environ.get("PROBE_SNAPSHOT_DIR")
    if env:
        return os.path.abspath(os.path.expanduser(env))
    from probe import _paths

    return os.path.join(_paths.runtime_dir(), "snapshots")


def job_id(slurm_job: Optional[str] = None, run_id: Optional[str] = None, port: Optional[int] = None,
           pid: Optional[int] = None) -> str:
    """A job's name in snapshot ids: the Slurm job id, torchelastic's run id, ``port<PROBE_PORT>``, or
    ``pid<PID>`` for one process."""
    if slurm_job:
        return _safe(str(slurm_job))
    if run_id and run_id != "none":
        return _safe(str(run_id))
    if port:
        return "port%d" % port
    return "pid%d" % (pid if pid is not None else os.getpid())


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._" else "_" for c in text)[:64] or "job"


def snapshot_id(job: str, when: float) -> str:
    return "%s-%s" % (_safe(job), time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(when)))


def _make_root(root: str) -> None:
    if not os.path.isdir(root):
        os.makedirs(root, mode=0o700, exist_ok=True)
        try:
            os.chmod(root, 0o700)
        except OSError:
            pass


def new_snapshot_dir(root: str, job: str, when: float) -> str:
    """Create ``root/<job>-<UTC time>`` (0700; ``-2``, ``-3``... where the name is taken); its path."""
    try:
        _make_root(root)
    except OSError as exc:
        raise UsageError("cannot create the snapshot directory %s: %s" % (root, exc.strerror or exc),
                         hint="give another with --dir or PROBE_SNAPSHOT_DIR") from None
    base = snapshot_id(job, when)
    for n in range(1, 1000):
        path = os.path.join(root, base if n == 1 else "%s-%d" % (base, n))
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        except OSError as exc:
            raise UsageError("cannot create a snapshot in %s: %s" % (root, exc.strerror or exc),
                             hint="give another directory with --dir or PROBE_SNAPSHOT_DIR") from None
        os.chmod(path, 0o700)
        return path
    raise UsageError("too many snapshots named %s in %s" % (base, root))


# -- reading a directory -------------------------------------------------------------------------------


class _Dir(NamedTuple):
    path: str
    name: str
    job: str
    when: float
    metas: List[Dict[str, Any]]
    rank_files: Dict[int, str]
    bytes: int
    owner: Optional[int] = None  # the uid of another user who made it or a file in it; None: this user's
    problems: Tuple[str, ...] = ()


def _uid_of(path: str) -> Optional[int]:
    """The uid of another user than this process's that owns ``path`` or, for a link, the link itself;
    None where both are this user's (or cannot be looked at)."""
    try:
        uids = {os.lstat(path).st_uid, os.stat(path).st_uid}
    except OSError:
        return None
    other = sorted(uid for uid in uids if uid != os.geteuid())
    return other[0] if other else None


def _user(uid: int) -> str:
    try:
        import pwd

        return "%s (uid %d)" % (pwd.getpwuid(uid).pw_name, uid)
    except (ImportError, KeyError):
        return "uid %d" % uid


def foreign_owner(path: str) -> Optional[str]:
    """``user (uid N)`` where ``path`` (or the link it is) belongs to another user: what it says may have
    been planted there; None where it is this user's own."""
    uid = _uid_of(path)
    return None if uid is None else _user(uid)


def _scan(path: str) -> Optional[_Dir]:
    """One snapshot directory, or None for what is not one. Another user's is not read: its files are
    named from the directory's listing alone."""
    name = os.path.basename(path.rstrip("/"))
    try:
        names = os.listdir(path)
    except OSError:
        return None
    owner = _uid_of(path)
    ours = [e for e in names if _RANK.match(e) or (e.startswith("meta-") and e.endswith(".json"))]
    for entry in ours if owner is None else ():
        owner = _uid_of(os.path.join(path, entry))
        if owner is not None:
            break
    rank_files: Dict[int, str] = {}
    metas: List[Dict[str, Any]] = []
    problems: List[str] = []
    size = 0
    for entry in ours:
        full = os.path.join(path, entry)
        match = _RANK.match(entry)
        if match:
            rank_files[int(match.group(1))] = full
        elif owner is None:
            try:
                metas.append(read_meta(full))
            except UsageError as exc:
                problems.append("%s: %s" % (full, exc.message))
        try:
            size += os.stat(full).st_size
        except OSError:
            pass
    parsed = _ID.match(name)
    if not rank_files and not metas and not parsed:
        return None
    job = next((str(m["job"]) for m in metas if m.get("job")), parsed.group("job") if parsed else name)
    when = next((float(m["started"]) for m in metas if isinstance(m.get("started"), (int, float))), None)
    if when is None and parsed:
        when = float(calendar.timegm(time.strptime(parsed.group("when"), "%Y%m%dT%H%M%SZ")))
    if when is None:
        try:
            when = os.stat(path).st_mtime
        except OSError:
            when = 0.0
    return _Dir(path, name, job, when, metas, rank_files, size, owner, tuple(problems))


def _dirs(root: str) -> List[_Dir]:
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise UsageError("%s is a file, not a snapshot directory" % root) from None
    except OSError as exc:
        raise UsageError("cannot read the snapshot directory %s: %s" % (root, exc.strerror or exc)) from None
    out = []
    for name in names:
        full = os.path.join(root, name)
        if name.startswith(".") or not os.path.isdir(full):
            continue
        found = _scan(full)
        if found is not None:
            out.append(found)
    return out


def _groups(dirs: List[_Dir]) -> List[List[_Dir]]:
    """Directories of one job and one owner whose recordings began within GROUP_WINDOW_S of the group's first,
    and that can be one recording (``runs.one_recording``: other nodes of the same run)."""
    from probe.snapshot.runs import one_recording

    groups: List[List[_Dir]] = []
    for d in sorted(dirs, key=lambda d: (d.owner is not None, d.owner or 0, d.job, d.when, d.name)):
        joined = next((g for g in groups if g[0].job == d.job and g[0].owner == d.owner
                       and d.when - g[0].when <= GROUP_WINDOW_S
                       and all(one_recording(o.metas, d.metas) for o in g)), None)
        if joined is not None:
            joined.append(d)
        else:
            groups.append([d])
    return groups


def _info(group: List[_Dir]) -> SnapshotInfo:
    first = group[0]
    ranks = sorted({r for d in group for r in d.rank_files})
    failed: Dict[int, str] = {}
    complete = True
    reason = ""
    hosts: List[str] = []
    problems = [p for d in group for p in d.problems]
    for d in group:
        if not d.metas:
            complete = False
        for meta in d.metas:
            reason = reason or str(meta.get("reason") or "")
            if meta.get("host"):
                hosts.append(str(meta["host"]))
            for rank, why in (meta.get("failed") or {}).items():
                try:
                    failed[int(rank)] = str(why)
                except ValueError:
                    pass
            if any(int(r) not in d.rank_files for r in meta.get("ranks") or () if isinstance(r, int)):
                complete = False
    if not reason and first.owner is None:
        for d in group:
            for path in d.rank_files.values():
                try:
                    reason = str(read_rank(path).get("reason") or "")
                except UsageError as exc:
                    problems.append("%s: %s" % (path, exc.message))
                    continue
                break
            if reason:
                break
    recorded = [r for r in ranks if r not in failed]
    return SnapshotInfo(first.name, first.path, [d.path for d in group], first.job, first.when, reason, recorded,
                        failed, sum(d.bytes for d in group), complete, sorted(set(hosts)),
                        None if first.owner is None else _user(first.owner), tuple(problems), tuple(ranks))


def list_snapshots(root: str) -> List[SnapshotInfo]:
    """The snapshots under ``root``, oldest first (a missing directory holds none; a snapshot's own
    directory lists itself), other users' among them with their ``owner``."""
    here = _scan(root) if os.path.isdir(root) else None
    if here is not None and (here.rank_files or here.metas):
        return [_info([here])]
    return sorted((_info(g) for g in _groups(_dirs(root))), key=lambda s: (s.when, s.id))


def resolve(path_text: str) -> List[str]:
    """The rank files a ``snapshot:`` target names, in rank order: a rank file; a snapshot directory (with
    the other nodes' directories of that recording beside it: ``_groups``); or
    a directory of snapshots (its newest). A UsageError says what is there instead."""
    path = os.path.abspath(os.path.expanduser(path_text))
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise UsageError("no snapshot at %s" % path_text, hint="`probe snapshots DIR` lists what was recorded")
    here = _scan(path)
    if here is not None and (here.rank_files or here.metas):
        parent = os.path.dirname(path.rstrip("/"))
        for group in _groups(_dirs(parent)):
            if any(d.path == here.path for d in group):  # the named directory's own files first
                return _files(sorted(group, key=lambda d: d.path != here.path))
        return _files([here])
    listed = list_snapshots(path)
    found = [s for s in listed if s.owner is None]
    if not found:
        others = len(listed) - len(found)
        raise UsageError("no snapshot%s in %s%s" % (
            " of yours" if others else "", path_text,
            " (%d by other users, not read unless named by path)" % others if others else ""),
            hint="`probe snapshots %s` lists what was recorded; `probe TARGET snapshot --dir %s` records one"
            % (path_text, path_text))
    newest = found[-1]
    return _files([d for d in _dirs(path) if d.path in newest.dirs])


def _files(group: List[_Dir]) -> List[str]:
    by_rank: Dict[int, str] = {}
    for d in group:
        for rank, file in d.rank_files.items():
            by_rank.setdefault(rank, file)
    if not by_rank:
        raise UsageError("the snapshot %s holds no rank's record" % group[0].path,
                         hint="it may still be being written, or its node died before it wrote any")
    return [by_rank[r] for r in sorted(by_rank)]


# -- cleanup -------------------------------------------------------------------------------------------


def _env_number(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, "") or default)
    except ValueError:
        return default


def _only_ours(path: str) -> bool:
    try:
        return all(_OURS.match(n) for n in os.listdir(path))
    except OSError:
        return False


def clean(root: str, job: str) -> None:
    """Remove this host's snapshots of ``job`` beyond the newest PROBE_SNAPSHOT_KEEP, and this host's
    snapshots older than PROBE_SNAPSHOT_MAX_AGE_DAYS; never raises."""
    try:
        keep = max(1, int(_env_number("PROBE_SNAPSHOT_KEEP", KEEP)))
        max_age = _env_number("PROBE_SNAPSHOT_MAX_AGE_DAYS", MAX_AGE_DAYS) * 86400.0
        host = socket.gethostname()
        now = time.time()
        mine = [d for d in _dirs(root) if d.owner is None and (
                any(m.get("host") == host for m in d.metas) or (not d.metas and now - d.when > 3600))]
        same_job = sorted((d for d in mine if d.job == job), key=lambda d: (d.when, d.name))
        doomed = {d.path for d in same_job[:-keep]}
        doomed |= {d.path for d in mine if now - d.when > max_age}
        for path in sorted(doomed):
            if _only_ours(path):
                shutil.rmtree(path, ignore_errors=True)
    except Exception:  # cleanup is a courtesy: never the reason a record fails
        pass


# -- writing a snapshot --------------------------------------------------------------------------------


def save_snapshot(root: str, job: str, reason: str, records: List[Dict[str, Any]], started: float,
                  **meta: Any) -> Tuple[str, Dict[str, Any]]:
    """Write a node's records as one snapshot: a new directory under ``root``, each rank's file, then the
    meta (last: a directory with its meta is complete), then :func:`clean` for ``job``. ``meta``: more
    for the meta file (``hang_after_s``...). Returns the directory and the meta written."""
    import probe
    from probe.snapshot.record import is_recorded, write_meta, write_rank

    path = new_snapshot_dir(root, job, started)
    ranks, failed = [], {}
    size = 0
    for record in records:
        written = write_rank(path, record)
        size += os.path.getsize(written)
        if is_recorded(record):
            ranks.append(record["rank"])
        else:
            failed[str(record["rank"])] = str((record.get("missing") or {}).get("evidence")
                                              or record["evidence"][-1].get("why") or "no stacks could be read")
    info = dict(meta, job=job, host=socket.gethostname(), reason=reason, started=started, ended=time.time(),
                ranks=sorted(ranks), failed=failed, probe_version=probe.__version__)
    size += os.path.getsize(write_meta(path, info))
    clean(root, job)
    info["bytes"] = size
    return path, info
