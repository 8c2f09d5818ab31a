"""``torch.distributed``: whether the process group is initialised, this rank's place in the job, and
one row per process group. Reads only local state: no collective, no store access."""

import os
import sys
from typing import Any, Iterator, List, Optional, Tuple

from probe.tables.spec import Column
from probe.tables.torch._common import torch_or_raise

__all__ = ["NAME", "DESCRIPTION", "COLUMNS", "EXAMPLE", "rows"]

NAME = "torch.distributed"
DESCRIPTION = ("torch.distributed as this rank sees it: initialised or not, backend, rank, world size, local "
               "rank, and one row per process group (one row with initialized = false when there is none).")
COLUMNS = (
    Column("initialized", "BOOLEAN", "Whether init_process_group has run (and the group is not destroyed)."),
    Column("backend", "VARCHAR", "The group's backend: nccl, gloo, ... (NULL when not initialised)."),
    Column("rank", "BIGINT", "This process's global rank (from the default group; else $RANK)."),
    Column("world_size", "BIGINT", "Number of ranks of the job (from the default group; else $WORLD_SIZE)."),
    Column("local_rank", "BIGINT", "This process's rank on its host ($LOCAL_RANK)."),
    Column("group_name", "VARCHAR", "The process group's name (as in torch.flight_recorder's pg)."),
    Column("group_desc", "VARCHAR", "Its description where set (default_pg, a mesh dimension ...)."),
    Column("is_default", "BOOLEAN", "Whether it is the default (world) group."),
    Column("group_rank", "BIGINT", "This process's rank within the group."),
    Column("group_size", "BIGINT", "Number of ranks in the group."),
    Column("group_ranks", "VARCHAR", "The global ranks of the group, e.g. [0, 1]."),
)
EXAMPLE = "SELECT backend, rank, world_size, group_name, group_size FROM torch.distributed"


def rows() -> Iterator[Tuple[Any, ...]]:
    torch_or_raise()
    dist: Any = sys.modules.get("torch.distributed")
    local_rank = _env_int("LOCAL_RANK")
    initialized = bool(dist is not None and dist.is_available() and dist.is_initialized())
    if not initialized:
        yield (False, None, _env_int("RANK"), _env_int("WORLD_SIZE"), local_rank, None, None, None, None, None, None)
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    default = dist.group.WORLD
    for group in _groups(dist):
        yield (True, _backend(dist, group), rank, world, local_rank, _group_name(dist, group),
               getattr(group, "group_desc", None), group is default, _call(group, "rank"), _call(group, "size"),
               _ranks(dist, group))


def _groups(dist: Any) -> List[Any]:
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", {}) or {}) if world is not None else []
    default = dist.group.WORLD
    if default is not None and default not in groups:
        groups.insert(0, default)
    return groups


def _backend(dist: Any, group: Any) -> Optional[str]:
    try:
        return str(dist.get_backend(group))
    except Exception:
        return None


def _group_name(dist: Any, group: Any) -> Optional[str]:
    try:
        return str(group.group_name)
    except Exception:
        names = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_names", {})
        name = names.get(group) if hasattr(names, "get") else None
        return None if name is None else str(name)


def _ranks(dist: Any, group: Any) -> Optional[str]:
    try:
        return "[%s]" % ", ".join(str(r) for r in dist.get_process_group_ranks(group))
    except Exception:
        return None


def _call(group: Any, method: str) -> Optional[int]:
    try:
        return int(getattr(group, method)())
    except Exception:
        return None


def _env_int(name: str) -> Optional[int]:
    try:
        return int(os.environ.get(name, ""))
    except ValueError:
        return None
