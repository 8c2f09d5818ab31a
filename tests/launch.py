"""Real jobs under every launcher but torchrun, on the CPU with gloo (issue 18): accelerate, DeepSpeed,
Lightning (``ddp`` and ``ddp_spawn``), ``torch.multiprocessing.spawn``, Open MPI's ``mpirun`` and Slurm's
``srun`` (on a one-node Slurm of the test's own).

Each context manager starts a job of ``tests/targets/launchers/ranks.py`` under ``PROBE=1 PROBE_PORT=<free
port>`` and the test's extra environment (``GIL_RANK``, ``HANG_RANK``, ...), and yields a :class:`Job` once
every rank printed ``READY <pid> <rank> <local_rank>`` and has its agent's socket; the rank named by GIL_RANK
takes its GIL once the test calls :meth:`Job.go_ahead` (``GO_FILE``). At the end every process of
the job is killed, whatever session it put itself in and whoever its parent is now: each carries a variable
naming the job (``LAUNCH_TEST_JOB``), found in ``/proc/PID/environ``; the launcher is reaped.
"""

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple

from procs import TARGETS, Proc, scaled, target_env, wait_for_socket

if TYPE_CHECKING:
    from slurm_cluster import SlurmCluster

RANKS = os.path.join(TARGETS, "launchers", "ranks.py")
BIN = os.path.dirname(sys.executable)


def tool(name: str) -> str:
    """The launcher ``name`` of this Python's environment, or on PATH ("" when there is none)."""
    here = os.path.join(BIN, name)
    return here if os.path.exists(here) else (shutil.which(name) or "")


def free_ports(count: int, host: str = "127.0.0.1") -> int:
    """A port p such that p - 1 .. p + count - 1 were free a moment ago: the node helper takes p - 1 and
    the rank of local rank r p + r."""
    for _ in range(100):
        with socket.socket() as sock:
            sock.bind((host, 0))
            base = sock.getsockname()[1]
        if base < 2000 or base + count > 65000:
            continue
        taken: List[socket.socket] = []
        try:
            for port in range(base - 1, base + count):
                sock = socket.socket()
                taken.append(sock)
                sock.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for sock in taken:
                sock.close()
    raise RuntimeError("no run of %d free ports" % count)


@dataclass
class Job:
    """A running job: PROBE_PORT, the job's address for the client, and rank -> pid from the READY lines."""

    port: int
    ranks: Dict[int, int]
    launchers: List[subprocess.Popen] = field(default_factory=list)
    go_file: str = ""
    slurm_job: str = ""  # the job's Slurm id, under srun

    def go_ahead(self) -> None:
        """Let the rank named by GIL_RANK take its GIL (it waits for ``go_file``)."""
        with open(self.go_file, "w"):
            pass

    @property
    def address(self) -> str:
        return "127.0.0.1:%d" % self.port


def _tagged(tag: str) -> List[int]:
    """Every live process whose environment at start named job ``tag``."""
    needle = ("LAUNCH_TEST_JOB=%s" % tag).encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open("/proc/%s/environ" % name, "rb") as handle:
                if needle in handle.read().split(b"\0"):
                    found.append(int(name))
        except OSError:
            pass
    return found


def _end(tag: str, launchers: Sequence[subprocess.Popen]) -> None:
    """SIGKILL every process of the job (again, until none is left: a launcher may start one as it goes),
    then reap the launchers."""
    deadline = time.monotonic() + scaled(20)
    while time.monotonic() < deadline:
        pids = _tagged(tag)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    for launcher in launchers:
        try:
            launcher.wait(scaled(10))
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait(10)
        if launcher.stdout:
            launcher.stdout.close()


def _said(errors: str) -> str:
    try:
        with open(errors, "rb") as handle:
            return handle.read()[-3000:].decode("utf-8", "replace")
    except OSError:
        return ""


def _ready(output: Proc, count: int, deadline: float, errors: str) -> Dict[int, int]:
    """rank -> pid from the next ``count`` READY lines of the launcher's output, read until ``deadline``."""
    ranks: Dict[int, int] = {}
    while len(ranks) < count:
        try:
            line = output.read_line(max(deadline - time.monotonic(), 0.1) / scaled(1))
        except (TimeoutError, RuntimeError) as exc:
            raise AssertionError("%s: the ranks did not start: %s\nstdout: %r\nstderr: %s"
                                 % (output.script, exc, output.lines[-20:], _said(errors))) from None
        if line.startswith("READY "):
            words = line.split()
            ranks[int(words[2])] = int(words[1])
        else:
            output.lines.append(line)
    return ranks


class _Launch:
    """Starts launchers of one job (one per node) with a shared tag, and ends them all."""

    def __init__(self, stack: ExitStack) -> None:
        self.tag = uuid.uuid4().hex
        self.launchers: List[subprocess.Popen] = []
        self.workdir = tempfile.mkdtemp(prefix="probe-launch-")
        self.go_file = os.path.join(self.workdir, "go")
        stack.callback(shutil.rmtree, self.workdir, True)
        stack.callback(lambda: _end(self.tag, self.launchers))

    def start(self, name: str, argv: Sequence[str], env: Dict[str, str]) -> Tuple[Proc, str]:
        env = dict(env, LAUNCH_TEST_JOB=self.tag)
        env.setdefault("GO_FILE", self.go_file)  # GO_FILE="": the GIL rank takes its GIL at once
        errors = os.path.join(self.workdir, "stderr-%d" % len(self.launchers))
        with open(errors, "wb") as err:
            popen = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                                     env=env, cwd=self.workdir, start_new_session=True)
        self.launchers.append(popen)
        return Proc(popen, name), errors


def job_env(port: int, **extra: str) -> Dict[str, str]:
    """The environment of a job's launcher: an agent in every Python process of the job (PROBE=1), the job's
    PROBE_PORT, and a node helper that leaves 3 s after the last rank (not 30)."""
    env = target_env(probe=True, PROBE_PORT=str(port), PROBE_HELPER_LINGER_S="3")
    env.update(extra)
    return env


@contextmanager
def _job(name: str, argv: Sequence[str], count: int, timeout: float, env: Dict[str, str]) -> Iterator[Job]:
    """The job started, its ranks ready; started once more where the first one's rendezvous found its port
    taken (EADDRINUSE: a port free a moment ago may be any connection's by then, on a busy machine)."""
    for attempt in (1, 2):
        port = free_ports(count)
        with ExitStack() as stack:
            launch = _Launch(stack)
            output, errors = launch.start(name, argv, job_env(port, **env))
            try:
                ranks = _ready(output, count, time.monotonic() + scaled(timeout), errors)
            except AssertionError as exc:
                if attempt == 1 and ("EADDRINUSE" in str(exc) or "address already in use" in str(exc)):
                    continue  # this launch is stopped and reaped as the stack closes
                raise
            for pid in ranks.values():
                wait_for_socket(pid, 30)
            yield Job(port, ranks, launch.launchers, launch.go_file)
            return


def accelerate_job(count: int = 2, timeout: float = 60, **env: str) -> ContextManager[Job]:
    """``accelerate launch --multi_gpu --num_processes COUNT ranks.py accelerate`` on the CPU: accelerate runs
    torch's elastic agent in its own process, which starts the ranks with torchrun's variables; each
    rank's ``Accelerator(cpu=True)`` sets up gloo. The agent looks at its ranks once a minute, so a killed
    rank does not end the job at once."""
    argv = [tool("accelerate"), "launch", "--multi_gpu", "--num_processes", str(count), "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_ports(1)),
            "--monitor_interval", "60", RANKS, "accelerate"]
    return _job("accelerate launch", argv, count, timeout, env)


def deepspeed_job(count: int = 2, timeout: float = 60, **env: str) -> ContextManager[Job]:
    """``deepspeed --num_gpus COUNT ranks.py env`` on the CPU (DeepSpeed picks its CPU accelerator by itself):
    its runner starts ``python -m deepspeed.launcher.launch``, which starts the ranks with torchrun's
    variables and ``--local_rank=N``; each rank's torch.distributed sets up gloo from them."""
    argv = [tool("deepspeed"), "--num_gpus", str(count), "--master_port", str(free_ports(1)), RANKS, "env"]
    return _job("deepspeed", argv, count, timeout, env)


def lightning_job(strategy: str, count: int = 2, timeout: float = 60, **env: str) -> ContextManager[Job]:
    """``python ranks.py lightning-ddp COUNT``: ``Trainer(accelerator="cpu", devices=COUNT, strategy="ddp")``,
    this process rank 0 starting the others as ``python ranks.py ...`` again; or ``lightning-spawn``
    (``strategy="ddp_spawn"``: this process only waits for the ranks it spawned)."""
    mode = {"ddp": "lightning-ddp", "ddp_spawn": "lightning-spawn"}[strategy]
    return _job("lightning " + strategy, [sys.executable, RANKS, mode, str(count)], count, timeout, env)


def mp_spawn_job(count: int = 2, timeout: float = 60, **env: str) -> ContextManager[Job]:
    """``python ranks.py mp-spawn COUNT``: ``torch.multiprocessing.spawn(..., nprocs=COUNT, join=True)``."""
    env = dict(env, JOB_MASTER_PORT=str(free_ports(1)))
    return _job("mp.spawn", [sys.executable, RANKS, "mp-spawn", str(count)], count, timeout, env)


def mpirun_job(count: int = 4, timeout: float = 60, **env: str) -> ContextManager[Job]:
    """``mpirun -np COUNT python ranks.py mpi`` with Open MPI as root (its flags for that), more ranks than
    cores, no binding (JOB_MASTER_PORT: where the ranks set up gloo when they train)."""
    argv = [tool("mpirun"), "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(count),
            sys.executable, RANKS, "mpi"]
    return _job("mpirun", argv, count, timeout, dict(env, JOB_MASTER_PORT=str(free_ports(1))))


@contextmanager
def srun_job(slurm: "SlurmCluster", count: int = 2, timeout: float = 60, **env: str) -> Iterator[Job]:
    """``srun -N1 -n COUNT python ranks.py slurm`` on the one-node Slurm ``slurm`` (tests/slurm_cluster.py);
    at the end its job is cancelled by name before its processes are killed."""
    port, name = free_ports(count), "probe-launch-%s" % uuid.uuid4().hex[:8]
    argv = [tool("srun"), "-N1", "-n", str(count), "--export=ALL", "--job-name=" + name, sys.executable, RANKS,
            "slurm"]
    with ExitStack() as stack:
        launch = _Launch(stack)
        stack.callback(slurm.run, "scancel", "--name=" + name)
        output, errors = launch.start("srun", argv, slurm.env(job_env(port, JOB_MASTER_PORT=str(free_ports(1)),
                                                                       **env)))
        ranks = _ready(output, count, time.monotonic() + scaled(timeout), errors)
        for pid in ranks.values():
            wait_for_socket(pid, 30)
        ids = slurm.run("squeue", "-h", "--name=" + name, "-o", "%i").stdout.split()
        yield Job(port, ranks, launch.launchers, launch.go_file, ids[0] if ids else "")


@contextmanager
def accelerate_two_nodes(token: str, per_node: int = 2, timeout: float = 90,
                         **env: str) -> Iterator[Job]:
    """Two ``accelerate launch --num_machines 2 --machine_rank 0|1`` of one job, as two hosts would run them:
    each node its own address (PROBE_HOST 127.0.0.1 / 127.0.0.2) and its own runtime directory (nothing
    shared through files), the same PROBE_PORT and PROBE_TOKEN. Ranks 0..per_node-1 are node 0's."""
    port, main_port = free_ports(per_node), free_ports(1)
    with ExitStack() as stack:
        launch = _Launch(stack)
        started = []
        for node in (0, 1):
            runtime = os.path.join(launch.workdir, "node%d" % node)
            os.mkdir(runtime, 0o700)
            argv = [tool("accelerate"), "launch", "--multi_gpu", "--num_processes", str(2 * per_node),
                    "--num_machines", "2", "--machine_rank", str(node), "--main_process_ip", "127.0.0.1",
                    "--main_process_port", str(main_port), "--mixed_precision", "no", "--dynamo_backend", "no",
                    "--monitor_interval", "60", RANKS, "accelerate"]
            node_env = job_env(port, PROBE_HOST="127.0.0.%d" % (node + 1), PROBE_RUNTIME_DIR=runtime,
                               PROBE_TOKEN=token, **env)
            started.append(launch.start("accelerate launch node %d" % node, argv, node_env))
        ranks: Dict[int, int] = {}
        deadline = time.monotonic() + scaled(timeout)
        for output, errors in started:
            ranks.update(_ready(output, per_node, deadline, errors))
        yield Job(port, ranks, launch.launchers, launch.go_file)


def installed(name: str, module: Optional[str] = None) -> str:
    """Why launcher ``name`` cannot run here ("" when it can): its command or its Python package is missing
    (looked up, not imported: DeepSpeed's import takes seconds and says things)."""
    if not tool(name):
        return "%s is not installed" % name
    if module and importlib.util.find_spec(module.split(".")[0]) is None:
        return "the Python package %s is not installed" % module.split(".")[0]
    return ""
