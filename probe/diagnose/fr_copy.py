"""The Flight Recorder of a rank that cannot answer, from the copy its agent kept while it ran
(``probe.tables.torch.fr_copy``): read from this host's runtime directory, by the CLI for a rank of this
host or by the node helper for its own ranks.

:func:`attach` gives such a rank's evidence its recorder's rows (``fr``, as ``FR_SQL`` gives them live) and
what the copy is (``fr_copy``: when its entries were dumped, its groups' numbers and when they were last
read); where there is none, ``fr_why`` says exactly why. :func:`where_it_is` words, for the verdict on that
rank, which collective it is at against those the others wait in.

The file may be anyone's doing: a link, another user's file, one that is too big or not a copy is refused
with a line that says so, never followed or read whole.
"""

import errno
import os
import stat
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from probe.diagnose.evidence import RankEvidence, fr_by_pg

__all__ = ["attach", "numbers", "read", "rows_of", "summary", "where_it_is", "copy_words", "path_of", "kept_rows"]


def _limits() -> Tuple[int, int]:
    from probe.tables.torch.fr_copy import BODY_AT, MAX_BODY

    return BODY_AT, MAX_BODY


def path_of(pid: int) -> str:
    from probe import _paths

    return os.path.join(_paths.runtime_dir(), "fr-%d.json" % pid)


def read(pid: int, entries: bool = True) -> Tuple[Optional[Dict[str, Any]], List[Dict[str, Any]], Optional[str]]:
    """(header, entries, why): the copy of process ``pid`` on this host. ``header`` None: no copy or a
    refused file, ``why`` says which. Entries empty with a header: ``why`` says why (or None: none kept)."""
    from probe.tables.torch.fr_copy import HEADER, MARKS, MARKS_AT, entries_of, parse_header, parse_marks

    body_at, max_body = _limits()
    path = path_of(pid)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, [], None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None, [], "%s is refused: it is a symbolic link, not the copy its agent writes" % path
        return None, [], "%s cannot be read: %s" % (path, exc.strerror or exc)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None, [], "%s is refused: not a regular file" % path
        if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o022:
            return None, [], "%s is refused: another user's, or writable by others (the agent writes it 0600)" % path
        if info.st_size > body_at + max_body:
            return None, [], "%s is refused: %d MB, more than a copy holds (%d MB)" % (
                path, info.st_size >> 20, (body_at + max_body) >> 20)
        header, bad = parse_header(os.pread(fd, HEADER, 0))
        if header is None:
            return None, [], "%s is refused: %s" % (path, bad)
        if header["pid"] != pid:
            return None, [], "%s is refused: it names process %d" % (path, header["pid"])
        ticks = _start_ticks(pid)
        if ticks is not None and isinstance(header.get("ticks"), int) and header["ticks"] and header["ticks"] != ticks:
            return None, [], "%s was left by an earlier process %d, not this one" % (path, pid)
        for _ in range(20):  # a page being written (a step's end) is read again
            looked_at, marks, bad = parse_marks(os.pread(fd, MARKS.size, MARKS_AT), header["groups"])
            if bad != "its numbers were being written":
                break
        if looked_at is None:
            return None, [], "%s is refused: %s" % (path, bad)
        header = dict(header, looked_at=looked_at, marks=marks)
        if not header["body"] or not entries:
            return header, [], header.get("why")
        body = os.pread(fd, header["body"], body_at)
        if len(body) < header["body"]:
            return header, [], "%s is cut short: %d of its %d bytes of entries" % (path, len(body), header["body"])
        entries, bad = entries_of(body)
        return header, entries, None if bad is None else "%s: %s" % (path, bad)
    finally:
        os.close(fd)


def _start_ticks(pid: int) -> Optional[int]:
    from probe import _paths

    try:
        return _paths.process_start_ticks(str(pid))
    except (OSError, ValueError):
        return None  # gone: a dead rank's copy is its last


def rows_of(entries: Sequence[Dict[str, Any]]) -> List[Tuple[Any, ...]]:
    """The rows of ``torch.flight_recorder`` (its own conversion); an entry that cannot be read is left out."""
    from probe.tables.torch.flight_recorder import _row

    out = []
    for entry in entries:
        try:
            out.append(_row(entry))
        except (TypeError, ValueError, AttributeError, OverflowError, IndexError):
            continue
    return out


def summary(rows: Sequence[Tuple[Any, ...]], now: float) -> List[Dict[str, Any]]:
    """One row per process group as ``evidence.FR_SQL`` gives it live: its last collective and its last few."""
    from probe.diagnose.collectives import recent_text
    from probe.tables.torch.flight_recorder import COLUMNS

    names = [c.name for c in COLUMNS]
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for row in rows:
        entry = dict(zip(names, row))
        if entry.get("is_p2p") or entry.get("collective_seq_id") is None:
            continue
        groups.setdefault(str(entry.get("pg")), []).append(entry)
    out = []
    for pg, entries in sorted(groups.items()):
        entries.sort(key=lambda e: int(e["collective_seq_id"]))
        last = entries[-1]
        created = [_epoch(e["time_created"]) for e in entries if e.get("time_created") is not None]
        out.append({
            "pg": pg, "pg_desc": last.get("pg_desc"), "last_seq": int(last["collective_seq_id"]),
            "last_op": last.get("op"), "last_done": bool(last.get("retired")) or last.get("state") == "completed",
            "last_age": max(0.0, now - _epoch(last["time_created"])) if last.get("time_created") is not None else None,
            "period": (max(created) - min(created)) / max(len(created) - 1, 1) if created else None,
            "call_site": last.get("call_site"), "entries": len(entries), "last_sizes": last.get("input_sizes"),
            "last_dtypes": last.get("input_dtypes"), "recent": recent_text(entries)})
    return out


def _epoch(value: Any) -> float:
    import datetime

    if isinstance(value, datetime.datetime):
        return value.replace(tzinfo=datetime.timezone.utc).timestamp()
    return float(value)


def attach(ev: RankEvidence, client: Any, why: str) -> None:
    """Fill a rank that cannot answer with its copy's recorder (``fr``, ``fr_copy``), or say in ``fr_why``
    exactly why there is none; ``why``: why its agent cannot answer. Never raises."""
    try:
        _attach(ev, client, why)
    except Exception as exc:  # a surprise in a file that is anyone's: said, never raised
        ev.fr, ev.fr_copy = None, None
        ev.fr_why = "%s; its Flight Recorder's copy could not be read (%s: %s)" % (why, type(exc).__name__, exc)


def _attach(ev: RankEvidence, client: Any, why: str) -> None:
    pid = _local_pid(ev, client)
    if pid is None:
        ev.fr_why = ("%s, and its Flight Recorder's copy is kept on its own host (%s): read there by its node "
                     "helper (--via helpers), or run probe on that host" % (why, ev.host))
        return
    header, entries, bad = read(pid)
    dumped = _torch_dump(pid, header)
    if dumped is not None and not isinstance(dumped, str):
        path, when, dump_entries = dumped
        now = time.time()
        ev.fr = summary(rows_of(dump_entries), now) or None
        ev.fr_copy = {"pid": pid, "source": "torch", "path": path, "looked_at": when, "copied_at": when,
                      "marks": dict(list((header or {}).get("marks", {}).items())[:64]), "copy_seq": {},
                      "entries": len(dump_entries), "read_at": now}
        ev.fr_why = None if ev.fr else "%s; torch's dump %s holds no collective" % (why, path)
        if ev.fr is None:
            ev.fr_copy["why"] = "torch's dump %s holds no collective" % path
        return
    if header is None:
        ev.fr_why = "%s; %s%s" % (why, bad or _no_copy(pid, ev.state),
                                  "; %s" % dumped if isinstance(dumped, str) else "")
        return
    now = time.time()
    rows = rows_of(entries)
    ev.fr = summary(rows, now) or None
    ev.fr_copy = {"pid": pid, "looked_at": header["looked_at"], "copied_at": header.get("copied_at"),
                  "marks": dict(list(header["marks"].items())[:64]), "copy_seq": dict(list(header["copy_seq"].items())[:64]),
                  "every": header["every"], "interval": header["interval"], "entries": len(rows), "read_at": now}
    if ev.fr is None:
        off = _environ(pid).get("TORCH_FR_BUFFER_SIZE", _environ(pid).get("TORCH_NCCL_TRACE_BUFFER_SIZE"))
        reason = bad or ("its Flight Recorder is off (TORCH_FR_BUFFER_SIZE=%s in its environment)" % off
                         if off is not None and off.strip() in ("0", "") else
                         "its Flight Recorder held no collective when last copied" if header.get("copied_at")
                         else "no dump was copied yet (one is taken when a collective number moves)")
        ev.fr_copy["why"] = "%s%s" % (reason, "; only its collective numbers were kept" if header["marks"] else "")
        ev.fr_why = "%s; its copy holds no entry: %s" % (why, ev.fr_copy["why"])
    else:
        ev.fr_why = None


def kept_rows(ev: RankEvidence) -> Tuple[List[Tuple[Any, ...]], Optional[str]]:
    """The rows of ``torch.flight_recorder`` that ``ev.fr`` was made from (its agent's copy or torch's dump,
    read again: the evidence keeps only the summary), or why none."""
    copy = ev.fr_copy if isinstance(ev.fr_copy, dict) else {}
    pid = copy.get("pid")
    if not isinstance(pid, int):
        return [], None
    if copy.get("source") == "torch":
        dumped = _torch_dump(pid, None)
        if isinstance(dumped, tuple):
            return rows_of(dumped[2]), None
        return [], dumped
    _, entries, bad = read(pid)
    return rows_of(entries), bad


def _torch_dump(pid: int, header: Optional[Dict[str, Any]]) -> Any:
    """torch's own dump of the process (``$TORCH_FR_DUMP_TEMP_FILE<rank>``: NCCL's watchdog writes it on a
    collective's timeout, without the GIL) where it is newer than the agent's copy: (path, when, entries);
    else why not (text), or None where the job never named one."""
    from probe.errors import UsageError
    from probe.reader.fr_dump import MAX_ENTRIES, load_dump, rank_dump

    env = _environ(pid)
    path, why = rank_dump(pid, env, _started(pid))
    if path is None:
        named = "TORCH_FR_DUMP_TEMP_FILE" in env or "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" in env
        return why if named or (why or "").endswith("another user's") else None
    when = os.stat(path).st_mtime
    if header is not None and header.get("looked_at", 0) >= when:
        return "torch's dump %s is older than its agent's copy" % path
    try:
        dump = load_dump(path)
    except UsageError as exc:
        return exc.message
    entries = [dict(e, process_group=list(e["process_group"])[:2] if isinstance(e.get("process_group"), (list, tuple))
                    else [e.get("process_group"), None])
               for e in (dump.get("entries") or [])[-MAX_ENTRIES:] if isinstance(e, dict)]
    return path, when, entries


def _started(pid: int) -> Optional[float]:
    """When process ``pid`` started (time.time()), from its start ticks and the boot time; None if gone."""
    ticks = _start_ticks(pid)
    if ticks is None:
        return None
    try:
        with open("/proc/stat", "rb") as handle:
            boot = next(int(line.split()[1]) for line in handle if line.startswith(b"btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):
        return None


def numbers(ev: RankEvidence, client: Any) -> None:
    """An answering rank whose recorder holds nothing (off): its groups' collective numbers from its
    agent's file (``fr_copy`` with ``live``), so that a rank that cannot answer is placed against it. Never
    raises; nothing where there is no file."""
    try:
        pid = _local_pid(ev, client)
        header = read(pid, entries=False)[0] if pid is not None else None
    except Exception:  # a file that is anyone's: no numbers, as with none
        return
    if header is not None and header["marks"]:
        ev.fr_copy = {"pid": pid, "live": True, "looked_at": header["looked_at"], "read_at": time.time(),
                      "marks": dict(list(header["marks"].items())[:64])}


def _local_pid(ev: RankEvidence, client: Any) -> Optional[int]:
    target = getattr(client, "target", None)
    if target is not None and target.is_local:
        return int(target.pid)
    if ev.pid is None or target is None:
        return None
    from probe.client.same_host import same_host_pid

    return same_host_pid(target, ev.pid)


def _environ(pid: int) -> Dict[str, str]:
    """The variables the process started with that say where torch's dumps go (our own user's processes only);
    {} unread."""
    from probe.reader import proc

    raw = proc.environ(pid, (b"RANK", b"HOME", b"XDG_CACHE_HOME"), (b"TORCH_", b"PROBE_"))
    return {key.decode("ascii", "replace"): value.decode("utf-8", "replace")[:200] for key, value in raw.items()}


def _no_copy(pid: int, state: str) -> str:
    """Why a process left no copy, as far as its environment tells."""
    if state == "no_agent":
        return "no probe agent runs in it, and only the agent keeps a copy of its Flight Recorder"
    env = _environ(pid)
    size = env.get("TORCH_FR_BUFFER_SIZE", env.get("TORCH_NCCL_TRACE_BUFFER_SIZE"))
    if env.get("PROBE_FR_COPY_EVERY", "").strip() in ("0", "0.0"):
        return "its agent keeps no copy of its Flight Recorder (PROBE_FR_COPY_EVERY=0 in its environment)"
    if size is not None and size.strip() in ("0", ""):
        return ("its Flight Recorder is off (TORCH_FR_BUFFER_SIZE=%s) and its agent kept no copy" % size.strip())
    return ("its agent kept no copy of its Flight Recorder: the copy starts once the program has initialised "
            "torch.distributed (it had not, when it stopped running, or its agent is older than the copy)")


def _time(value: Any) -> float:
    """A time from the evidence (a record's, a helper's: checked), or 0."""
    return float(value) if type(value) in (int, float) and 0 <= value < 1e11 else 0.0


def _clock(wall: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(wall)) + (".%d" % int(wall % 1 * 10))


def copy_words(ev: RankEvidence) -> str:
    """"its Flight Recorder's copy (entries as of 12:03:09.4, numbers as of its agent's last look at
    12:03:10.2, 4.2 s before this look)"."""
    copy = ev.fr_copy or {}
    looked = _time(copy.get("looked_at"))
    read_at = _time(copy.get("read_at")) or time.time()
    if copy.get("source") == "torch":
        return "torch's own Flight Recorder dump (%s, written at %s, %.1f s before this look)" % (
            str(copy.get("path"))[:300], _clock(looked), max(0.0, read_at - looked))
    parts = []
    if _time(copy.get("copied_at")):
        parts.append("entries as of %s" % _clock(_time(copy["copied_at"])))
    parts.append("numbers as of its agent's last look at %s, %.1f s before this look" % (
        _clock(looked), max(0.0, read_at - looked)))
    return "its Flight Recorder's copy (%s; what it issued after is in no copy)" % ", ".join(parts)


def where_it_is(ev: RankEvidence, ranks: Dict[int, RankEvidence],
                who: Callable[[Sequence[int]], str]) -> Tuple[str, Optional[str]]:
    """(the summary's words, the evidence's line) on which collective a rank that cannot answer is at, by its
    copy, against the answering ranks' recorders: "rank 1 is at gloo:all_reduce #41 of group 0; rank 0
    waits in #42". ('', why) where its copy has nothing to say."""
    try:
        return _where_it_is(ev, ranks, who)
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as exc:  # a record is anyone's
        return "", "its Flight Recorder's copy, as recorded, cannot be read (%s)" % type(exc).__name__


def _where_it_is(ev: RankEvidence, ranks: Dict[int, RankEvidence],
                 who: Callable[[Sequence[int]], str]) -> Tuple[str, Optional[str]]:
    copy = ev.fr_copy if isinstance(ev.fr_copy, dict) else None
    if copy is None:
        return "", "its Flight Recorder: none (%s)" % (ev.fr_why or "not read") if ev.fr_why else None
    mine = fr_by_pg(ev)
    marks = {str(k): v for k, v in (copy.get("marks") if isinstance(copy.get("marks"), dict) else {}).items()
             if type(v) is int}
    others: Dict[str, Dict[int, Dict[str, Any]]] = {}
    for r, other in ranks.items():
        if r != ev.rank and other.state == "answering":
            for pg, row in fr_by_pg(other).items():
                others.setdefault(pg, {})[r] = row
    found = []
    for pg in sorted(set(mine) | set(marks), key=lambda p: (p not in others, p)):
        at = max([v for v in (marks.get(pg), (mine.get(pg) or {}).get("last_seq")) if isinstance(v, int)] or [0])
        recent = _ops(mine.get(pg))
        text = "%s #%d of group %s" % (recent.get(at) or "collective", at, pg)
        if at not in recent and mine.get(pg):
            text += " (past its copied entries, which end at #%s)" % mine[pg].get("last_seq")
        rows = others.get(pg) or {}
        peers = {r: o.fr_copy["marks"][pg] for r, o in ranks.items() if r != ev.rank and o.state == "answering"
                 and isinstance(o.fr_copy, dict) and o.fr_copy.get("live") and isinstance(o.fr_copy.get("marks"), dict)
                 and type(o.fr_copy["marks"].get(pg)) is int}
        if not rows and peers:  # their recorders are off: their numbers, from their agents' files
            ahead = sorted(r for r, n in peers.items() if n > at)
            if ahead:
                one = len(ahead) == 1
                text += "; %s %s at #%s (%s recorder%s off: the numbers alone)" % (
                    who(ahead), "is" if one else "are", ",".join(str(n) for n in sorted({peers[r] for r in ahead})),
                    "its" if one else "their", " is" if one else "s are")
        if rows:
            top = max(int(r["last_seq"]) for r in rows.values())
            waiting = sorted(r for r, row in rows.items() if int(row["last_seq"]) == top and not row.get("last_done"))
            if waiting and top > at:
                text += "; %s wait%s in %s #%d" % (who(waiting), "s" if len(waiting) == 1 else "",
                                                   str(rows[waiting[0]].get("last_op") or "it"), top)
                if top > at + 1:
                    text += " (#%d-%d not in its copy: issued after it, or never)" % (at + 1, top - 1)
            elif waiting and top <= at:
                text += "; %s wait%s in #%d, which it had issued" % (who(waiting), "s" if len(waiting) == 1 else "", top)
        found.append(text)
    unread = " (its entries: none, %s)" % str(copy["why"])[:400] if copy.get("why") else ""
    if not found:
        return "", "%s: no collective in it%s" % (copy_words(ev), unread)
    looked = _time(copy.get("looked_at"))
    summary = "; by %s (as of %s, %.1f s before this look) it is at %s" % (
        "torch's own Flight Recorder dump" if copy.get("source") == "torch" else "its Flight Recorder's copy",
        _clock(looked), max(0.0, (_time(copy.get("read_at")) or time.time()) - looked), found[0])
    return summary, "%s: %s%s" % (copy_words(ev), "; ".join(found[:4]), unread)


def _ops(row: Optional[Dict[str, Any]]) -> Dict[int, str]:
    from probe.diagnose.collectives import parse_recent

    return {seq: entry[0] for seq, entry in parse_recent(row).items()} if row else {}
