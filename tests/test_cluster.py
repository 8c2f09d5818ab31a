"""Across ranks: real torchrun jobs on CPU; discovery through the host helper, fan-out, grouping, and the
ranks that cannot answer (GIL held in C, killed) named or read from outside."""

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Dict, Iterator, List, Tuple

import pytest

from probe.cli.render_cluster import RankStacks, render_grouped_backtrace, render_grouped_eval, render_grouped_text
from probe.client.cluster import compact_ranks, parse_rank_list
from probe.client.results import EvalResult, Frame
from probe.errors import UsageError
from procs import TARGETS, Proc, run_cli, scaled, target_env
from terminal import Terminal, run_in_pty, sockets
from torch_job import ready_lines

TORCHRUN = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
needs_torchrun = pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun (torch) is not installed")


_HOST = socket.gethostname()  # how the host helper names this node


def _free_ports(count: int) -> int:
    """A port p such that p - 1 .. p + count - 1 were free a moment ago (the helper takes p - 1)."""
    for _ in range(100):
        with socket.socket() as probe_sock:
            probe_sock.bind(("127.0.0.1", 0))
            base = probe_sock.getsockname()[1]
        if base < 2000 or base + count > 65000:
            continue
        socks = []
        try:
            for port in range(base - 1, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


@contextmanager
def torchrun_job(script: str, nproc: int, timeout: float = 90.0, extra: Tuple[str, ...] = (),
                 **env: str) -> Iterator[Tuple[int, Dict[int, int]]]:
    """A real torchrun job with PROBE_PORT: yields (PROBE_PORT, rank -> pid) once every rank printed READY;
    the launcher's whole process group is killed and reaped at the end."""
    port = _free_ports(nproc)
    launcher = subprocess.Popen([TORCHRUN, "--nproc-per-node=%d" % nproc, "--master-port=%d" % _free_ports(1),
                                 *extra, os.path.join(TARGETS, script)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=target_env(probe=False, PROBE_PORT=str(port), **env),
                                start_new_session=True)
    output = Proc(launcher, "torchrun " + script)
    try:
        yield port, _ready_ranks(output, nproc, time.monotonic() + timeout)
    finally:
        _kill_job(launcher)


def _ready_ranks(output: Proc, count: int, deadline: float) -> Dict[int, int]:
    """rank -> pid from the launcher's next ``count`` READY lines (its ranks'), read until ``deadline``."""
    return {int(words[2]): int(words[1]) for words in ready_lines(output, count, deadline)}


def _kill_job(launcher: subprocess.Popen) -> None:
    """Kill a torchrun launcher and its ranks, and reap it. The ranks first: torchrun starts each in its own
    session, so the launcher's group is not theirs; while the launcher lives they are its children, and
    their pids cannot be reused."""
    from probe.reader.proc import children as _children

    for pid in _children(launcher.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(launcher.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    launcher.wait(20)
    for stream in (launcher.stdout, launcher.stderr):
        if stream:
            stream.close()


def _until(check, timeout: float, what: str):
    """Poll ``check()`` until it returns something true (bounded), then return that."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.2)
    raise AssertionError("%s within %.0f s; last: %r" % (what, timeout, last))


# -- pure functions ----------------------------------------------------------------------------------


def test_rank_lists_read_and_write_compactly():
    assert parse_rank_list("0-3,8") == [0, 1, 2, 3, 8]
    assert compact_ranks([0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15]) == "0-6,8-15"
    assert compact_ranks([3]) == "3"
    for wrong, said in (("3-1", "ends before it starts"), ("0-99999999999", "names more than"), ("x", "cannot read")):
        with pytest.raises(UsageError, match=said):
            parse_rank_list(wrong)


def _frames(*funcs: str) -> List[Frame]:
    return [Frame(1, "MainThread", 10, True, depth, f, "t.py", 10 + len(f)) for depth, f in enumerate(funcs)]


def test_grouped_backtrace_puts_the_majority_first_and_marks_where_the_odd_rank_departs():
    same = _frames("all_reduce", "train_step", "main")
    odd = _frames("wait", "load_next_batch", "main")
    ranks = [RankStacks(r, same) for r in (0, 1, 3, 4)] + [RankStacks(2, odd, "read from outside")]
    lines = list(render_grouped_backtrace(ranks, 5))
    assert lines[0] == 'Thread "MainThread": 2 distinct stacks across 5 of 5 ranks'
    assert lines[1].startswith("  ranks 0-1,3-4 (4)")
    assert lines[5] == "  rank 2 (1)  [stack of rank 2 read from outside]"
    assert [line[4] for line in lines[6:9]] == [">", ">", " "]  # main is shared; the rest departs


def test_grouped_text_prints_each_distinct_listing_once_largest_group_first():
    assert list(render_grouped_text([(0, "a\n\nb"), (1, "c"), (2, "a\n\nb")])) == \
        ["ranks 0,2:", "  a", "", "  b", "rank 1:", "  c"]


def test_grouped_eval_prints_each_distinct_output_once():
    results = [(r, EvalResult("", "", "1200", None)) for r in (0, 1, 2, 4, 5, 6, 7)]
    results.append((3, EvalResult("", "", "1187", None)))
    assert list(render_grouped_eval(results)) == [("ranks 0-2,4-7: 1200", False), ("rank 3: 1187", False)]


# -- several -t: at once, failures named, exit 7 -------------------------------------------------------


def test_several_targets_run_at_once_and_a_partial_answer_exits_7(target_factory, tmp_path):
    first, second = target_factory("idle.py"), target_factory("idle.py")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        nobody = "127.0.0.1:%d" % free.getsockname()[1]  # closed again: nothing listens there
    # Each snippet waits for the other target's: only targets asked at once both see it (each waits 15 s at most).
    meet = ("import os, time\nopen(os.path.join(%r, str(os.getpid())), 'w').close()\nend = time.monotonic() + 15\n"
            "while len(os.listdir(%r)) < 2 and time.monotonic() < end: time.sleep(0.01)\nlen(os.listdir(%r))"
            % ((str(tmp_path),) * 3))
    met = run_cli("-t", str(first.pid), "-t", str(second.pid), "eval", meet)
    assert met.code == 0, met.err
    assert met.out.split() == ["==", str(first.pid), "==", "2", "==", str(second.pid), "==", "2"], met.out

    partial = run_cli("-t", str(first.pid), "-t", nobody, "-t", str(second.pid), "query",
                      "SELECT pid FROM process.info", "-f", "json", env=target_env(probe=False, PROBE_TOKEN="t"))
    assert partial.code == 7, (partial.code, partial.err)
    assert json.loads(partial.out) == [{"target": str(first.pid), "pid": first.pid},
                                       {"target": str(second.pid), "pid": second.pid}]
    assert "probe: %s: error:" % nobody in partial.err, partial.err


def test_targets_that_never_answer_do_not_keep_the_others_waiting(target_factory):
    """Only young requests count against --max-in-flight: three listeners that accept and never answer,
    asked first with one place in flight, must not leave the two live targets unasked at the deadline."""
    live = [target_factory("idle.py"), target_factory("idle.py")]
    silent = []
    try:
        for _ in range(3):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen(8)  # the kernel accepts; nobody ever reads or answers
            silent.append(sock)
        names = ["127.0.0.1:%d" % s.getsockname()[1] for s in silent]
        args = [word for name in names + [str(p.pid) for p in live] for word in ("-t", name)]
        started = time.monotonic()
        result = run_cli(*args, "--max-in-flight", "1", "--deadline", "4", "query", "SELECT pid FROM process.info",
                         "-f", "json", env=target_env(probe=False, PROBE_TOKEN="t"), timeout=30)
        elapsed = time.monotonic() - started
    finally:
        for sock in silent:
            sock.close()
    assert result.code == 7, (result.code, result.err)
    assert json.loads(result.out) == [{"target": str(p.pid), "pid": p.pid} for p in live], result.err
    for name in names:
        assert "probe: %s: error: no answer within the deadline" % name in result.err, result.err
    assert elapsed < 12, elapsed  # the 4 s deadline, the CLI's start and the suite's load


def test_a_command_left_waiting_on_a_silent_target_prints_only_its_own_lines(target_factory):
    """The CLI exits while a fan-out thread still waits on a target that never answers; the client ran
    DuckDB itself for the other target (no agent there). Tearing the interpreter down under that thread
    made DuckDB's bindings print a page of leak reports after probe's own lines."""
    plain = target_factory("idle.py", probe=False)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        name = "127.0.0.1:%d" % silent.getsockname()[1]
        result = run_cli("-t", name, "-t", str(plain.pid), "--deadline", "2", "query", "SELECT pid FROM process.info",
                         env=target_env(probe=False, PROBE_TOKEN="t"), timeout=30)
    assert result.code == 5, (result.code, result.err)
    lines = result.err.splitlines()
    assert len(lines) == 2 and all(line.startswith("probe: ") for line in lines), result.err
    assert lines[0].startswith("probe: %s: error: no answer within the deadline" % name), result.err
    assert lines[1].startswith("probe: %d: error: process.info needs the agent" % plain.pid), result.err


def test_when_no_rank_answers_no_empty_table_or_stack_is_printed():
    socks = [socket.socket(), socket.socket()]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
            sock.listen(8)
        names = ["127.0.0.1:%d" % sock.getsockname()[1] for sock in socks]
        args = ["-t", names[0], "-t", names[1], "--all-ranks", "--deadline", "1", "query"]
        env = target_env(probe=False, PROBE_TOKEN="t")
        # three commands at once, each waiting out its own deadline (not one after another)
        with ThreadPoolExecutor(3) as pool:
            table, as_json, stacks = pool.map(lambda words: run_cli(*words, env=env, timeout=30), [
                (*args, "SELECT 1 AS x"), (*args, "-f", "json", "SELECT 1 AS x"), (*args[:-1], "backtrace")])
    finally:
        for sock in socks:
            sock.close()
    assert table.code == 5 and table.out == "", (table.code, table.out, table.err)  # 5: no answer in time
    assert "probe: 2 of 2 ranks gave no result (ranks 0-1):" in table.err, table.err
    assert "rank 1 (%s): no answer within the deadline" % names[1] in table.err, table.err
    assert as_json.code == 5 and json.loads(as_json.out) == [], as_json.out
    assert stacks.code == 5 and stacks.out == "", (stacks.code, stacks.out, stacks.err)


# -- real jobs -----------------------------------------------------------------------------------------


@needs_torchrun
def test_a_rank_holding_the_gil_is_read_from_outside_and_a_killed_rank_is_named():
    """4 ranks: rank 1 holds its GIL in a C call, rank 3 is killed mid-job (torchrun does not look for a
    minute), ranks 0 and 2 wait normally."""
    with torchrun_job("rank_states.py", 4, extra=("--monitor-interval=60",), GIL_RANK="1") as (port, pids):
        master = "127.0.0.1:%d" % port
        listed = run_cli(master, "ranks", "-f", "json")
        assert listed.code == 0, listed.err
        members = json.loads(listed.out)
        assert [(m["rank"], m["pid"], m["port"]) for m in members] == [(r, pids[r], port + r) for r in range(4)]
        assert "job-%d.token" % port in listed.err  # where the job's one token is

        # The ranks share one token: an explicit list works with it.
        token_file = os.path.join(os.environ.get("PROBE_RUNTIME_DIR", "/tmp/probe-%d" % os.getuid()),
                                  "job-%d.token" % port)
        listed_targets = run_cli("-t", "127.0.0.1:%d" % port, "-t", "127.0.0.1:%d" % (port + 2), "--all-ranks",
                                 "--token-file", token_file, "query", "SELECT pid FROM process.info", "-f", "json")
        assert listed_targets.code == 0, listed_targets.err
        assert [r["pid"] for r in json.loads(listed_targets.out)] == [pids[0], pids[2]]

        os.kill(pids[3], signal.SIGKILL)
        _until(lambda: json.loads(run_cli(master, "ranks", "-f", "json").out)[3]["state"] == "dead", 10,
               "rank 3 shown dead")

        start = time.monotonic()
        result = run_cli(master, "--all-ranks", "backtrace")
        elapsed = time.monotonic() - start
        assert result.code == 7, (result.code, result.out, result.err)  # a partial answer
        assert "ranks 0,2 (2)" in result.out and "wait_for_work" in result.out
        assert "rank 1 (1)  [stack of rank 1 read from outside]" in result.out
        assert "> hold_the_gil" in result.out  # where the odd rank departs
        assert "rank 3 (vm)" in result.err.replace(socket.gethostname(), "vm")
        assert "killed by signal 9" in result.err
        assert elapsed < 10, elapsed

        rows = run_cli(master, "--all-ranks", "query", "SELECT func FROM python.backtrace WHERE depth = 0 "
                       "AND thread_name = 'MainThread'", "--merge", "SELECT func, list(rank ORDER BY rank) AS ranks "
                       "FROM result GROUP BY ALL ORDER BY func", "-f", "json")
        assert rows.code == 7, rows.err
        got = {r["func"]: r["ranks"] for r in json.loads(rows.out)}
        assert got.pop("hold_the_gil") == [1] and list(got.values()) == [[0, 2]], rows.out


@needs_torchrun
def test_a_real_hang_the_rank_that_skipped_the_collective_stands_out():
    with torchrun_job("dist_hang.py", 4, timeout=120) as (port, pids):
        master = "127.0.0.1:%d" % port

        def grouped():
            out = run_cli(master, "--all-ranks", "backtrace")
            return out if out.code == 0 and "ranks 0-1,3 (3)" in out.out and "rank 2 (1)" in out.out else None

        result = _until(grouped, 30, "ranks 0,1,3 in all_reduce and rank 2 apart")
        text = result.out
        assert text.index("ranks 0-1,3 (3)") < text.index("rank 2 (1)")  # the majority first
        majority, minority = text.split("rank 2 (1)", 1)
        assert "all_reduce" in majority and "train_step" in majority
        assert "> load_next_batch" in minority  # marked where it departs from the majority

        merged = run_cli(master, "--all-ranks", "query", "SELECT func, lineno FROM python.backtrace WHERE "
                         "thread_name = 'MainThread' AND func IN ('train_step', 'load_next_batch')",
                         "--merge", "SELECT func, list(rank ORDER BY rank) AS ranks FROM result GROUP BY ALL "
                         "ORDER BY len(ranks) DESC", "-f", "json")
        assert merged.code == 0, merged.err
        assert json.loads(merged.out) == [{"func": "train_step", "ranks": [0, 1, 3]},
                                          {"func": "load_next_batch", "ranks": [2]}]

        grouped_eval = run_cli(master, "--all-ranks", "eval", "import os; int(os.environ['RANK']) == 2")
        assert grouped_eval.out.splitlines() == ["ranks 0-1,3: False", "rank 2: True"], grouped_eval.out
        rows = run_cli(master, "--all-ranks", "eval", "--json", "import os; int(os.environ['RANK']) == 2")
        assert [(r["rank"], r["host"], r["value"]) for r in map(json.loads, rows.out.splitlines())] == \
            [(0, _HOST, "False"), (1, _HOST, "False"), (2, _HOST, "True"), (3, _HOST, "False")], rows.out

        subset = run_cli(master, "--ranks", "2-3", "query", "SELECT count(*) AS n FROM python.threads", "-f", "json")
        assert [r["rank"] for r in json.loads(subset.out)] == [2, 3], subset.err

        # A rank that does not answer by the deadline is asked to stop (its snippet would run 30 s).
        slow = run_cli(master, "--all-ranks", "--deadline", "2", "eval", "import os, time\n"
                       "end = time.time() + (30 if os.environ['RANK'] == '1' else 0)\nwhile time.time() < end: pass")
        assert slow.code == 7 and "rank 1 (%s): no answer within the deadline of 2.0 s; the snippet was stopped there" \
            % _HOST in slow.err, slow.err
        spinning = ("import sys, threading; me = threading.get_ident(); sum(1 for i, f in sys._current_frames().items() "
                    "if i != me and f.f_code.co_filename == '<probe-eval>')")
        _until(lambda: run_cli(master, "--ranks", "1", "eval", spinning).out.strip() == "rank 1: 0", 5,
               "rank 1's snippet ended once asked to stop")

        # Ctrl-C, typed on a terminal, stops the query on every rank (each would run it to its 10 s limit).
        status, out, _ = run_in_pty([master, "--all-ranks", "query", "SELECT sum(hash(i)) AS s FROM range(10000000000) t(i)"],
                                    when=lambda pid: sockets(pid) >= 4)
        shown = [line.rsplit("\r", 1)[-1].replace("\x1b[K", "").replace("^C", "").strip() for line in out.splitlines()]
        said = [line for line in shown if line and "answered, waiting for" not in line]  # the progress line goes
        assert status == 130 and said == ["probe: interrupted (Ctrl-C); the query was stopped on ranks 0-3"], out
        busy = "SELECT count(*) AS n FROM python.threads WHERE thread_name = 'probe-request'"
        _until(lambda: all(r["n"] <= 1 for r in json.loads(run_cli(master, "--all-ranks", "query", busy, "-f", "json").out)),
               5, "every rank's query ended after Ctrl-C")

        # A rank's port or the helper's given as the job's address: named, with a command that works.
        for wrong, what in ((port + 1, "rank 1's port"), (port - 1, "the host helper's port")):
            mistaken = run_cli("127.0.0.1:%d" % wrong, "--all-ranks", "backtrace")
            assert mistaken.code == 2 and "%s of the job with PROBE_PORT=%d" % (what, port) in mistaken.err, mistaken.err
            hint = mistaken.err.strip().rsplit(" -- ", 1)[1].split()
            assert hint == ["probe", master, "ranks"], mistaken.err
            followed = run_cli(*hint[1:])
            assert followed.code == 0 and "(4 rows)" in followed.out, (followed.out, followed.err)


@needs_torchrun
def test_checkpoint_across_ranks_writes_a_file_per_rank_that_loads_with_weights_only(tmp_path):
    pytest.importorskip("torch")
    with torchrun_job("dist_train.py", 2) as (port, pids):
        done = run_cli("127.0.0.1:%d" % port, "--all-ranks", "checkpoint", str(tmp_path / "ck-{rank}.pt"))
        assert done.code == 0, (done.out, done.err)
        # debugpy in every rank: ranks of one host cannot share a port, so each takes a free one; the stop
        # command each prints works as printed (through the job's address, which finds the token).
        master = "127.0.0.1:%d" % port
        debugged = run_cli(master, "--all-ranks", "debug", timeout=60)
        assert debugged.code == 0, (debugged.out, debugged.err)
        ports = re.findall(r"debugpy listens in process \d+ on 127\.0\.0\.1:(\d+)", debugged.out)
        assert len(set(ports)) == 2, debugged.out
        stops = [line.split(": ", 1)[1] for line in debugged.out.splitlines() if line.startswith("Stop it with: ")]
        assert stops == ["probe %s --ranks %d debug --stop" % (master, rank) for rank in (0, 1)], debugged.out
        for command in stops:
            stopped = run_cli(*shlex.split(command)[1:])
            assert stopped.code == 0 and "debugpy stopped" in stopped.out, (stopped.out, stopped.err)
        listing = run_cli(master, "--all-ranks", "tables")
        assert listing.code == 0 and listing.out.startswith("ranks 0-1:\n"), listing.out
        assert listing.out.count("python.threads ") == 1, listing.out  # once for both ranks, not once a rank
        # repl across ranks: input runs on every rank, identical outputs once, headed by their ranks.
        (tmp_path / "home").mkdir()
        term = Terminal([master, "--all-ranks"], tmp_path / "home")
        try:
            term.expect("probe repl: ranks 0-1 (2), Python %d.%d." % sys.version_info[:2])
            term.expect(">>> ")
            term.send("import os; os.environ['RANK']\r")
            shown = term.expect(">>> ")
            assert "== rank 0 ==" in shown and "== rank 1 ==" in shown, shown
            term.send("1 + 1\r")
            assert "== ranks 0-1 ==\r\n2" in term.expect(">>> ")
            term.send("while True: pass\r\r")
            term.expect("answered, waiting for 0-1")  # the progress line: the snippet went out to both ranks
            term.send("\x03")
            assert "KeyboardInterrupt: the snippet was stopped on ranks 0-1" in term.expect(">>> ")
            term.send("\x04")
            assert term.wait_exit() == 0
        finally:
            term.close()
        # trace across ranks: ranks whose status reads the same share one block; --json rows carry rank and host.
        started = run_cli(master, "--all-ranks", "trace", "start")
        assert started.code == 0 and started.out.startswith("ranks 0-1:\n  trace: on"), started.out
        status = run_cli(master, "--all-ranks", "trace", "stop", "--json")
        assert status.code == 0, status.err
        assert [(row["rank"], row["state"]) for row in map(json.loads, status.out.splitlines())] == \
            [(0, "stopped"), (1, "stopped")], status.out
    assert "== rank 0 (127.0.0.1:%d) ==" % port in done.out and "== rank 1 (127.0.0.1:%d) ==" % (port + 1) in done.out
    assert done.out.count("saved %s" % tmp_path) == 2 and "model       model: 4 tensors, 212 parameters" in done.out
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("ck")) == ["ck-0.pt", "ck-1.pt"]
    loaded = subprocess.run([sys.executable, "-c", (
        "import sys, torch\n"
        "for path in sys.argv[1:]:\n"
        "    ck = torch.load(path, weights_only=True)\n"
        "    m = ck['models']['model']\n"
        "    print(sorted(ck['optimizers']), list(m['0.weight'].shape), sorted(ck['rng']))\n"),
        str(tmp_path / "ck-0.pt"), str(tmp_path / "ck-1.pt")], capture_output=True, text=True, timeout=60,
        env=target_env(probe=False))
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.splitlines() == ["['optimizer'] [16, 8] ['numpy', 'python', 'torch']"] * 2, loaded.stdout


def _loopback_alias_works() -> bool:
    """127.0.0.2 is this host too (Linux routes all of 127/8 to loopback): a second node's address."""
    try:
        with socket.socket() as sock:
            sock.bind(("127.0.0.2", 0))
        return True
    except OSError:
        return False


@contextmanager
def two_node_job(tmp_path, script: str, token: str, timeout: float = 90.0) -> Iterator[Tuple[int, Dict[int, int]]]:
    """Two torchrun launchers, nodes 0 and 1 of one job with 2 ranks each, as two hosts would run them: each
    node its own address (PROBE_HOST 127.0.0.1 / 127.0.0.2, the same PROBE_PORT), its own runtime directory
    (so nothing is shared through files), and the one PROBE_TOKEN given to both. Yields (PROBE_PORT,
    rank -> pid); every launcher and rank is killed and reaped at the end."""
    port, master_port = _free_ports(2), _free_ports(1)
    launchers = []
    try:
        for node in (0, 1):
            runtime = tmp_path / ("node%d" % node)
            runtime.mkdir(mode=0o700)
            env = target_env(probe=False, PROBE_PORT=str(port), PROBE_HOST="127.0.0.%d" % (node + 1),
                             PROBE_RUNTIME_DIR=str(runtime), PROBE_TOKEN=token)
            popen = subprocess.Popen([TORCHRUN, "--nnodes=2", "--node-rank=%d" % node, "--nproc-per-node=2",
                                      "--master-addr=127.0.0.1", "--master-port=%d" % master_port, "--monitor-interval=60",
                                      os.path.join(TARGETS, script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=env, start_new_session=True)
            launchers.append((popen, Proc(popen, "torchrun node %d" % node)))
        ranks: Dict[int, int] = {}
        deadline = time.monotonic() + timeout
        for _, output in launchers:
            ranks.update(_ready_ranks(output, 2, deadline))
        yield port, ranks
    finally:
        for popen, _ in launchers:
            _kill_job(popen)


@needs_torchrun
@pytest.mark.skipif(not _loopback_alias_works(), reason="127.0.0.2 cannot be bound here")
def test_two_nodes_report_to_the_master_and_answer_as_one_job(tmp_path):
    """The other node's helper reports its ranks to the master's over TCP; the client, knowing only the
    master's address, reaches the ranks of both nodes, and a rank killed on node 1 is named."""
    token = "two-node-job-token"
    with two_node_job(tmp_path, "rank.py", token) as (port, pids):
        master = "127.0.0.1:%d" % port
        env = target_env(probe=False, PROBE_TOKEN=token)

        def all_listed():
            out = run_cli(master, "ranks", "-f", "json", env=env)
            rows = json.loads(out.out) if out.code == 0 else []
            return rows if len(rows) == 4 else None

        members = _until(all_listed, 20, "node 1's ranks reported to the master")
        assert [(m["rank"], m["host"], m["port"], m["pid"], m["node"]) for m in members] == [
            (0, "127.0.0.1", port, pids[0], 0), (1, "127.0.0.1", port + 1, pids[1], 0),
            (2, "127.0.0.2", port, pids[2], 1), (3, "127.0.0.2", port + 1, pids[3], 1)]

        asked = run_cli(master, "--all-ranks", "query", "SELECT pid FROM process.info", "-f", "json", env=env)
        assert asked.code == 0, asked.err
        assert [(r["rank"], r["host"], r["pid"]) for r in json.loads(asked.out)] == [
            (r, "127.0.0.%d" % (r // 2 + 1), pids[r]) for r in range(4)]
        stacks = run_cli(master, "--all-ranks", "backtrace", env=env)
        assert stacks.code == 0 and "ranks 0-3 (4)" in stacks.out, (stacks.out, stacks.err)

        os.kill(pids[3], signal.SIGKILL)  # on node 1: only that node's helper sees it (torchrun looks a minute later)
        _until(lambda: json.loads(run_cli(master, "ranks", "-f", "json", env=env).out)[3]["state"] == "dead", 15,
               "rank 3 shown dead through node 1's report")
        partial = run_cli(master, "--all-ranks", "query", "SELECT pid FROM process.info", "-f", "json", env=env)
        assert partial.code == 7, (partial.code, partial.err)
        assert [r["rank"] for r in json.loads(partial.out)] == [0, 1, 2]
        assert "rank 3 (127.0.0.2)" in partial.err, partial.err

        # The member list is a table too, queried here: no rank is asked.
        members_sql = "SELECT rank, host, node, state FROM cluster.ranks WHERE state <> 'running' ORDER BY rank"
        odd = run_cli(master, "query", members_sql, "-f", "json", env=env)
        assert odd.code == 0, odd.err
        assert json.loads(odd.out) == [{"rank": 3, "host": "127.0.0.2", "node": 1, "state": "dead"}]
        mixed = run_cli(master, "query", "SELECT * FROM cluster.ranks JOIN python.threads USING (pid)", env=env)
        assert mixed.code == 2 and "python.threads is a rank's table" in mixed.err, (mixed.code, mixed.err)


@needs_torchrun
def test_a_rank_holding_the_gil_whose_backlog_is_full_is_still_read_from_outside_at_once():
    """A rank that cannot run accepts no connection; probed again and again (from other nodes), its TCP
    backlog fills and the kernel drops new connections, so a connect waits to its timeout. After a short
    wait the client asks the rank's host helper instead, which reads it from outside."""
    with torchrun_job("rank_states.py", 2, GIL_RANK="1") as (port, pids):
        master = "127.0.0.1:%d" % port
        assert run_cli(master, "ranks").code == 0
        held = []
        try:
            for _ in range(300):  # past the backlog: the rest wait in SYN_SENT, as a flood of probes would
                sock = socket.socket()
                sock.setblocking(False)
                try:
                    sock.connect(("127.0.0.1", port + 1))
                except BlockingIOError:
                    pass
                held.append(sock)
            start = time.monotonic()
            result = run_cli(master, "--all-ranks", "backtrace", timeout=120)
            elapsed = time.monotonic() - start
            assert result.code == 0, (result.out, result.err)
            assert "[stack of rank 1 read from outside]" in result.out and "> hold_the_gil" in result.out, result.out
            assert elapsed < scaled(8), elapsed
        finally:
            for sock in held:
                sock.close()
