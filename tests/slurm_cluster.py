"""A one-node Slurm of the test's own, in its temp dir: munged with its own key and socket, slurmctld and
slurmd in the foreground, no accounting, no cgroups (proctrack/linuxproc, task/none), the node named after
this host at 127.0.0.1 with 4 CPUs whatever the machine has (config_overrides; oversubscribed).

    with slurm_cluster(tmp_path) as slurm:            # or the `slurm` fixture of a test module
        job = subprocess.Popen(["srun", "-N1", "-n2", ...], env=slurm.env(PROBE="1"))
        slurm.run("squeue", "-h", "-o", "%i")

The daemons run under a keeper: this file run as a script (``python slurm_cluster.py DIR``). It makes
itself the child subreaper, so that every process Slurm starts and lets go (slurmstepd is reparented as
soon as slurmd has forked it, and so are a job's tasks once their slurmstepd is killed) is reparented to
it and reaped by it, not left to the container's init. It prints ``UP`` once ``scontrol ping`` and
``sinfo`` say the node is idle, or ``SKIP <why>`` (the line of the daemon that failed); on SIGTERM, or
when its parent dies, it cancels every job, stops the daemons, kills whatever is left below it and
reaps it all before it exits.
"""

import ctypes
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from procs import scaled  # noqa: E402

from probe.reader.proc import children  # noqa: E402

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "scontrol", "squeue", "sinfo", "scancel")
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


class SlurmUnavailable(Exception):
    """Slurm cannot run here; the message says why (a daemon's own line where one failed)."""


def _which(name: str) -> Optional[str]:
    return shutil.which(name) or next((p for p in ("/usr/sbin/" + name, "/sbin/" + name) if os.path.exists(p)), None)


def missing() -> List[str]:
    """The daemons and commands of Slurm and munge that are not installed here."""
    return [name for name in DAEMONS + CLIENTS if _which(name) is None]


class SlurmCluster:
    """A running one-node Slurm: its directory, config, and the environment its commands need."""

    def __init__(self, directory: str, node: str, nodes: int = 1) -> None:
        self.directory = directory
        self.conf = os.path.join(directory, "slurm.conf")
        self.node = node  # this host's name
        self.nodes = node_names(node, nodes)  # Slurm's names of its nodes; node i at 127.0.0.i

    def env(self, base: Optional[Dict[str, str]] = None, **extra: str) -> Dict[str, str]:
        """``base`` (else this process's environment) with SLURM_CONF naming this cluster's config."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = self.conf
        env.update(extra)
        return env

    def run(self, *args: str, timeout: float = 20.0) -> "subprocess.CompletedProcess[str]":
        """A Slurm command against this cluster (bounded), its output captured."""
        return subprocess.run(list(args), capture_output=True, text=True, env=self.env(), timeout=scaled(timeout))

    def running_jobs(self) -> List[str]:
        done = self.run("squeue", "-h", "-t", "RUNNING", "-o", "%i")
        return done.stdout.split()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _short_dir(directory: str) -> str:
    """``directory``, or a shorter one of our own where a socket path in it would pass the 108 bytes a unix
    socket's name may have."""
    if len(os.path.join(directory, "munge", "munge.socket")) < 100:
        return directory
    return tempfile.mkdtemp(prefix="slurm-")


def node_names(node: str, nodes: int) -> List[str]:
    """The Slurm names of the nodes: this host's name for one node; ``n1``, ``n2``, ... for several."""
    return [node] if nodes == 1 else ["n%d" % (i + 1) for i in range(nodes)]


def write_config(directory: str, node: str, nodes: int = 1) -> str:
    """The munge key and slurm.conf of a cluster in ``directory``; returns the config's path. Several
    nodes are several slurmd on this host, node i at 127.0.0.i with a port of its own (Debian's slurmd
    is built with multiple-slurmd support)."""
    for sub in ("munge", "state", "spool", "log"):
        os.makedirs(os.path.join(directory, sub), exist_ok=True)
    os.chmod(os.path.join(directory, "munge"), 0o700)
    key = os.path.join(directory, "munge", "munge.key")
    with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as handle:
        handle.write(os.urandom(1024))
    user = "root" if os.getuid() == 0 else os.environ.get("USER") or str(os.getuid())
    lines = [
        "ClusterName=probetest",
        "SlurmctldHost=%s(127.0.0.1)" % node,
        "SlurmctldPort=%d" % _free_port(),
        "SlurmdPort=%d" % _free_port(),  # nodes of their own port override it
        "SlurmUser=%s" % user,
        "SlurmdUser=%s" % user,
        "AuthType=auth/munge",
        "CredType=cred/munge",
        "AuthInfo=socket=%s" % os.path.join(directory, "munge", "munge.socket"),
        "StateSaveLocation=%s" % os.path.join(directory, "state"),
        "SlurmdSpoolDir=%s" % os.path.join(directory, "spool", "%n"),
        "SlurmctldPidFile=%s" % os.path.join(directory, "slurmctld.pid"),
        "SlurmdPidFile=%s" % os.path.join(directory, "slurmd-%n.pid"),
        "SlurmctldLogFile=%s" % os.path.join(directory, "log", "slurmctld.log"),
        "SlurmdLogFile=%s" % os.path.join(directory, "log", "slurmd-%n.log"),
        "ProctrackType=proctrack/linuxproc",  # no cgroups in a container
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/builtin",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "ReturnToService=2",
        "SlurmdParameters=config_overrides",  # 4 CPUs on a smaller machine
        "SlurmctldTimeout=30",
        "SlurmdTimeout=30",
        "KillWait=2",
    ]
    for i, name in enumerate(node_names(node, nodes)):
        lines.append("NodeName=%s NodeHostname=%s NodeAddr=127.0.0.%d%s CPUs=4 Sockets=1 CoresPerSocket=4 "
                     "ThreadsPerCore=1 State=UNKNOWN" % (name, node, i + 1, "" if nodes == 1 else " Port=%d" % _free_port()))
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE")
    conf = os.path.join(directory, "slurm.conf")
    with open(conf, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    return conf


@contextmanager
def slurm_cluster(directory: str, timeout: float = 30.0, nodes: int = 1) -> Iterator[SlurmCluster]:
    """A one-node Slurm in ``directory`` for a ``with`` block (``nodes``: that many slurmd on this host);
    :class:`SlurmUnavailable` where it cannot start. Everything it started is stopped and reaped at the end."""
    absent = missing()
    if absent:
        raise SlurmUnavailable("%s not installed (tests/run.sh installs Debian's slurm-wlm and munge as root)"
                               % ", ".join(absent))
    directory = _short_dir(str(directory))
    node = socket.gethostname().split(".")[0]
    keeper = subprocess.Popen([sys.executable, os.path.abspath(__file__), directory, node, str(timeout), str(nodes)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        said = _keeper_line(keeper, scaled(timeout) + 30)
        if not said.startswith("UP"):
            raise SlurmUnavailable(said.partition(" ")[2] or said or "the keeper exited (%s)" % keeper.returncode)
        yield SlurmCluster(directory, node, nodes)
    finally:
        _stop_keeper(keeper)


def _keeper_line(keeper: "subprocess.Popen[bytes]", timeout: float) -> str:
    assert keeper.stdout is not None
    fd, seen, deadline = keeper.stdout.fileno(), b"", time.monotonic() + timeout
    while b"\n" not in seen:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return "SKIP the one-node Slurm said nothing within %.0f s" % timeout
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            seen += chunk
    return seen.partition(b"\n")[0].decode("utf-8", "replace").strip()


def _stop_keeper(keeper: "subprocess.Popen[bytes]") -> None:
    if keeper.poll() is None:
        keeper.send_signal(signal.SIGTERM)
        try:
            keeper.wait(scaled(40))
        except subprocess.TimeoutExpired:
            keeper.kill()
            keeper.wait(10)
    if keeper.stdout is not None:
        keeper.stdout.close()


# -- the keeper: a process of its own, the daemons' parent ------------------------------------------


class _Keeper:
    def __init__(self, directory: str, node: str, timeout: float, nodes: int = 1) -> None:
        self.directory = directory
        self.node = node
        self.nodes = node_names(node, nodes)
        self.timeout = timeout
        self.conf = write_config(directory, node, nodes)
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        self.daemons: Dict[str, "subprocess.Popen[bytes]"] = {}
        self.stopping = False

    def path(self, *parts: str) -> str:
        return os.path.join(self.directory, *parts)

    def start(self, name: str, args: List[str]) -> None:
        out = open(self.path("log", name + ".out"), "wb")
        program = name.partition("-")[0]  # slurmd-n2: a slurmd
        self.daemons[name] = subprocess.Popen([_which(program) or program] + args, stdout=out, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, env=self.env)
        out.close()

    def failed(self) -> Optional[str]:
        """Why the cluster is not coming up, from the first daemon that exited: its last error line."""
        for name, popen in self.daemons.items():
            if popen.poll() is not None:
                return "%s exited (code %s): %s" % (name, popen.returncode, self.error_line(name))
        return None

    def error_line(self, name: str) -> str:
        lines: List[str] = []
        log = "slurmd-%s" % self.nodes[0] if name == "slurmd" else name  # SlurmdLogFile names the node
        for path in (self.path("log", name + ".out"), self.path("log", log + ".log")):
            try:
                with open(path, errors="replace") as handle:
                    lines += [line.strip() for line in handle if line.strip()]
            except OSError:
                pass
        errors = [line for line in lines if "error" in line.lower() and "pmix" not in line.lower()]
        return (errors or lines or ["(no output)"])[-1][:300]

    def command(self, *args: str) -> str:
        try:
            done = subprocess.run(list(args), capture_output=True, text=True, env=self.env, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return done.stdout

    def up(self) -> Optional[str]:
        """None once the node is idle; else why not (the first daemon that exited, or the time up)."""
        munge_socket = self.path("munge", "munge.socket")
        self.start("munged", ["-F", "--force", "--socket=" + munge_socket, "--key-file=" + self.path("munge", "munge.key"),
                              "--pid-file=" + self.path("munge", "munged.pid"), "--seed-file=" + self.path("munge", "seed"),
                              "--log-file=" + self.path("log", "munged.log")])
        deadline = time.monotonic() + scaled(self.timeout)
        while not os.path.exists(munge_socket):
            if self.failed() or time.monotonic() > deadline:
                return self.failed() or "munged made no socket: %s" % self.error_line("munged")
            time.sleep(0.05)
        self.start("slurmctld", ["-D", "-f", self.conf])
        for name in self.nodes:
            self.start("slurmd" if len(self.nodes) == 1 else "slurmd-" + name, ["-D", "-f", self.conf, "-N", name])
        while time.monotonic() < deadline:
            failed = self.failed()
            if failed:
                return failed
            states = self.command("sinfo", "-h", "-N", "-o", "%t").split()
            if "UP" in self.command("scontrol", "ping") and states == ["idle"] * len(self.nodes):
                return None
            time.sleep(0.2)
        state = self.command("sinfo", "-h", "-o", "%t %E").strip()
        return "the node was not idle within %.0f s (sinfo: %s; slurmd: %s)" % (
            scaled(self.timeout), state or "no answer", self.error_line(next(n for n in self.daemons if n.startswith("slurmd"))))

    def reap(self) -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    def stop(self) -> None:
        """Cancel every job, stop the daemons, kill what is left below (reparented here) and reap it all."""
        if self.daemons.get("slurmctld") and self.daemons["slurmctld"].poll() is None:
            jobs = self.command("squeue", "-h", "-o", "%i").split()
            if jobs:
                self.command("scancel", *jobs)
                deadline = time.monotonic() + 10
                while self.command("squeue", "-h", "-o", "%i").split() and time.monotonic() < deadline:
                    self.reap()
                    time.sleep(0.2)
        for name in [n for n in self.daemons if n.startswith("slurmd")] + ["slurmctld", "munged"]:
            popen = self.daemons.get(name)
            if popen is not None and popen.poll() is None:
                popen.terminate()
                try:
                    popen.wait(10)
                except subprocess.TimeoutExpired:
                    popen.kill()
                    popen.wait(5)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            left = children(os.getpid())
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
            self.reap()
        self.reap()


def _keep(directory: str, node: str, timeout: float, nodes: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    keeper = _Keeper(directory, node, timeout, nodes)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    signal.signal(signal.SIGINT, lambda *_: stop.append(True))
    if os.getppid() == 1:  # the test is gone already
        return 0
    try:
        why = keeper.up()
        sys.stdout.write("SKIP %s\n" % why if why else "UP\n")
        sys.stdout.flush()
        while why is None and not stop:
            keeper.reap()
            if keeper.failed():
                break
            time.sleep(0.2)
    finally:
        keeper.stop()
    return 0


if __name__ == "__main__":
    sys.exit(_keep(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])))
