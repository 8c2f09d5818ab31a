"""Who a process is in a distributed job, from what its launcher put in its environment. Stdlib only.

Used by the agent (``/v1/health``, the port a rank serves on) and by the host helper (the ranks it finds
in ``/proc``). One family of variables answers, the first of these that names a rank or a local rank:

1. ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``GROUP_RANK`` (else ``NODE_RANK``): torchrun, and what
   accelerate, DeepSpeed and Lightning set for the ranks they start ("torchrun").
2. ``OMPI_COMM_WORLD_RANK``/``_LOCAL_RANK``/``_SIZE``: Open MPI's mpirun ("mpi").
3. ``MV2_COMM_WORLD_RANK``/``_LOCAL_RANK``/``_SIZE``: MVAPICH ("mpi").
4. ``PMI_RANK``/``PMI_SIZE`` (local rank ``MPI_LOCALRANKID``): MPICH's and Intel MPI's launchers ("mpi").
5. ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NTASKS``/``SLURM_NODEID``: srun ("slurm").

The program's own variables come first (torchrun inside an srun step: ``SLURM_PROCID`` numbers the
nodes' launchers, ``RANK`` the ranks); MPI before Slurm because mpirun run inside a Slurm allocation
leaves the allocation's ``SLURM_*`` in every rank's environment. Open MPI's
``OMPI_COMM_WORLD_NODE_RANK`` is not a node number (it counts processes of every job on the node), so
MPI gives no node.

A child started by multiprocessing (``--multiprocessing-fork``: ``torch.multiprocessing.spawn``'s
ranks, a DataLoader worker under spawn) inherits its parent's variables, which name the parent: it has
no rank from the environment, only from ``torch.distributed`` once it initialises it.
"""

import os
import sys
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence

__all__ = ["Rank", "from_environ", "mp_role", "current"]


class Rank(NamedTuple):
    rank: Optional[int]
    local_rank: Optional[int]
    world_size: Optional[int]
    node: Optional[int]
    source: Optional[str]
    """"torchrun", "mpi", "slurm", "torch.distributed", or None when nothing names a rank."""


NONE = Rank(None, None, None, None, None)

# (source, rank, local rank, world size, node variables in order)
_FAMILIES = (
    ("torchrun", "RANK", "LOCAL_RANK", "WORLD_SIZE", ("GROUP_RANK", "NODE_RANK")),
    ("mpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", ()),
    ("mpi", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_SIZE", ()),
    ("mpi", "PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE", ()),
    ("slurm", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", ("SLURM_NODEID",)),
)

NAMES = tuple(sorted({n for f in _FAMILIES for n in (f[1], f[2], f[3], *f[4])}))
"""Every variable read here (the host helper reads only these from another process's environment)."""


def _int(env: Mapping[str, str], name: str) -> Optional[int]:
    try:
        value = int(env.get(name, "") or "")
    except ValueError:
        return None
    return value if 0 <= value < 1 << 31 else None


def from_environ(env: Mapping[str, str]) -> Rank:
    """The rank ``env`` names, by the first family above that gives a rank or a local rank."""
    for source, rank, local, world, nodes in _FAMILIES:
        r, lr = _int(env, rank), _int(env, local)
        if r is None and lr is None:
            continue
        node = next((n for n in (_int(env, name) for name in nodes) if n is not None), None)
        return Rank(r, lr, _int(env, world), node, source)
    return NONE


def mp_role(argv: Optional[Sequence[str]] = None) -> Optional[str]:
    """What multiprocessing started this interpreter as: "child" (spawn's ``--multiprocessing-fork``),
    "helper" (its resource tracker or fork server, never a rank), or None (a program of its own)."""
    args: List[str] = list(argv if argv is not None else _argv())
    if "--multiprocessing-fork" in args:
        return "child"
    for i, arg in enumerate(args[:-1]):
        if arg == "-c":
            code = args[i + 1]
            if "multiprocessing.resource_tracker" in code or "multiprocessing.forkserver" in code \
                    or "multiprocessing.semaphore_tracker" in code:
                return "helper"
            return "child" if "multiprocessing.spawn" in code else None
    return None


def _argv() -> List[str]:
    orig = getattr(sys, "orig_argv", None)
    if orig:
        return list(orig)
    try:
        with open("/proc/self/cmdline", "rb") as handle:
            return [a.decode("utf-8", "surrogateescape") for a in handle.read().split(b"\0")[:-1]]
    except OSError:
        return list(getattr(sys, "argv", None) or [])


_LAUNCHERS = ("accelerate", "accelerate-launch", "deepspeed", "torchrun")
_LAUNCHER_MODULES = ("accelerate.commands.launch", "accelerate.commands.accelerate_cli", "deepspeed.launcher.runner",
                     "deepspeed.launcher.launch", "torch.distributed.run", "torch.distributed.launch")


def is_launcher(argv: Optional[Sequence[str]] = None) -> bool:
    """Whether this interpreter runs a launcher that starts the ranks (``accelerate launch``, ``deepspeed``,
    torchrun): under srun it has Slurm's variables of its own (one task a node), which name no rank."""
    args: List[str] = list(argv if argv is not None else _argv())
    for i, arg in enumerate(args[:3]):
        if i > 0 and os.path.basename(arg) in _LAUNCHERS:
            return True  # python /path/to/bin/accelerate launch ...
        if arg == "-m" and i + 1 < len(args):
            return args[i + 1] in _LAUNCHER_MODULES
    return bool(args) and os.path.basename(args[0]) in _LAUNCHERS


def at_start(env: Optional[Mapping[str, str]] = None, argv: Optional[Sequence[str]] = None) -> Rank:
    """The rank this process is known by from its start: none in a multiprocessing child or helper, nor in
    a launcher."""
    if mp_role(argv) is not None or is_launcher(argv):
        return NONE
    return from_environ(os.environ if env is None else env)


def current() -> Rank:
    """This process's rank now: from ``torch.distributed`` where the program initialised its default
    process group (read only if torch is imported already; never imports it, never a collective), else
    from the environment. Where both agree the launcher stays the source."""
    start = at_start()
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return start
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return start
        rank, world = int(dist.get_rank()), int(dist.get_world_size())
    except Exception:
        return start
    if rank < 0:  # not a member of the default group
        return start
    if (start.rank, start.world_size) == (rank, world):
        return start
    return Rank(rank, start.local_rank if start.source else None, world, start.node if start.source else None,
                "torch.distributed")


def as_fields(rank: Rank) -> Dict[str, object]:
    return {"rank": rank.rank, "local_rank": rank.local_rank, "world_size": rank.world_size,
            "node": rank.node, "rank_source": rank.source}
