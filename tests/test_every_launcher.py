"""Every rank of every job (issue 18): real jobs under accelerate, DeepSpeed, Lightning (ddp and ddp_spawn),
torch.multiprocessing.spawn and Open MPI's mpirun, on the CPU with gloo, each asked through the public CLI
and nothing but the job's address (127.0.0.1:PROBE_PORT), as a user would after
``PROBE=1 PROBE_PORT=P <launcher> ...``. torchrun has its own tests (test_cluster.py), Slurm too.

One job a launcher, 4 ranks: rank 1 holds its GIL in a C call, rank 2 is stuck in ``stuck_in_rank_hang``, the
others wait in ``wait_for_work``; the last step kills a rank. And two nodes (127.0.0.1 and 127.0.0.2) under
accelerate."""

import json
import os
import re
import signal
import socket
import time
from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, List, Optional

import pytest

import launch
from procs import run_cli, scaled, target_env

GIL_RANK, HANG_RANK = 1, 2
ROLES = {"GIL_RANK": str(GIL_RANK), "HANG_RANK": str(HANG_RANK)}


def _why_not_torch() -> str:
    try:
        import torch.distributed  # noqa: F401
    except Exception as exc:
        return "torch cannot be imported: %s" % exc
    return ""


@dataclass
class Launcher:
    start: Callable[..., ContextManager[launch.Job]]
    missing: Callable[[], str]  # why it cannot run here, "" when it can
    killed: int  # the rank the last step kills
    # Whether every rank knows its local rank from the launcher's variables at start, and so serves
    # PROBE_PORT + local rank.
    fixed_ports: bool
    # The launcher ends every other rank once one dies (mp.spawn's join, DeepSpeed's and Open MPI's launchers):
    # the node helper outlives the job by its linger, in which the killed rank must still be named.
    linger: str = "3"


LAUNCHERS = {
    "accelerate": Launcher(lambda **env: launch.accelerate_job(4, **env),
                           lambda: launch.installed("accelerate", "accelerate") or _why_not_torch(), 3, True),
    "deepspeed": Launcher(lambda **env: launch.deepspeed_job(4, **env),
                          lambda: launch.installed("deepspeed", "deepspeed") or _why_not_torch(), 3, True, "20"),
    # Rank 0 is the script the user ran and watches the ranks it started (every 5 s, then kills them all):
    # killed itself, the others go on.
    "lightning-ddp": Launcher(lambda **env: launch.lightning_job("ddp", 4, **env),
                              lambda: launch.installed("python", "lightning.pytorch") or _why_not_torch(), 0, False),
    "lightning-ddp_spawn": Launcher(lambda **env: launch.lightning_job("ddp_spawn", 4, **env),
                                    lambda: launch.installed("python", "lightning.pytorch") or _why_not_torch(), 3,
                                    False, "20"),
    "mp.spawn": Launcher(lambda **env: launch.mp_spawn_job(4, **env), _why_not_torch, 3, False, "20"),
    "mpirun": Launcher(lambda **env: launch.mpirun_job(4, **env), lambda: launch.installed("mpirun"), 3, True, "20"),
}


def _until(check: Callable[[], object], timeout: float, what: str, last: Callable[[], object]) -> object:
    """Poll ``check()`` until it returns something true (bounded: ``timeout`` scaled), then return that."""
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError("%s within %.0f s; last: %r" % (what, scaled(timeout), last()))


class Client:
    """The probe command asked about one job; keeps its last answer for the failure messages."""

    def __init__(self, address: str, **env: str) -> None:
        self.address, self.env, self.last = address, target_env(probe=False, **env), None

    def __call__(self, *args: str):
        self.last = run_cli(self.address, *args, env=self.env)
        return self.last

    def members(self) -> List[Dict[str, object]]:
        listed = self("ranks", "-f", "json")
        try:
            return json.loads(listed.out) if listed.code == 0 else []
        except ValueError:
            return []


_GROUP = re.compile(r"^  (ranks? [0-9,\-]+) \((\d+)\)(.*)$")


def main_thread_groups(text: str) -> Dict[str, List[str]]:
    """The MainThread part of a grouped backtrace: the head of each group ("ranks 0,3 (2)", with its note
    where stacks were read from outside) -> the functions of its stack."""
    groups: Dict[str, List[str]] = {}
    head: Optional[str] = None
    inside = False
    for line in text.splitlines():
        if line.startswith('Thread "'):
            inside = line.startswith('Thread "MainThread"')
            continue
        if not inside:
            continue
        found = _GROUP.match(line)
        if found:
            head = line.strip()
            groups[head] = []
        elif head and line.startswith("    "):
            groups[head].append(line[6:].split(" (", 1)[0])
    return groups


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_every_rank_is_listed_a_hung_rank_stands_out_a_gil_holder_is_read_from_outside_and_a_killed_rank_is_named(
        name):
    launcher = LAUNCHERS[name]
    why = launcher.missing()
    if why:
        pytest.skip(why)
    with launcher.start(PROBE_HELPER_LINGER_S=launcher.linger, **ROLES) as job:
        probe = Client(job.address)
        ranks = sorted(job.ranks)
        assert ranks == [0, 1, 2, 3], job.ranks

        # `ranks` lists every rank, with its rank number and pid, and nothing that is no rank (a launcher, a
        # parent that only waits, multiprocessing's resource tracker); each serves TCP.
        members = _until(lambda: (lambda m: m if sorted(r["rank"] for r in m) == ranks else None)(probe.members()),
                         30, "every rank listed by `probe %s ranks`" % job.address, lambda: probe.last)
        assert [(m["rank"], m["pid"]) for m in members] == sorted(job.ranks.items()), (members, job.ranks)
        assert all(isinstance(m["port"], int) and m["port"] > 0 for m in members), members
        if launcher.fixed_ports:
            assert [m["port"] for m in members] == [job.port + m["local_rank"] for m in members], members
        job.go_ahead()  # rank 1 takes its GIL now, later in the job as a real rank would, once listed

        # --all-ranks backtrace: the hung rank is a group of its own; the rank holding its GIL is read from
        # outside; the two that wait normally share one stack.
        def grouped():
            result = probe("--all-ranks", "backtrace")
            groups = main_thread_groups(result.out)
            want = {"rank %d (1)" % HANG_RANK, "ranks 0,3 (2)",
                    "rank %d (1)  [stack of rank %d read from outside]" % (GIL_RANK, GIL_RANK)}
            return (result, groups) if result.code == 0 and set(groups) == want else None

        result, groups = _until(grouped, 30, "a grouped backtrace of the 4 ranks", lambda: probe.last)
        assert "stuck_in_rank_hang" in groups["rank %d (1)" % HANG_RANK], result.out
        assert "wait_for_work" in groups["ranks 0,3 (2)"], result.out
        assert "hold_the_gil" in groups["rank %d (1)  [stack of rank %d read from outside]" % (GIL_RANK, GIL_RANK)]
        assert "> hold_the_gil" in result.out  # where the odd rank departs from the majority

        # A rank killed: shown dead, and named where --all-ranks cannot ask it.
        killed = launcher.killed
        os.kill(job.ranks[killed], signal.SIGKILL)

        def dead():
            return [m for m in probe.members() if m["rank"] == killed and m["state"] == "dead"]

        _until(dead, 15, "rank %d shown dead" % killed, lambda: probe.last)
        asked = probe("--all-ranks", "query", "SELECT pid FROM process.info", "-f", "json")
        assert asked.code != 0, (asked.code, asked.out, asked.err)
        assert "rank %d (" % killed in asked.err, asked.err


@pytest.mark.parametrize("name", ["mpirun", "mp.spawn"])
def test_a_rank_that_takes_its_gil_as_soon_as_it_knows_its_rank_is_listed_and_read_from_outside(name):
    """The GIL taken at once: under mpirun the rank's variables name it from its start; under mp.spawn it is a
    rank only once init_process_group returned, and takes the GIL right then."""
    launcher = LAUNCHERS[name]
    why = launcher.missing()
    if why:
        pytest.skip(why)
    start = {"mpirun": launch.mpirun_job, "mp.spawn": launch.mp_spawn_job}[name]
    with start(2, GIL_RANK="1", GO_FILE="") as job:
        probe = Client(job.address)
        members = _until(lambda: (lambda m: m if len(m) == 2 else None)(probe.members()), 8,
                         "both ranks listed by `probe %s ranks`" % job.address, lambda: probe.last)
        assert [(m["rank"], m["pid"]) for m in members] == sorted(job.ranks.items()), (members, job.ranks)
        stacks = probe("--all-ranks", "backtrace")
        assert stacks.code == 0, (stacks.out, stacks.err)
        groups = main_thread_groups(stacks.out)
        assert "hold_the_gil" in groups["rank 1 (1)  [stack of rank 1 read from outside]"], stacks.out
        assert "wait_for_work" in groups["rank 0 (1)"], stacks.out


@pytest.mark.skipif(not os.path.exists("/proc/self"), reason="needs Linux")
def test_two_nodes_under_accelerate_are_one_job_at_the_masters_address():
    """Two `accelerate launch --num_machines 2 --machine_rank 0|1`, as two hosts would run them (127.0.0.1 and
    127.0.0.2, a runtime directory each, one PROBE_TOKEN): the master's address lists the ranks of both."""
    why = launch.installed("accelerate", "accelerate") or _why_not_torch()
    if why:
        pytest.skip(why)
    try:
        with socket.socket() as sock:
            sock.bind(("127.0.0.2", 0))
    except OSError:
        pytest.skip("127.0.0.2 cannot be bound here")
    token = "two-accelerate-nodes-token"
    with launch.accelerate_two_nodes(token) as job:
        probe = Client(job.address, PROBE_TOKEN=token)
        members = _until(lambda: (lambda m: m if len(m) == 4 else None)(probe.members()), 30,
                         "the 4 ranks of both nodes listed at the master's address", lambda: probe.last)
        assert [(m["rank"], m["host"], m["pid"], m["node"]) for m in members] == [
            (r, "127.0.0.%d" % (r // 2 + 1), job.ranks[r], r // 2) for r in range(4)], (members, job.ranks)
        asked = probe("--all-ranks", "query", "SELECT pid FROM process.info", "-f", "json")
        assert asked.code == 0, asked.err
        assert [(r["rank"], r["host"], r["pid"]) for r in json.loads(asked.out)] == [
            (r, "127.0.0.%d" % (r // 2 + 1), job.ranks[r]) for r in range(4)]
