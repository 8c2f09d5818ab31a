"""``probe list``: local Python processes, which run an agent, and how to reach each.

Each row names the program's own script first (``train.py --lr 3``, not ``python /long/path/...``), and
how to reach it as one short command; the other ways (its TCP address and token file) are said under the
table. Dead processes come from their crash records: those that died before this terminal's session
began (its session leader's start), and those stopped on purpose (SIGTERM, Ctrl-C) over
``STOPPED_LISTED_S`` ago, are left out unless ``--all``; ``probe PID backtrace`` reads any record. On a
narrow terminal the state gives way first, then the Python version, then the script; the column that
says how to reach a process is cut last.
"""

import json
import os
import re
import textwrap
import time
from typing import Any, Dict, List, Optional, Tuple

from probe.cli.commands import made_on_first_use
from probe.cli.output import echo
from probe.cli.render import render_rows, terminal_width, text_width
from probe.cli.spec import Param, output_params
from probe.client.discovery import local_agents, remove_stale_files
from probe.client.results import Rows


STOPPED_LISTED_S = 3600
# On a narrow terminal, in this order until the table fits: a column cut down to a width, left out (None),
# or (``reach`` 0) the notes in parentheses after each command to reach a process left out.
_GIVE_WAY = (("state", 24), ("python", None), ("script", 24), ("state", 12), ("script", 14), ("state", 8))
_PYTHON = re.compile(r"(python|pypy)[\d.]*[dmu]*$")
_OPTION_WITH_VALUE = {"-X", "-W", "-Q"}


def _command_of(pid: int) -> str:
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _attachable(exclude: set) -> List[Dict[str, Any]]:
    """Python processes without an agent, from the injector's scan (when the injector is available)."""
    try:
        from probe.injector import candidates
    except ImportError:
        return []
    out = []
    for proc in candidates():
        pid = getattr(proc, "pid", None)
        if pid is None or pid in exclude or getattr(proc, "has_agent", False):
            continue
        job = _helper_reach(pid)
        out.append({"pid": pid, "agent": "no" if job is None else "helper",
                    "rank": None, "python": getattr(proc, "python_version", None),
                    "command": " ".join(getattr(proc, "cmdline", []) or [])[:100],
                    "reach": "probe %d inject" % pid if job is None else job})
    _name_loader_workers(out)
    for record in out:
        held = _gil_kept(record["pid"]) if "state" not in record else None
        if held:
            record["state"] = held
    return out


def _gil_kept(pid: int) -> Optional[str]:
    """The state of a process none of whose Python code can run: a thread keeps the GIL in a C call (read
    from outside without stopping it, and confirmed a moment later, as inject's advice does); None else.
    An agent cannot start there either: inject's start is queued until the call returns."""
    try:
        from probe.injector.advice import gil_kept_in_c
        from probe.reader import live

        first = live.read_live(pid, stop=False)
        holder = first.gil_holder()
        if holder is None:  # no thread holds the GIL now: the common case, one read
            return None
        kept = gil_kept_in_c(pid, first)
    except Exception:  # noqa: BLE001 -- a process that cannot be read (another user's, gone) is listed as before
        return None
    if kept is None:
        return None
    return "GIL kept in a C call by thread %s, from %s" % (kept.label().strip(), kept.where())


def _name_loader_workers(records: List[Dict[str, Any]]) -> None:
    """A DataLoader worker (torch names its process pt_data_worker) is said to be one, of its main process:
    ``worker_of`` (that pid) and ``worker_id`` (its number, asked of the main process's agent,
    python.workers, where one runs; else unknown), and its state reads "DataLoader worker N of PID"."""
    workers: List[Tuple[Dict[str, Any], int]] = []
    for record in records:
        pid = record["pid"]
        if _read(pid, "comm").strip() != "pt_data_worker":
            continue
        parent = _ppid(pid)
        if parent and "multiprocessing.forkserver" in _command_of(parent):
            parent = _ppid(parent)  # started by the forkserver, which the main process started
        if parent:
            workers.append((record, parent))
    ids = _worker_ids_of({parent for _, parent in workers})
    for record, parent in workers:
        pid = record["pid"]
        worker_id = ids.get(parent, {}).get(pid)
        record["worker_of"], record["worker_id"] = parent, worker_id
        record["state"] = ("DataLoader worker of %d" % parent if worker_id is None
                           else "DataLoader worker %d of %d" % (worker_id, parent))


WORKER_IDS_S = 2.0  # all the main processes together: probe list stays quick when one of them is busy


def _worker_ids_of(parents: "set[int]") -> Dict[int, Dict[int, Any]]:
    """{main process: {worker pid: worker id}}, every main process asked at once, within WORKER_IDS_S; one
    that has not answered by then has its workers listed without their numbers."""
    import threading

    found: Dict[int, Dict[int, Any]] = {}
    threads = [threading.Thread(target=lambda p=p: found.__setitem__(p, _worker_ids(p)), daemon=True)
               for p in sorted(parents)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + WORKER_IDS_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return dict(found)


def _worker_ids(pid: int) -> Dict[int, Any]:
    """{worker pid: worker id} from the agent of process ``pid`` (its python.workers); {} without one."""
    from probe import _paths
    from probe.client import connect
    from probe.errors import ProbeError

    if not os.path.exists(_paths.find_socket_path(pid)):
        return {}
    try:
        table = connect(str(pid), timeout=WORKER_IDS_S).table_rows("python.workers")
    except (ProbeError, OSError, ValueError):
        return {}
    names = [c[0] for c in table.columns]
    if "pid" not in names or "worker_id" not in names:
        return {}
    at, wid = names.index("pid"), names.index("worker_id")
    return {row[at]: row[wid] for row in table.rows}


def _read(pid: int, name: str) -> str:
    try:
        with open("/proc/%d/%s" % (pid, name), "rb") as handle:
            return handle.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _ppid(pid: int) -> int:
    stat = _read(pid, "stat")
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else 0


def _helper_reach(pid: int) -> Optional[str]:
    """For a torchrun launcher that runs a host helper (it has no agent, by design): the command that lists
    its job's ranks through it. None for any other process."""
    from probe import _paths
    from probe.agent.options import binds_every_interface, probe_port_binding

    if not os.path.exists(_paths.helper_socket_path(pid)):
        return None
    try:
        with open("/proc/%d/environ" % pid, "rb") as handle:
            pairs = [item.split(b"=", 1) for item in handle.read().split(b"\0") if b"=" in item]
        environ = {k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, v in pairs}
        host, port = probe_port_binding(environ)
    except (OSError, ValueError):
        return "host helper of a torchrun job: probe MASTER:PROBE_PORT ranks"
    shown = "127.0.0.1" if binds_every_interface(host) else ("[%s]" % host if ":" in host else host)
    return "probe %s:%d ranks  (its job's host helper)" % (shown, port)


def _remove_unused_package_dirs() -> None:
    """The injector's copies of probe (``pkg-*``) that no live process imports from any more."""
    try:
        from probe.injector.exposure_users import remove_unused
    except ImportError:
        return
    remove_unused()


def _stopped_on_purpose(cause: str) -> bool:
    """SIGTERM or Ctrl-C: how a person or a scheduler ends a process, not a crash."""
    return cause.startswith("SIGTERM") or cause.startswith("uncaught exception: KeyboardInterrupt")


def _dead(show_all: bool) -> Tuple[List[Dict[str, Any]], int]:
    """Processes that died with an agent, from the crash records their agents left (old ones cleaned up),
    and how many are not listed (``show_all``: all are): those that died before this session began, and
    those stopped on purpose over ``STOPPED_LISTED_S`` ago."""
    from probe.reader import crash

    crash.clean_up()
    out = []
    hidden = 0
    now = time.time()
    began = None if show_all else _session_start()
    for record in crash.records():
        if record.alive:
            continue
        cause = record.cause
        if not show_all and record.died_at is not None and (
                (now - record.died_at > STOPPED_LISTED_S and _stopped_on_purpose(cause))
                or (began is not None and record.died_at < began)):
            hidden += 1
            continue
        when = " " + time.strftime("%m-%d %H:%M:%S", time.localtime(record.died_at)) if record.died_at else ""
        out.append({"pid": record.pid, "agent": "dead", "state": "died%s: %s" % (when, cause),
                    "rank": None, "python": record.header.get("python"),
                    "command": record.header.get("command", "")[:100],
                    "reach": "probe %d backtrace  (its last stacks)" % record.pid if record.has_stacks else "-"})
    return out, hidden


def script_of(command: str) -> str:
    """The program's own part of a command line, first: the script by its name and its arguments
    (``python -u /x/train.py --lr 3`` -> ``train.py --lr 3``), ``-m module ...``, or ``-c ...``; a command
    that is no Python interpreter by its name (torchrun, a worker) as it is, its program by its name."""
    words = command.split(" ")
    if not words or not words[0]:
        return command
    if not _PYTHON.match(os.path.basename(words[0])):
        return " ".join([os.path.basename(words[0])] + words[1:])
    i = 1
    while i < len(words) and words[i].startswith("-") and words[i] not in ("-m", "-c", "-"):
        i += 2 if words[i] in _OPTION_WITH_VALUE else 1
    rest = words[i:]
    if not rest:
        return os.path.basename(words[0])
    if rest[0] in ("-m", "-c", "-"):
        return " ".join(rest)
    return " ".join([os.path.basename(rest[0])] + rest[1:])


def _session_start() -> Optional[float]:
    """When this terminal's session began (the start of its session leader, the login shell), as a time
    of the epoch; None where that cannot be read."""
    try:
        leader = os.getsid(0)
        stat = _read(leader, "stat")
        ticks = int(stat[stat.rfind(")") + 2:].split()[19])  # since boot; /proc/stat's btime is whole seconds
        with open("/proc/uptime") as handle:
            uptime = float(handle.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _folded(records: List[Dict[str, Any]]) -> Tuple[List[str], List[str]]:
    """Each row's way to reach it as one command, and the other ways as lines for under the table."""
    cells, notes = [], []
    for record in records:
        first, _, others = str(record["reach"]).partition("  or  ")
        cells.append(first.split("  (", 1)[0])
        if others:
            notes.append("%d also: %s" % (record["pid"], others))
    return cells, notes


def _cut_to(text: str, width: int) -> str:
    if text_width(text) <= width:
        return text
    out, used = [], 0
    for char in text:
        if used + text_width(char) > width - 1:
            break
        out.append(char)
        used += text_width(char)
    return "".join(out) + "…"


def _give_way(names: List[str], rows: List[List[str]], width: int) -> bool:
    """Narrow the table as ``_GIVE_WAY`` says until it fits ``width``, so that the renderer, which cuts the
    widest column first, has no need to cut ``reach``. Changes ``names`` and ``rows``; True if it did."""
    natural = [max([text_width(n)] + [text_width(r[i]) for r in rows]) for i, n in enumerate(names)]
    over = sum(natural) + 2 * (len(names) - 1) - width
    changed = False
    for name, floor in _GIVE_WAY:
        if over <= 0:
            break
        if name not in names:
            continue
        i = names.index(name)
        if floor == 0:
            for row in rows:
                row[i] = row[i].split("  (", 1)[0]
            shorter = max([text_width(name)] + [text_width(r[i]) for r in rows])
            over -= natural[i] - shorter
            changed = changed or shorter < natural[i]
            natural[i] = shorter
            continue
        if floor is None:
            over -= natural[i] + 2
            del names[i], natural[i]
            for row in rows:
                del row[i]
            changed = True
            continue
        narrower = max(floor, natural[i] - over)
        if narrower < natural[i]:
            for row in rows:
                row[i] = _cut_to(row[i], narrower)
            over -= natural[i] - narrower
            natural[i] = narrower
            changed = True
    return changed


PARAMS = [
    *output_params("table", "json", json_help="the processes as JSON rows"),
    Param("--agents-only", dest="agents_only", help="Only processes that run (or ran) an agent."),
    Param("-x", "--vertical", dest="vertical", help="One column per line, each process in its block, values whole."),
    Param("--wide", dest="wide", help="Cut no cell and do not fit the table to the terminal."),
    Param("--all", dest="show_all", help="Also the processes stopped on purpose (SIGTERM, Ctrl-C) more than an hour ago."),
]
"""The command's options, which click and ``probe.cli.fast`` both read (``probe.cli.spec``)."""


def _command() -> Any:
    import click

    from probe.cli.options import with_params

    @click.command("list")
    @with_params(PARAMS)
    def list_(fmt: Optional[str], agents_only: bool, vertical: bool, wide: bool, show_all: bool) -> None:
        """Local Python processes: those running an agent, those that could be attached, and those that
        died with an agent (how, and when: their crash records are kept 7 days, the newest 20; one stopped
        on purpose, by SIGTERM or Ctrl-C, is listed for an hour)."""
        run(fmt, agents_only, vertical, wide, show_all)

    return list_


__getattr__ = made_on_first_use("list_", _command)


def run(fmt: Optional[str] = None, agents_only: bool = False, vertical: bool = False, wide: bool = False,
        show_all: bool = False) -> None:
    """The command (``probe.cli.fast`` calls it without click)."""
    records: List[Dict[str, Any]] = []
    remove_stale_files()  # sockets and tokens of agents and host helpers that died without their exit hooks
    _remove_unused_package_dirs()
    for agent in local_agents():
        if agent.blocked:
            records.append({"pid": agent.pid, "agent": "blocked", "state": agent.error, "rank": None,
                            "python": None, "command": _command_of(agent.pid)[:100],
                            "reach": "probe %d backtrace  (read from outside)" % agent.pid})
            continue
        if not agent.alive:
            continue
        info = agent.health or {}
        reach = "probe %d ..." % agent.pid
        if info.get("tcp"):
            reach += "  or  probe %s%s ..." % (info.get("tcp_reach") or info["tcp"],
                                              " --token-file %s" % info["token_file"] if info.get("token_file") else "")
        records.append({"pid": agent.pid, "agent": "yes", "state": "running", "rank": info.get("rank"),
                        "python": info.get("python"), "command": _command_of(agent.pid)[:100], "reach": reach})
        if info.get("tcp_note"):  # its PROBE_PORT is taken: by whom (another user's process: a warning)
            records[-1]["tcp_note"] = str(info["tcp_note"])
    if not agents_only:
        records.extend(dict(r, state=r.get("state", "running")) for r in _attachable({r["pid"] for r in records}))
    dead, hidden = _dead(show_all)
    records.extend(dead)
    note = ("%d dead process%s (from before this session, or stopped on purpose over an hour ago) %s not shown: "
            "probe list --all" % (hidden, "" if hidden == 1 else "es", "is" if hidden == 1 else "are")) if hidden else None
    for record in records:
        record["script"] = script_of(str(record.get("command") or ""))
    if fmt == "json":
        echo(json.dumps(records))
        if note:
            echo(note, err=True)
        return
    if not records:
        echo("no agents found; start one with PROBE=1 in a process's environment, or `probe PID inject`")
        if note:
            echo(note)
        return
    shorten = not (vertical or wide)
    names = ["pid", "script", "agent", "state", "rank", "python", "reach"] if shorten else [
        "pid", "agent", "state", "rank", "python", "command", "reach"]
    if all(r["rank"] is None for r in records):
        names.remove("rank")  # no process is a rank: the column would only hold dashes
    cells = [[str("-" if r[c] is None else r[c]) for c in names] for r in records]
    folded: List[str] = []
    if shorten:  # the way to reach each, one command; the others under the table
        reach, folded = _folded(records)
        for row, text in zip(cells, reach):
            row[-1] = text
    width = terminal_width()
    footer = None
    if width and shorten and _give_way(names, cells, width):
        footer = "narrowed to fit; -x or --wide shows all"
    table = Rows(tuple((c, "") for c in names), cells)
    echo(render_rows(table, "vertical" if vertical else "table", width, wide, footer=footer))
    for line in folded:  # folded to the terminal's width, a word (a path) whole where it fits a line
        echo(textwrap.fill(line, width, subsequent_indent="    ", break_on_hyphens=False, break_long_words=False) if width else line)
    for record in records:
        if record.get("tcp_note"):
            echo("process %d: %s" % (record["pid"], record["tcp_note"]))
    if note:
        echo(note)
