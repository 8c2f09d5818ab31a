"""Ranks started by launchers other than torchrun say who they are, and no process that is no rank takes
a rank's port (issue 18, first part): ``torch.multiprocessing.spawn`` with ranks that learn their rank
from ``init_process_group`` alone, a rank with Slurm's variables, a process with no rank at all."""

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List

import pytest

from probe import _paths, _rank
from probe.reader import proc
from procs import Proc, run_cli, scaled, target_env, wait_for_socket
from test_torchrun import _free_port_pair

torch = pytest.importorskip("torch")


def _health(pid: int) -> Dict[str, object]:
    result = run_cli(str(pid), "health", "--json")
    assert result.code == 0, result.err
    return json.loads(result.out)


def _stderr_until(proc: Proc, text: str, timeout: float = 10.0) -> str:
    """What ``proc`` wrote to stderr, read until ``text`` is in it (bounded)."""
    assert proc.popen.stderr is not None
    fd, seen = proc.popen.stderr.fileno(), ""
    deadline = time.monotonic() + scaled(timeout)
    while text not in seen:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("stderr of %s so far: %r" % (proc.script, seen))
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            seen += chunk.decode("utf-8", "replace")
    return seen


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _kill(pids: List[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_mp_spawn_ranks_get_tcp_and_their_rank_from_torch_distributed_and_the_parent_no_rank_port(target_factory):
    port = _free_port_pair()  # PROBE_PORT: the ranks' ports are port and port + 1
    env = target_env(PROBE_PORT="127.0.0.1:%d" % port)
    parent = target_factory("mp_spawn_ranks.py", str(_free_port_pair()), env=env, timeout=60)
    children = proc.children(parent.pid)
    try:
        ranks: Dict[int, int] = {}  # from the "RANK <rank> <pid>" lines, before READY or after
        pending = list(parent.lines)
        while len(ranks) < 2:
            line = pending.pop(0) if pending else parent.read_line(60)
            if line.startswith("RANK "):
                ranks[int(line.split()[1])] = int(line.split()[2])
        assert sorted(ranks) == [0, 1] and set(ranks.values()) <= set(children), (ranks, children)

        # The parent only waits: it is no rank and holds no rank's port, but serves TCP on a port of its own.
        said = _stderr_until(parent, "process %d serves TCP on" % parent.pid)
        health = _health(parent.pid)
        assert health["rank"] is None and health["rank_source"] is None
        assert health["tcp"] and health["tcp"] not in ("127.0.0.1:%d" % port, "127.0.0.1:%d" % (port + 1)), health
        assert "no local rank is known" in said, said
        assert not _listening(port) and not _listening(port + 1), "a process took a rank's port"

        for rank, pid in ranks.items():
            wait_for_socket(pid)
            health = _health(pid)
            assert (health["rank"], health["world_size"], health["rank_source"]) == (rank, 2, "torch.distributed")
            assert health["local_rank"] is None and health["tcp"], health  # every rank serves TCP
            text = run_cli(str(pid), "health")
            assert text.code == 0 and "rank %d/2 (from torch.distributed)" % rank in text.out, text.out

        # multiprocessing's resource tracker (a child of the parent that is no rank) serves no TCP.
        for pid in set(proc.children(parent.pid)) - set(ranks.values()):
            if os.path.exists(_paths.socket_path(pid)):
                assert _health(pid)["tcp"] is None
    finally:
        parent.kill()
        _kill(children)


def test_a_rank_started_with_slurms_variables_reports_them_and_serves_its_ranks_port(target_factory):
    # The variables as srun sets them for task 3 of 4, the second on its node (node 1); srun itself is
    # not used: no Slurm runs on this machine.
    port = _free_port_pair()
    slurm = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_NODEID": "1",
             "SLURM_JOB_ID": "4242"}
    rank = target_factory("idle.py", env=target_env(PROBE_PORT="127.0.0.1:%d" % port, **slurm))
    health = _health(rank.pid)
    assert (health["rank"], health["local_rank"], health["world_size"], health["node"], health["rank_source"]) == (
        3, 1, 4, 1, "slurm"), health
    assert health["tcp"] == "127.0.0.1:%d" % (port + 1), health
    assert "rank 3/4 (from slurm)" in run_cli(str(rank.pid), "health").out


def test_a_rank_whose_port_is_taken_serves_on_another_and_says_which(target_factory):
    port = _free_port_pair()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        taken.listen(1)
        rank = target_factory("idle.py", env=target_env(PROBE_PORT="127.0.0.1:%d" % port, LOCAL_RANK="1",
                                                        RANK="1", WORLD_SIZE="2"))
        health = _health(rank.pid)
        assert health["tcp"] and health["tcp"] != "127.0.0.1:%d" % (port + 1), health
        said = _stderr_until(rank, "instead")
        assert ("probe: the agent in process %d: port %d taken by uid %d" % (rank.pid, port + 1, os.getuid())) in said, said
        assert "serving on %s instead" % health["tcp"] in said and health["tcp_note"] in said, said


def test_launcher_variables_in_their_order_of_precedence():
    both = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "NODE_RANK": "2", "SLURM_PROCID": "2",
            "SLURM_LOCALID": "0", "SLURM_NTASKS": "4"}
    assert _rank.from_environ(both) == (5, 1, 8, 2, "torchrun")  # torchrun inside an srun step
    mpi_in_slurm = {"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_SIZE": "8",
                    "OMPI_COMM_WORLD_NODE_RANK": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert _rank.from_environ(mpi_in_slurm) == (6, 2, 8, None, "mpi")  # NODE_RANK is no node number
    assert _rank.from_environ({"PMI_RANK": "3", "PMI_SIZE": "4"}) == (3, None, 4, None, "mpi")
    assert _rank.from_environ({"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_LOCAL_RANK": "1",
                               "MV2_COMM_WORLD_SIZE": "2"}) == (1, 1, 2, None, "mpi")
    assert _rank.from_environ({"LOCAL_RANK": "0"}) == (None, 0, None, None, "torchrun")
    assert _rank.from_environ({"RANK": "x"}) == (None, None, None, None, None)
    assert _rank.mp_role(["python", "-c", "from multiprocessing.resource_tracker import main;main(5)"]) == "helper"
    assert _rank.mp_role(["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, "
                                          "pipe_handle=7)", "--multiprocessing-fork"]) == "child"
    assert _rank.mp_role(["python", "train.py"]) is None


def test_a_launcher_under_srun_is_no_rank_and_takes_no_ranks_port(tmp_path):
    """``srun accelerate launch ...``: srun gives the launcher (one task a node) SLURM_PROCID 0 and
    SLURM_LOCALID 0, which name no rank of the job; its rank 0 must get PROBE_PORT + 0, not the launcher."""
    launcher = tmp_path / "accelerate"  # what the hook sees: a program called accelerate, run by python
    launcher.write_text("import os, sys, threading\nprint('READY', os.getpid(), flush=True)\n"
                        "threading.Event().wait(600)\n")
    port = _free_port_pair()
    env = target_env(PROBE_PORT="127.0.0.1:%d" % port, SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NTASKS="1")
    popen = subprocess.Popen([sys.executable, str(launcher), "launch", "train.py"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env)
    proc = Proc(popen, "accelerate")
    try:
        assert proc.read_line(30).startswith("READY")
        wait_for_socket(popen.pid, 30)
        health = _health(popen.pid)
        assert health["rank"] is None and health["local_rank"] is None, health
        assert health["tcp"] and health["tcp"] != "127.0.0.1:%d" % port, health
        assert not _listening(port)
    finally:
        proc.kill()


@pytest.mark.parametrize("world", ["2", "1", "2-stopped"])
def test_a_helper_that_fails_to_answer_is_an_error_for_a_rank_of_many_not_that_ranks_verdict(target_factory, world):
    """The one HOST:PORT is rank 0 of a job of two whose node helper (one port below) accepts and hangs up
    without an answer, as an overloaded helper may: diagnose must not judge rank 0 alone as if it were the
    job (it once said "healthy" so), nor where rank 0 cannot say whether it is alone (stopped). A process
    that is a job of one is still asked alone."""
    import threading

    helper_port = _free_port_pair()
    with socket.socket() as helper:
        helper.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        helper.bind(("127.0.0.1", helper_port))
        helper.listen(8)
        helper.settimeout(0.2)
        done = threading.Event()

        def hang_up() -> None:
            while not done.is_set():
                try:
                    conn, _ = helper.accept()
                except OSError:
                    continue
                with conn:
                    conn.settimeout(2)
                    try:
                        conn.recv(65536)
                    except OSError:
                        pass

        thread = threading.Thread(target=hang_up, daemon=True)
        thread.start()
        try:
            rank = target_factory("idle.py", env=target_env(PROBE_PORT="127.0.0.1:%d" % (helper_port + 1),
                                                            RANK="0", LOCAL_RANK="0", WORLD_SIZE=world[0]))
            assert _health(rank.pid)["tcp"] == "127.0.0.1:%d" % (helper_port + 1)
            # stopped: the rank's silence is waited out for --timeout (30 s by default); no wait makes a stopped
            # process answer, loaded machine or not, so 5 s say the same
            wait = ["--timeout", "5"] if world.endswith("stopped") else []
            if world.endswith("stopped"):
                os.kill(rank.pid, signal.SIGSTOP)
            try:
                result = run_cli("127.0.0.1:%d" % (helper_port + 1), *wait, "diagnose", "--json", timeout=scaled(60))
            finally:
                os.kill(rank.pid, signal.SIGCONT)
        finally:
            done.set()
            thread.join(scaled(5))
    if world.startswith("2"):
        assert result.code == 3, (result.out, result.err)
        assert "closed the connection without an answer" in result.err, result.err
        said = "did not say whether it is one rank of several" if world.endswith("stopped") else "one rank of a job of 2"
        assert said in result.err and "retry" in result.err, result.err
        assert result.out == "", result.out
    else:  # judged alone (on a loaded machine the verdict itself may be that it did not answer in time)
        assert json.loads(result.out)["single"] is True, (result.out, result.err)
        assert json.loads(result.out)["judged_alone"] is None, result.out


def test_a_rank_of_many_with_no_helper_is_judged_alone_and_says_so(target_factory):
    """Rank 1 of a job of three, asked at its own HOST:PORT (not the job's: nothing answers for the job one
    port below): diagnose answers for that rank, says among what is not known that the job's other ranks
    were not asked and why, and never exits 0."""
    port = _free_port_pair() + 1  # rank 1 serves at PROBE_PORT + 1; nothing listens at PROBE_PORT
    rank = target_factory("idle.py", env=target_env(PROBE_PORT="127.0.0.1:%d" % (port - 1), RANK="1",
                                                    LOCAL_RANK="1", WORLD_SIZE="3"))
    address = _health(rank.pid)["tcp"]
    result = run_cli(address, "diagnose", "--json", timeout=scaled(60))
    said = json.loads(result.out)
    assert said["single"] is True and said["judged_alone"]["rank"] == 1, said
    why = said["judged_alone"]["why"]  # nothing at PROBE_PORT; or, once rank 1 started a helper below, that one's word
    assert said["judged_alone"]["world_size"] == 3 and ("no host helper at" in why or "rank 1's port of the job" in why), said
    assert said["exit_code"] == result.code, said
    assert any("rank 1 of a job of 3, judged alone" in line for line in said["unavailable"]), said["unavailable"]
    assert result.code >= 10, (result.code, result.out)
    text = run_cli(address, "diagnose", timeout=scaled(60))
    assert "judged alone" in text.out and text.code >= 10, (text.out, text.err)
