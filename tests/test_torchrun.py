"""``PROBE=1 torchrun ...``: every rank gets an agent (TCP on PROBE_PORT + LOCAL_RANK), the launcher none."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

import probe
from probe import _paths
from torch_job import ready_lines, stop_launcher
from procs import TARGETS, Proc, run_cli, target_env

TORCHRUN = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")


def _free_port_pair() -> int:
    """A port p such that p and p + 1 were free a moment ago."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no two consecutive free ports")


@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun (torch) is not installed")
def test_every_rank_gets_an_agent_and_the_launcher_none(tmp_path):
    port = _free_port_pair()
    env = target_env(PROBE="1", PROBE_LISTEN="127.0.0.1:0", PROBE_PORT=str(port))
    launcher = subprocess.Popen([TORCHRUN, "--nproc_per_node=2", "--master_port=%d" % _free_port_pair(),
                                 os.path.join(TARGETS, "rank.py")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, start_new_session=True)
    try:
        output = Proc(launcher, "torchrun")  # reads the pipe itself, with a bounded wait for each line
        ranks = {int(local_rank): (int(pid), int(rank))
                 for _, pid, rank, local_rank in ready_lines(output, 2, time.monotonic() + 90)}
        token_file = _paths.job_token_path(port)  # one token per job: every rank shares it
        for local_rank, (pid, rank) in sorted(ranks.items()):
            deadline = time.monotonic() + 20
            while not os.path.exists(token_file):
                assert time.monotonic() < deadline, "rank %d wrote no token file" % rank
                time.sleep(0.05)
            client = probe.connect("127.0.0.1:%d" % (port + local_rank), token_file=token_file)
            health = client.health()
            assert (health["pid"], health["rank"], health["local_rank"], health["world_size"]) == (
                pid, rank, local_rank, 2)
        assert not os.path.exists(_paths.socket_path(launcher.pid)), "torchrun's own process got an agent"

        # `probe list` shows the launcher as its job's host helper, with a hint that works when followed.
        listed = {row["pid"]: row for row in json.loads(run_cli("list", "--json").out)}
        assert listed[launcher.pid]["agent"] == "helper", listed.get(launcher.pid)
        hint = listed[launcher.pid]["reach"]
        assert re.match(r"probe \S+:%d ranks  \(its job's host helper\)$" % port, hint), hint
        followed = run_cli(*hint.split("  (")[0].split()[1:], "-f", "json")
        assert followed.code == 0, followed.err
        assert sorted(row["pid"] for row in json.loads(followed.out)) == sorted(pid for pid, _ in ranks.values())
    finally:
        stop_launcher(launcher)
