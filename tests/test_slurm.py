"""Ranks started by a real ``srun`` on a one-node Slurm of the test's own (tests/slurm_cluster.py): they
register with their node's helper, so ``probe HOST:PROBE_PORT ranks`` lists them by their Slurm rank,
``--all-ranks backtrace`` singles out a hung rank, a rank whose GIL a C call holds is read from outside
and a killed rank is named; ``probe slurm:JOBID ...`` finds the job's nodes from Slurm itself (issue 18).

Skipped, with the daemon's own words, where Slurm cannot start (tests/run.sh installs it as root)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Tuple, TypeVar

import pytest

from procs import TARGETS, Proc, run_cli, scaled, target_env
from slurm_cluster import SlurmCluster, SlurmUnavailable, slurm_cluster
from test_cluster import _free_ports

T = TypeVar("T")
RANK = os.path.join(TARGETS, "slurm", "rank.py")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> Iterator[SlurmCluster]:
    try:
        with slurm_cluster(str(tmp_path_factory.mktemp("slurm"))) as cluster:
            yield cluster
    except SlurmUnavailable as exc:
        pytest.skip("no one-node Slurm here: %s" % exc)




class Job:
    def __init__(self, job_id: str, port: int, pids: Dict[int, int], local: Dict[int, int]) -> None:
        self.job_id, self.port, self.pids, self.local = job_id, port, pids, local

    @property
    def master(self) -> str:
        return "127.0.0.1:%d" % self.port


@contextmanager
def srun_job(slurm: SlurmCluster, ntasks: int, timeout: float = 60.0, **env: str) -> Iterator[Job]:
    """``srun -N1 -n NTASKS python tests/targets/slurm/rank.py`` with PROBE=1 PROBE_PORT: yields once every
    task printed READY; srun and the job are always ended (scancel, then srun killed and reaped)."""
    port = _free_ports(ntasks)
    job_env = slurm.env(target_env(PROBE_PORT=str(port), PROBE_HELPER_LINGER_S="3", **env))
    srun = subprocess.Popen(["srun", "-N1", "-n", str(ntasks), "--export=ALL", "--job-name=probe-test",
                             sys.executable, RANK], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=job_env,
                            start_new_session=True)
    try:
        pids, local = _ready_tasks(Proc(srun, "srun"), ntasks, timeout)
        jobs = slurm.running_jobs()
        assert len(jobs) == 1, jobs
        yield Job(jobs[0], port, pids, local)
    finally:
        _end_srun(slurm, srun, "probe-test")


def _ready_tasks(output: Proc, ntasks: int, timeout: float) -> Tuple[Dict[int, int], Dict[int, int]]:
    """Rank -> pid and rank -> local rank, once every task printed ``READY PID RANK LOCAL_RANK``."""
    pids: Dict[int, int] = {}
    local: Dict[int, int] = {}
    deadline = time.monotonic() + scaled(timeout)
    while len(pids) < ntasks:
        try:
            line = output.read_line(max(deadline - time.monotonic(), 0.1))
        except (TimeoutError, RuntimeError) as exc:
            raise AssertionError("the tasks did not start: %s; lines so far: %r" % (exc, output.lines)) from None
        output.lines.append(line)
        if line.startswith("READY"):
            _, pid, rank, local_rank = line.split()
            pids[int(rank)] = int(pid)
            local[int(rank)] = int(local_rank)
    return pids, local


def _end_srun(slurm: SlurmCluster, srun: "subprocess.Popen[bytes]", name: str) -> None:
    """Cancel the job by name, then make sure srun ended (killed if it would not) and is reaped."""
    slurm.run("scancel", "--name=%s" % name)
    try:
        srun.wait(scaled(15))
    except subprocess.TimeoutExpired:
        os.killpg(srun.pid, signal.SIGKILL)
        srun.wait(10)
    for stream in (srun.stdout, srun.stderr):
        if stream:
            stream.close()


def _until(check: Callable[[], Optional[T]], seconds: float, what: str) -> T:
    deadline = time.monotonic() + scaled(seconds)
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError("not within %.0f s: %s" % (scaled(seconds), what))
        time.sleep(0.2)


def _ranks(target: str, env: Optional[Dict[str, str]] = None) -> Tuple[int, List[Dict[str, object]], str]:
    result = run_cli(target, "ranks", "-f", "json", env=env)
    try:
        rows = json.loads(result.out) if result.code in (0, 7) else []
    except ValueError:
        rows = []
    return result.code, rows, result.err


def _listed(target: str, count: int, env: Optional[Dict[str, str]] = None) -> List[Dict[str, object]]:
    """The member list of ``target`` once it holds ``count`` ranks (a rank registers a moment after READY)."""
    seen: List[str] = []

    def check() -> Optional[List[Dict[str, object]]]:
        code, rows, err = _ranks(target, env)
        seen[:] = ["exit %d: %s" % (code, err.strip()[-500:])]
        return rows if code == 0 and len(rows) == count else None

    try:
        return _until(check, 20, "%d ranks listed by %s" % (count, target))
    except AssertionError as exc:
        raise AssertionError("%s; last: %s" % (exc, seen)) from None


def test_srun_ranks_listed_with_their_slurm_rank_a_hung_rank_singled_out_and_the_gil_rank_read_from_outside(slurm):
    """4 tasks of one srun step: rank 1 waits in stuck_in_all_reduce, rank 2 holds its GIL in a C call,
    ranks 0 and 3 wait for work."""
    with srun_job(slurm, 4, GIL_RANK="2", HANG_RANK="1") as job:
        members = _listed(job.master, 4)
        assert [(m["rank"], m["local_rank"], m["pid"]) for m in members] == [
            (r, job.local[r], job.pids[r]) for r in range(4)], members
        assert sorted(job.local.values()) == [0, 1, 2, 3]  # SLURM_LOCALID, one node
        assert all(m["world_size"] == 4 and m["host"] == slurm.node for m in members), members

        result = run_cli(job.master, "--all-ranks", "backtrace")
        assert result.code == 0, (result.code, result.out, result.err)
        text = result.out
        assert "ranks 0,3 (2)" in text and "wait_for_work" in text, text  # the majority, together
        assert "rank 2 (1)  [stack of rank 2 read from outside]" in text and "> hold_the_gil" in text, text
        hung = text.split("stuck_in_all_reduce")[0].rsplit("rank", 1)[1]  # the header above the hung frame
        assert hung.startswith(" 1 (1)\n") and "> stuck_in_all_reduce" in text, text


def test_a_killed_srun_rank_is_named(slurm):
    with srun_job(slurm, 2) as job:
        _listed(job.master, 2)
        os.kill(job.pids[1], signal.SIGKILL)

        def dead() -> bool:
            _, rows, _ = _ranks(job.master)
            return len(rows) == 2 and rows[1]["state"] == "dead"

        _until(dead, 15, "rank 1 shown dead")
        result = run_cli(job.master, "--all-ranks", "backtrace")
        assert result.code == 7, (result.code, result.out, result.err)  # a partial answer
        assert "wait_for_work" in result.out
        # Named, and seen dead: srun's slurmstepd is the rank's parent, not the node helper, so how it died
        # (signal 9) is not known to it as torchrun's launcher knows it.
        assert "rank 1 (%s): process %d exited" % (slurm.node, job.pids[1]) in result.err, result.err


def test_slurm_jobid_finds_the_nodes_from_slurm_and_lists_every_rank(slurm):
    with srun_job(slurm, 2, HANG_RANK="1") as job:
        members = _listed(job.master, 2)  # the job is up and registered
        env = slurm.env(target_env(probe=False))
        by_slurm = _listed("slurm:%s:%d" % (job.job_id, job.port), 2, env)
        assert [(m["rank"], m["pid"]) for m in by_slurm] == [(m["rank"], m["pid"]) for m in members]
        assert {m["host"] for m in by_slurm} == {socket.gethostname()}

        # The port from the client's PROBE_PORT, as the job had it.
        with_env = _listed("slurm:%s" % job.job_id, 2, dict(env, PROBE_PORT=str(job.port)))
        assert [m["pid"] for m in with_env] == [job.pids[0], job.pids[1]]

        result = run_cli("slurm:%s:%d" % (job.job_id, job.port), "--all-ranks", "backtrace", env=env)
        assert result.code == 0, (result.code, result.out, result.err)
        assert "stuck_in_all_reduce" in result.out and "wait_for_work" in result.out

        gathered = run_cli("slurm:%s:%d" % (job.job_id, job.port), "--via", "helpers", "--all-ranks", "backtrace", env=env)
        assert gathered.code == 0 and "rank 1 (1)" in gathered.out and "stuck_in_all_reduce" in gathered.out, gathered

        one = run_cli("slurm:%s:%d" % (job.job_id, job.port), "--ranks", "1", "backtrace", env=env)
        assert one.code == 0 and "stuck_in_all_reduce" in one.out and "wait_for_work" not in one.out, one


def test_an_sbatch_job_is_reached_from_outside_its_nodes_with_slurm_jobid_and_the_job_token_file(slurm, tmp_path):
    """As the README has it: a batch script exports PROBE=1, PROBE_PORT and PROBE_TOKEN_FILE (made before
    srun, mode 600) and runs srun; a client that has none of the job's files (a runtime directory of its
    own, as on a login node) reaches every rank with probe --token-file FILE slurm:JOBID."""
    port = _free_ports(2)
    token_file = tmp_path / "job.token"
    fd = os.open(str(token_file), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.urandom(16).hex().encode() + b"\n")
    os.close(fd)
    out = tmp_path / "job.out"
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH -N1 -n2 --job-name=probe-batch\n"
                      "export PROBE=1 PROBE_PORT=%d PROBE_TOKEN_FILE=%s PROBE_HELPER_LINGER_S=3\n"
                      "srun %s %s\n" % (port, token_file, sys.executable, RANK))
    submitted = subprocess.run(["sbatch", "-o", str(out), str(script)], capture_output=True, text=True,
                               env=slurm.env(target_env(probe=False, HANG_RANK="1")), timeout=scaled(20))
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.split()[-1]
    try:
        def ready() -> Optional[List[str]]:
            lines = [line for line in out.read_text().splitlines() if line.startswith("READY")] if out.exists() else []
            return lines if len(lines) == 2 else None

        pids = sorted(int(line.split()[1]) for line in _until(ready, 60, "both tasks READY in %s" % out))
        elsewhere = tmp_path / "login-node"  # no token file of the job's here
        elsewhere.mkdir(mode=0o700)
        env = slurm.env(target_env(probe=False, PROBE_RUNTIME_DIR=str(elsewhere)))
        target = "slurm:%s:%d" % (job_id, port)
        refused = run_cli(target, "ranks", env=env)
        assert refused.code == 4, refused  # the helper wants the job's token, and says so
        assert "refused this client" in refused.err and "--token-file" in refused.err, refused.err

        members = _listed(target, 2, dict(env, PROBE_TOKEN_FILE=str(token_file)))
        assert sorted(m["pid"] for m in members) == pids and [m["rank"] for m in members] == [0, 1]
        result = run_cli("--token-file", str(token_file), target, "--all-ranks", "backtrace", env=env)
        assert result.code == 0 and "stuck_in_all_reduce" in result.out, result
    finally:
        slurm.run("scancel", job_id)


def test_slurm_jobid_errors_say_what_is_wrong(slurm, tmp_path):
    env = slurm.env(target_env(probe=False))
    unknown = run_cli("slurm:999999:9700", "ranks", env=env)
    assert unknown.code != 0 and "Slurm knows no job 999999" in unknown.err, unknown

    no_port = run_cli("slurm:1", "ranks", env=env)
    assert no_port.code == 2 and "PROBE_PORT is not set" in no_port.err and "slurm:1:PORT" in no_port.err, no_port

    one_process = run_cli("slurm:1:9700", "backtrace", env=env)
    assert one_process.code == 2 and "names every rank of a Slurm job" in one_process.err, one_process

    bare = tmp_path / "bin"  # a PATH with python but no scontrol
    bare.mkdir()
    os.symlink(sys.executable, str(bare / "python"))
    nothing = run_cli("slurm:1:9700", "ranks", env=dict(env, PATH=str(bare)))
    assert nothing.code == 2 and "no scontrol" in nothing.err.replace("none on PATH", "no scontrol"), nothing

    # A pending job (held, so it never runs) has no nodes yet: said, with what to do.
    held = slurm.run("sbatch", "--hold", "--job-name=probe-held", "--wrap", "sleep 600")
    assert held.returncode == 0, held.stderr
    job_id = held.stdout.split()[-1]
    try:
        pending = run_cli("slurm:%s:9700" % job_id, "ranks", env=env)
        assert pending.code != 0 and "Slurm job %s is pending" % job_id in pending.err, pending
        assert "squeue -j %s" % job_id in pending.err, pending
    finally:
        slurm.run("scancel", job_id)


def test_a_slurm_node_whose_helper_does_not_answer_is_named(slurm):
    """A running job whose tasks have no agent (no PROBE): Slurm lists the node, no helper answers there;
    the error names the node and its helper's address."""
    port = _free_ports(2)
    sleeper = subprocess.Popen(["srun", "-N1", "-n1", "--job-name=probe-silent", "sleep", "600"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=slurm.env(),
                               start_new_session=True)
    try:
        job_id = _until(lambda: (slurm.running_jobs() or [None])[0], 20, "the job running")
        env = slurm.env(target_env(probe=False))
        result = run_cli("slurm:%s:%d" % (job_id, port), "ranks", env=env)
        assert result.code == 3, result
        assert "no node helper of Slurm job %s answered" % job_id in result.err, result.err
        assert "%s (127.0.0.1): no host helper at 127.0.0.1:%d" % (slurm.node, port - 1) in result.err, result.err
    finally:
        slurm.run("scancel", "--name=probe-silent")
        try:
            sleeper.wait(scaled(15))
        except subprocess.TimeoutExpired:
            os.killpg(sleeper.pid, signal.SIGKILL)
            sleeper.wait(10)



def test_slurm_jobid_on_two_nodes_asks_each_nodes_helper_and_names_a_node_whose_helper_is_silent(tmp_path):
    """Two slurmd on this host (n1 at 127.0.0.1, n2 at 127.0.0.2), srun -N2 -n4 with one PROBE_TOKEN: each
    node's tasks have a runtime directory and PROBE_HOST of their node's own, as two machines would.
    slurm:JOBID lists the ranks of both nodes from both helpers, with no MASTER_ADDR set (no helper gathers
    the other's); with node 2's helper stopped, node 2 is named and node 1's ranks are listed."""
    try:
        with slurm_cluster(str(tmp_path / "slurm"), nodes=2) as slurm:
            port, token = _free_ports(2), os.urandom(16).hex()
            run_dirs = tmp_path / "nodes"
            run_dirs.mkdir(mode=0o700)
            as_a_node = ('n=${SLURMD_NODENAME#n}; mkdir -p -m 700 %s/$n; export PROBE_RUNTIME_DIR=%s/$n '
                         'PROBE_HOST=127.0.0.$n; exec %s %s' % (run_dirs, run_dirs, sys.executable, RANK))
            srun = subprocess.Popen(["srun", "-N2", "-n4", "--ntasks-per-node=2", "--job-name=probe-two",
                                     "bash", "-c", as_a_node],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                    env=slurm.env(target_env(PROBE_PORT=str(port), PROBE_TOKEN=token,
                                                             PROBE_HELPER_LINGER_S="3")))
            stopped = None
            try:
                pids, _ = _ready_tasks(Proc(srun, "srun"), 4, 60)
                job_id = slurm.running_jobs()[0]
                target = "slurm:%s:%d" % (job_id, port)
                env = slurm.env(target_env(probe=False, PROBE_RUNTIME_DIR=str(tmp_path), PROBE_TOKEN=token))
                members = _listed(target, 4, env)
                assert [(m["rank"], m["pid"]) for m in members] == sorted(pids.items()), members
                assert [m["host"] for m in members] == ["127.0.0.1"] * 2 + ["127.0.0.2"] * 2, members
                assert [m["port"] for m in members] == [port, port + 1] * 2, members
                result = run_cli(target, "--all-ranks", "backtrace", env=env)
                assert result.code == 0 and "ranks 0-3 (4)" in result.out, result

                stopped = _helper_pid(port, "127.0.0.2")
                os.kill(stopped, signal.SIGSTOP)
                silent = run_cli("--deadline", "2", target, "ranks", "-f", "json", env=env)
                assert silent.code == 7, silent  # a partial list
                assert [m["rank"] for m in json.loads(silent.out)] == [0, 1], silent
                assert ("Slurm job %s runs on node n2 (127.0.0.2), whose node helper at 127.0.0.2:%d did not answer"
                        % (job_id, port - 1)) in silent.err and "its ranks are not listed" in silent.err, silent.err
            finally:
                if stopped is not None:
                    os.kill(stopped, signal.SIGCONT)
                _end_srun(slurm, srun, "probe-two")
    except SlurmUnavailable as exc:
        pytest.skip("no two-node Slurm here: %s" % exc)


def _helper_pid(port: int, host: str) -> int:
    """The node helper (python -m probe.host) of the job with PROBE_PORT ``port`` serving on ``host``."""
    wanted = ["-m", "probe.host", "--port", str(port), "--host", host]
    for name in os.listdir("/proc"):
        try:
            with open("/proc/%s/cmdline" % name, "rb") as handle:
                words = handle.read().decode("utf-8", "replace").split("\0")
        except OSError:
            continue
        if name.isdigit() and all(w in words for w in wanted):
            return int(name)
    raise AssertionError("no node helper serving %s for PROBE_PORT %d" % (host, port))
