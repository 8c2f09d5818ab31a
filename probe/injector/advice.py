"""What to tell someone about a local process that runs no agent, so that the next step they are given works.

"Start it with PROBE=1, or inject" is the right advice only for a process of one's own, on a Python
probe supports, whose interpreter has probe installed, that is not torchrun's launcher and whose GIL is
free. Each case here is told from /proc (and, for the GIL, the stacks read from outside), never by
asking the process: another user's process (only its owner or root may look inside), an old Python,
``PROBE=1`` under an interpreter without probe, an agent whose socket lies in another runtime
directory, torchrun's launcher (its ranks have the agents), and a C call that keeps the GIL (an
injected agent needs the GIL to start). Runs in the client's process.
"""

import os
import re
import shlex
import sys
import time
from typing import Any, List, Optional, Tuple

import probe
from probe.errors import Forbidden
from probe.injector.target import expected_socket_path, may_trace_anyone, target_environ
from probe.reader import proc

__all__ = ["another_users", "command_line", "old_python", "probe_requested", "autostart_installed",
           "agent_elsewhere", "launcher", "launcher_advice", "gil_kept_in_c", "MIN_VERSION"]

MIN_VERSION = (3, 9)
_HELD_CONFIRM_S = 0.35  # how long a sleeping GIL holder is watched (as the client's outside.CONFIRM_S)


def command_line(pid: int, command: str = "COMMAND", target: Optional[str] = None) -> str:
    """The probe command this process runs, as the user can type it again (``probe 42 backtrace``), with
    ``target`` in place of the pid when given; ``probe PID COMMAND`` where this is not the probe command
    (the Python API)."""
    argv = list(sys.argv or [])
    if argv and (os.path.basename(argv[0]) == "probe" or argv[0].endswith(os.path.join("probe", "__main__.py"))):
        words = ["probe"] + [target if target is not None and a == str(pid) else a for a in argv[1:]]
        return " ".join(shlex.quote(a) for a in words)
    return "probe %s %s" % (target or pid, command)


# -- whose process -------------------------------------------------------------------------------

def _uids(pid: int) -> Optional[List[int]]:
    """Real, effective and saved uid of ``pid`` (``/proc/PID/status`` is readable by every user)."""
    try:
        with open("/proc/%d/status" % pid) as handle:
            for line in handle:
                if line.startswith("Uid:"):
                    return [int(u) for u in line.split()[1:4]]
    except (OSError, ValueError):
        return None
    return None


def _user(uid: int) -> Optional[str]:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return None


def another_users(pid: int, command: str = "COMMAND") -> Optional[Forbidden]:
    """The error for a process of another user that we may not look inside (exit 4), with the commands
    that work; None for our own process, one that is gone, or when we may trace anyone (root)."""
    uids = _uids(pid)
    me = os.getuid()
    if uids is None or all(u == me for u in uids) or may_trace_anyone():
        return None
    owner = next(u for u in uids if u != me)
    name = _user(owner)
    try:
        with open("/proc/%d/comm" % pid) as handle:
            comm = handle.read().strip()
    except OSError:
        comm = "?"
    again = command_line(pid, command)
    message = ("process %d (%s) is another user's process%s: it belongs to uid %d, and probe runs as uid %d%s; only "
               "its owner or root may look inside it" % (pid, comm, " (%s's)" % name if name else "", owner, me,
                                                         " (%s)" % _user(me) if _user(me) else ""))
    if owner == 0:
        hint = "run probe as root: `sudo %s`" % again
    else:
        who = name if name and re.fullmatch(r"[A-Za-z0-9_.][A-Za-z0-9_.-]*", name) else "'#%d'" % owner
        hint = "run probe as that user: `sudo -u %s %s`, or as root: `sudo %s`" % (who, again, again)
    return Forbidden(message, hint=hint)


# -- which interpreter ----------------------------------------------------------------------------

def old_python(pid: int) -> Optional[Tuple[int, int]]:
    """The target's (major, minor) when it is older than probe's agent supports, else None."""
    try:
        from probe.injector.target import read_target

        version = read_target(pid).version
    except OSError:
        return None
    return version if version is not None and version < MIN_VERSION else None


def probe_requested(pid: int) -> Optional[str]:
    """The variable (``PROBE=1``, ``PROBE_PORT=...``) that asks for an agent in the target's environment
    as it started, or None."""
    env = target_environ(pid)
    if env.get("PROBE", "0") not in ("", "0"):
        return "PROBE=%s" % env["PROBE"]
    for key in ("PROBE_LISTEN", "PROBE_PORT"):
        if env.get(key):
            return "%s=%s" % (key, env[key])
    return None


def _site_dirs(pid: int, exe: str, version: Tuple[int, int]) -> List[str]:
    """Where the interpreter ``exe`` reads ``.pth`` files: its prefix's site-packages (a virtual
    environment's, and its base's when it includes them), Debian's dist-packages, the user's site."""
    tag = "python%d.%d" % version
    env = target_environ(pid)
    prefix = os.path.dirname(os.path.dirname(exe))
    prefixes = [prefix]
    config = os.path.join(prefix, "pyvenv.cfg")
    if os.path.exists(config):
        try:
            with open(config) as handle:
                settings = dict(line.split("=", 1) for line in handle if "=" in line)
            settings = {k.strip(): v.strip() for k, v in settings.items()}
        except OSError:
            settings = {}
        if settings.get("include-system-site-packages", "false").lower() == "true" and settings.get("home"):
            prefixes.append(os.path.dirname(settings["home"].rstrip("/")))
    dirs = []
    for base in prefixes:
        for lib in ("lib", "lib64"):
            dirs.append(os.path.join(base, lib, tag, "site-packages"))
        dirs.append(os.path.join(base, "local", "lib", tag, "dist-packages"))
        dirs.append(os.path.join(base, "lib", "python3", "dist-packages"))
        dirs.append(os.path.join(base, "local", "lib", tag, "site-packages"))
    if env.get("HOME") and env.get("PYTHONNOUSERSITE") is None:
        dirs.append(os.path.join(env.get("PYTHONUSERBASE") or os.path.join(env["HOME"], ".local"), "lib", tag,
                                 "site-packages"))
    return dirs


def autostart_installed(pid: int) -> Tuple[Optional[bool], str]:
    """(whether probe's start-up hook is installed for the target's interpreter, that interpreter's path);
    None where that cannot be told (an unreadable executable, an unknown version)."""
    try:
        from probe.injector.target import read_target

        info = read_target(pid)
    except OSError:
        return None, ""
    if not info.exe or info.version is None:
        return None, info.exe
    exe = info.exe[:-len(" (deleted)")] if info.exe.endswith(" (deleted)") else info.exe
    dirs = [d for d in _site_dirs(pid, exe, info.version) if os.path.isdir(d)]
    if not dirs:
        return None, exe
    return any(os.path.exists(os.path.join(d, "probe_autostart.pth")) for d in dirs), exe


def forked_from(pid: int) -> Optional[int]:
    """The parent ``pid`` was forked from without an exec (the same executable and command line: a DataLoader
    worker, a multiprocessing fork) where that parent runs an agent; else None. An agent does not follow a
    fork, and the child never started an interpreter of its own, so ``PROBE=1`` in its environment (its
    parent's) says nothing of how probe is installed."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as handle:
            stat = handle.read()
        parent = int(stat[stat.rindex(b")") + 2:].split()[1])
        same_exe = os.readlink("/proc/%d/exe" % pid) == os.readlink("/proc/%d/exe" % parent)
    except (OSError, ValueError, IndexError):
        return None
    if parent <= 1 or not same_exe or _cmdline(pid) != _cmdline(parent):
        return None
    try:
        from probe.injector.target import read_target

        theirs = expected_socket_path(parent, read_target(parent).uid)
    except OSError:
        return None
    return parent if os.path.exists(theirs) else None


def install_hint(exe: str) -> str:
    """How to install this probe for interpreter ``exe``: from the source tree it runs from where it has one.
    Never the index's package named probe: that is another project (ours is ``probe.DISTRIBUTION``)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = os.path.dirname(root)
    if os.path.isfile(os.path.join(root, "pyproject.toml")):
        return "`%s -m pip install %s`" % (exe, shlex.quote(root))
    return ("`%s -m pip install %s` (the distribution's name: `probe` on the package index is another project)"
            % (exe, probe.DISTRIBUTION))


def agent_elsewhere(pid: int, ours: str) -> Optional[str]:
    """The socket of the agent in ``pid`` where the target's own environment puts it (another
    ``PROBE_RUNTIME_DIR`` or ``XDG_RUNTIME_DIR``) when it exists and is not ``ours``; else None."""
    try:
        from probe.injector.target import read_target

        uid = read_target(pid).uid
    except OSError:
        return None
    theirs = expected_socket_path(pid, uid)
    if os.path.realpath(theirs) == os.path.realpath(ours) or not os.path.exists(theirs):
        return None
    return theirs


# -- torchrun's launcher --------------------------------------------------------------------------

def _cmdline(pid: int) -> List[str]:
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as handle:
            raw = handle.read()
    except OSError:
        return []
    return [a.decode("utf-8", "replace") for a in raw.split(b"\0")[:-1]]


def launcher(pid: int) -> bool:
    """Whether ``pid`` is torchrun's launcher (``torchrun ...``, ``python -m torch.distributed.run``): the
    process that starts a job's ranks and watches them; the program runs in the ranks."""
    argv = _cmdline(pid)
    for i, arg in enumerate(argv[:4]):
        if arg == "-m" and i + 1 < len(argv):
            return argv[i + 1] in ("torch.distributed.run", "torch.distributed.launch")
        if os.path.basename(arg) == "torchrun" or arg.endswith("torch/distributed/run.py"):
            return True
    return False


def _node_helper_port(argv: List[str]) -> Optional[Tuple[str, int]]:
    """(host, PROBE_PORT) of a node helper's command line (``python -m probe.host --port P --host H``)."""
    if "probe.host" not in argv[:4] or "--port" not in argv:
        return None
    try:
        port = int(argv[argv.index("--port") + 1])
    except (IndexError, ValueError):
        return None
    host = argv[argv.index("--host") + 1] if "--host" in argv[:-1] else "127.0.0.1"
    return host, port


def launcher_advice(pid: int) -> Optional[Tuple[str, str]]:
    """(message, hint) for torchrun's launcher or a node helper: they run no agent by design, the ranks
    do; the hint is the ``ranks`` command with the job's real address when ``PROBE_PORT`` is set, else how
    to start the job so, and the ranks' pids. None for any other process."""
    helper = _node_helper_port(_cmdline(pid))
    if helper is not None:
        from probe.agent.options import binds_every_interface

        host, port = helper
        shown = "127.0.0.1" if binds_every_interface(host) else ("[%s]" % host if ":" in host else host)
        return ("process %d is the node helper of the job with PROBE_PORT=%d: it lists this node's ranks and reads "
                "from outside those that cannot answer, and gets no agent itself" % (pid, port),
                "its job's ranks: `probe %s:%d ranks`; on all of them at once: `probe %s:%d --all-ranks backtrace`"
                % (shown, port, shown, port))
    if not launcher(pid):
        return None
    env = target_environ(pid)
    message = ("process %d is torchrun's launcher: it starts and watches the job's ranks, which run the program, "
               "and gets no agent itself" % pid)
    if env.get("PROBE_PORT"):
        from probe.agent.options import binds_every_interface, probe_port_binding

        try:
            host, port = probe_port_binding(env)
        except ValueError:
            host, port = "", 0
        if port:
            shown = "127.0.0.1" if binds_every_interface(host) else ("[%s]" % host if ":" in host else host)
            address = "%s:%d" % (shown, port)
            again = command_line(pid, "backtrace", target=address).replace(
                "probe %s " % address, "probe %s --all-ranks " % address, 1)
            return message, "its ranks: `probe %s ranks`; on all of them at once: `%s`" % (address, again)
    ranks = ", ".join(str(c) for c in proc.children(pid)[:8])
    return message, ("start the job as `PROBE=1 PROBE_PORT=PORT torchrun ...` to reach every rank through "
                     "`probe HOST:PORT ranks`; or give a rank's pid%s" % (" (its children: %s)" % ranks if ranks else ""))


# -- a GIL kept in C ------------------------------------------------------------------------------

def _thread_state(pid: int, tid: int) -> Tuple[Optional[str], Optional[int]]:
    """(state letter, voluntary context switches) of thread ``tid``."""
    letter = switches = None
    try:
        with open("/proc/%d/task/%d/status" % (pid, tid)) as handle:
            for line in handle:
                if line.startswith("State:"):
                    letter = line.split()[1]
                elif line.startswith("voluntary_ctxt_switches:"):
                    switches = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return letter, switches


def gil_kept_in_c(pid: int, stacks: Any) -> Any:
    """The thread (``ThreadStack``) that keeps the GIL inside a C call, when that is certain: it holds
    the GIL while asleep or in I/O (no Python code can), and is still asleep in the same wait, holding it,
    ``_HELD_CONFIRM_S`` later. None otherwise (a holder that runs may be in C or in Python code: only
    the native frames would tell, and reading those stops the process)."""
    holder = stacks.gil_holder() if stacks is not None else None
    if holder is None or holder.native_id is None:
        return None
    letter, switches = _thread_state(pid, holder.native_id)
    if letter not in ("S", "D"):
        return None
    time.sleep(_HELD_CONFIRM_S)
    from probe.errors import ReaderError
    from probe.reader import live

    try:
        again = live.read_live(pid, stop=False)  # a stop would count as a voluntary switch of the holder
    except ReaderError:
        return None
    still = again.gil_holder()
    letter_after, switches_after = _thread_state(pid, holder.native_id)
    if still is None or still.native_id != holder.native_id or letter_after not in ("S", "D") or switches_after != switches:
        return None
    return holder
