"""Every hint printed for a process that runs no agent is followed here, as printed, and must work.

"Start it with PROBE=1, or inject" is right only for a process of one's own, on a Python probe
supports, whose interpreter has probe, that is no torchrun launcher and whose GIL is free; each other
case gets its own words and its own next step: another user's process (exit 4, run as that user or
root), a stopped process read with native frames, PROBE=1 under an interpreter without probe, a C call
that keeps the GIL, Python 3.8, an agent in another runtime directory, torchrun's launcher, a table
that needs the agent, and an agent's own hints (``probe TARGET``).
"""

import ctypes
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

import pytest

from procs import REPO, TARGETS, CliResult, Proc, pyenv_python, run_cli, scaled, stop, target_env

GDB = shutil.which("gdb") is not None
NOBODY = 65534


def _hints(text: str) -> List[str]:
    """The commands in backquotes of a message, in order."""
    return re.findall(r"`([^`]+)`", text)


def _follow(command: str, env: Optional[Dict[str, str]] = None, timeout: float = 60.0) -> CliResult:
    """Run a printed ``probe ...`` command (a leading ``sudo``/``sudo -u USER`` is what the test is, as root)."""
    words = shlex.split(command)
    if words[0] == "sudo":
        words = words[3:] if words[1] == "-u" else words[1:]
    assert words[0] == "probe", command
    return run_cli(*words[1:], env=env, timeout=timeout)


def _state(pid: int) -> str:
    with open("/proc/%d/stat" % pid, "rb") as handle:
        stat = handle.read()
    return stat[stat.rindex(b")") + 2:][:1].decode()


# ---------------------------------------------------------------- another user's process

def _as_user(uid: int):
    """For ``preexec_fn``: become ``uid`` (gid the same), a user without CAP_SYS_PTRACE, keeping only
    CAP_DAC_READ_SEARCH (ambient, so it survives exec): the test's interpreter lives under /root, which
    other users may not enter. Reading another user's /proc/PID/{exe,maps,environ} and ptrace still
    need CAP_SYS_PTRACE, so to the kernel this is any other user."""
    def become() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_keepcaps, pr_cap_ambient, pr_cap_ambient_raise, cap_dac_read_search = 8, 47, 2, 2

        class Header(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

        class Data(ctypes.Structure):
            _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                        ("inheritable", ctypes.c_uint32)]

        libc.prctl(pr_set_keepcaps, 1, 0, 0, 0)
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        data = (Data * 2)()
        data[0].effective = data[0].permitted = data[0].inheritable = 1 << cap_dac_read_search
        if libc.capset(ctypes.byref(Header(0x20080522, 0)), data) != 0:
            os._exit(97)
        if libc.prctl(pr_cap_ambient, pr_cap_ambient_raise, cap_dac_read_search, 0, 0) != 0:
            os._exit(98)

    return become


def _cli_as(uid: int):
    """Run the probe command as ``uid``, with a runtime directory of its own."""
    runtime = tempfile.mkdtemp(prefix="probe-uid%d-" % uid)
    os.chown(runtime, uid, uid)

    def run(*args: str) -> CliResult:
        env = target_env(probe=False, PROBE_RUNTIME_DIR=runtime, HOME=runtime)
        done = subprocess.run([sys.executable, "-m", "probe", *args], capture_output=True, text=True, env=env,
                              cwd=REPO, preexec_fn=_as_user(uid), timeout=scaled(60))
        if done.returncode in (97, 98) or "No module named" in done.stderr:
            pytest.skip("cannot run probe as uid %d here: %s" % (uid, done.stderr.strip()[-200:]))
        return CliResult(done.returncode, done.stdout, done.stderr)

    return run, runtime


needs_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root, to run processes as other users")


@needs_root
def test_another_users_process_is_named_as_such_exit_4_and_the_hint_works(target_factory):
    proc = target_factory("inject_sleeping.py", probe=False)  # root's process, no agent
    as_nobody, runtime = _cli_as(NOBODY)
    try:
        for command in (["health"], ["backtrace"], ["backtrace", "--native"], ["query", "SELECT 1"], ["inject"]):
            result = as_nobody(str(proc.pid), *command)
            assert result.code == 4, (command, result.err)
            assert "another user's process" in result.err and "uid 0" in result.err, result.err
            assert "not a Python interpreter" not in result.err
            hints = _hints(result.err)
            assert hints == ["sudo " + " ".join(shlex.quote(w) for w in ["probe", str(proc.pid)] + command)], result.err
        # Followed, as root: the stacks are read, and the agent starts.
        followed = _follow("sudo probe %d backtrace" % proc.pid)
        assert followed.code == 0 and "idle_loop" in followed.out, followed.err
        if GDB:
            followed = _follow(_hints(as_nobody(str(proc.pid), "inject").err)[0])
            assert followed.code == 0 and "agent started" in followed.out, followed.err
            assert run_cli(str(proc.pid), "health").code == 0
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


@needs_root
def test_a_process_of_nobody_seen_by_a_third_user_names_its_owner():
    """A target started as nobody; the command run as a third user (uid 1) is refused with ``sudo -u
    nobody``; run as root (what sudo gives), it reads the process."""
    folder = tempfile.mkdtemp(prefix="probe-nobody-target-")
    os.chmod(folder, 0o755)
    script = os.path.join(folder, "sleeper.py")
    with open(script, "w") as handle:
        handle.write("import os, time\nprint('READY', os.getpid(), flush=True)\ntime.sleep(600)\n")
    os.chmod(script, 0o644)
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    popen = subprocess.Popen([python, script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/",
                             preexec_fn=lambda: (os.setgroups([]), os.setgid(NOBODY), os.setuid(NOBODY)))
    proc = Proc(popen, "sleeper.py")
    as_daemon, runtime = _cli_as(1)
    try:
        try:
            assert proc.read_line(30).startswith("READY")
        except RuntimeError as exc:
            pytest.skip("user nobody cannot run %s: %s" % (python, exc))
        result = as_daemon(str(proc.pid), "backtrace")
        assert result.code == 4 and "another user's process" in result.err, result.err
        assert _hints(result.err)[0] == "sudo -u nobody probe %d backtrace" % popen.pid
        followed = _follow(_hints(result.err)[0])  # as root, which may read any user's process
        assert followed.code == 0 and "sleeper.py" in followed.out, followed.err
    finally:
        stop(popen)
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------- a stopped process, native frames

def test_native_backtrace_of_a_stopped_process_is_read_and_it_stays_stopped(target_factory):
    proc = target_factory("idle.py")
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + scaled(5)
        while _state(proc.pid) != "T":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        result = run_cli(str(proc.pid), "backtrace", "--native")
        assert result.code == 0, result.err
        assert "[C]" in result.out and "main_sleep" in result.out
        assert "stopped process" in result.err and "kill -CONT %d" % proc.pid in result.err
        assert _state(proc.pid) == "T", "reading it resumed a process the user had stopped"
        sql = run_cli(str(proc.pid), "query", "--native",
                      "SELECT count(*) AS n FROM python.backtrace WHERE frame_type = 'native'", "-f", "json")
        assert sql.code == 0 and '"n": 0' not in sql.out, sql.err
    finally:
        os.kill(proc.pid, signal.SIGCONT)


# ---------------------------------------------------------------- PROBE=1 where probe is not installed

def _other_python() -> str:
    for version in ("3.12", "3.10", "3.13", "3.9"):
        python = pyenv_python(version)
        if python and subprocess.run([python, "-c", "import probe"], capture_output=True, cwd="/",
                                     env={"PATH": "/usr/bin:/bin"}).returncode != 0:
            return python
    return ""


@pytest.mark.skipif(not _other_python(), reason="no second interpreter without probe installed")
@pytest.mark.skipif(not GDB, reason="inject needs gdb")
def test_probe1_under_an_interpreter_without_probe_says_so_and_inject_works(target_factory):
    python = _other_python()
    env = target_env(probe=True)
    env.pop("PYTHONPATH", None)
    proc = target_factory("inject_sleeping.py", python=python, env=env, wait_socket=False)
    result = run_cli(str(proc.pid), "health")
    assert result.code == 3
    assert "PROBE=1 is set" in result.err and "probe is not installed for its interpreter %s" % python in result.err
    assert "start it with PROBE=1" not in result.err and "start the program with PROBE=1" not in result.err
    hint = _hints(result.err)[0]
    assert hint == "probe %d inject" % proc.pid
    followed = _follow(hint)
    assert followed.code == 0 and "agent started" in followed.out, followed.err
    assert run_cli(str(proc.pid), "health").code == 0


# ---------------------------------------------------------------- a C call that keeps the GIL

def _in_sleep_call(pid: int) -> bool:
    """Whether the main thread is in its sleep system call (READY is printed a moment before the call)."""
    try:
        with open("/proc/%d/task/%d/syscall" % (pid, pid)) as handle:
            return handle.read().split()[0] in ("35", "230")  # nanosleep, clock_nanosleep (x86-64)
    except (OSError, IndexError):
        return False


def test_a_gil_held_process_without_agent_is_not_told_to_inject(target_factory):
    proc = target_factory("gil_sleep.py", probe=False)
    deadline = time.monotonic() + scaled(10)
    while not _in_sleep_call(proc.pid) and time.monotonic() < deadline:  # the handshake: inside the C call
        time.sleep(0.02)
    for _ in range(3):  # on a loaded machine a read from outside may time out once: the words then say less
        result = run_cli(str(proc.pid), "health")
        if "holds the GIL" in result.err:
            break
    assert result.code == 3
    assert "holds the GIL" in result.err and "injecting one cannot work until that call returns" in result.err, result.err
    assert "inject` starts" not in result.err and "PROBE=1" not in result.err
    for hint in _hints(result.err):  # backtrace, and backtrace --native
        followed = _follow(hint)
        assert followed.code == 0 and "gil_sleep.py" in followed.out, (hint, followed.err)
    if GDB:  # told it cannot work: inject says why, without a data symbol or a timeout that cannot help
        injected = run_cli(str(proc.pid), "inject", "--timeout", "3")
        assert injected.code == 6
        assert "needs the GIL" in injected.err and "until that call returns" in injected.err, injected.err
        assert "_PyRuntime" not in injected.err and "longer --timeout" not in injected.err
        followed = _follow(_hints(injected.err)[-1])  # backtrace, from outside
        assert followed.code == 0 and "gil_sleep.py" in followed.out
        # The start stays queued in the target: health says so (not "inject starts one"), and its hint works.
        queued = run_cli(str(proc.pid), "health")
        assert queued.code == 3 and "the start that `probe %d inject` queued" % proc.pid in queued.err, queued.err
        assert "inject` starts" not in queued.err and "holds the GIL" in queued.err, queued.err
        followed = _follow(_hints(queued.err)[-1])
        assert followed.code == 0 and "gil_sleep.py" in followed.out, followed.err


@pytest.mark.skipif(not GDB, reason="inject needs gdb")
def test_a_start_queued_behind_a_c_call_runs_when_the_call_returns_and_health_answers(target_factory):
    proc = target_factory("gil_sleep.py", "10", "then-idle", probe=False)
    injected = run_cli(str(proc.pid), "inject", "--timeout", "2")
    assert injected.code == 6 and "queued" in injected.err, injected.err
    said = run_cli(str(proc.pid), "health")
    assert said.code in (0, 3), said.err
    if said.code == 3:  # the call has not returned yet
        assert "queued" in said.err and "has not run" in said.err, said.err
    deadline = time.monotonic() + scaled(60)
    while said.code != 0:
        assert time.monotonic() < deadline, said.err
        time.sleep(0.2)
        said = run_cli(str(proc.pid), "health")
    assert "pid %d" % proc.pid in said.out, said.out


# ---------------------------------------------------------------- Python 3.8

@pytest.mark.skipif(not pyenv_python("3.8"), reason="no Python 3.8 here")
def test_python_38_is_told_what_works_and_never_to_inject(target_factory):
    proc = target_factory("inject_sleeping.py", python=pyenv_python("3.8"), probe=False)
    for command in ("health", "eval"):
        result = run_cli(str(proc.pid), command, *(["1"] if command == "eval" else []))
        assert result.code == 3 and "Python 3.8" in result.err and "inject" not in result.err, result.err
        hint = _hints(result.err)[0]
        followed = _follow(hint)
        assert followed.code == 0 and "idle_loop" in followed.out, followed.err
    injected = run_cli(str(proc.pid), "inject")
    assert injected.code == 6 and "3.9 or newer" in injected.err
    assert _hints(injected.err) == ["probe %d backtrace" % proc.pid], injected.err


# ---------------------------------------------------------------- where the agent's socket is

def test_an_agent_in_another_runtime_directory_is_pointed_at(target_factory, tmp_path):
    other = tmp_path / "rt"
    other.mkdir(mode=0o700)
    proc = target_factory("idle.py", env=target_env(PROBE_RUNTIME_DIR=str(other)), wait_socket=False)
    socket = str(other / ("%d.sock" % proc.pid))
    deadline = time.monotonic() + scaled(20)
    while not os.path.exists(socket):
        assert time.monotonic() < deadline, "no agent socket in %s" % other
        time.sleep(0.02)
    result = run_cli(str(proc.pid), "health")
    assert result.code == 3 and socket in result.err, result.err
    hint = _hints(result.err)[0]
    assert hint == "probe unix:%s health" % socket
    followed = _follow(hint)
    assert followed.code == 0 and "pid %d" % proc.pid in followed.out, followed.err


# ---------------------------------------------------------------- a table that needs the agent

@pytest.mark.skipif(not GDB, reason="inject needs gdb")
def test_a_table_that_needs_the_agent_says_how_to_get_one(target_factory):
    proc = target_factory("inject_sleeping.py", probe=False)
    result = run_cli(str(proc.pid), "query", "SELECT count(*) AS n FROM python.threads")
    assert result.code == 3 and "python.threads needs the agent" in result.err
    hint = _hints(result.err)[0]
    assert hint == "probe %d inject" % proc.pid, result.err
    assert _follow(hint).code == 0
    again = run_cli(str(proc.pid), "query", "SELECT count(*) AS n FROM python.threads", "-f", "json")
    assert again.code == 0, again.err


# ---------------------------------------------------------------- an agent's own hints

def test_an_agents_hint_names_the_real_target(idle_target):
    result = run_cli(str(idle_target.pid), "schema", "python.nosuch")
    assert result.code == 2 and "TARGET" not in result.err, result.err  # a table not there: a bad request
    hint = _hints(result.err)[0]
    assert hint == "probe %d tables" % idle_target.pid
    followed = _follow(hint)
    assert followed.code == 0 and "python.backtrace" in followed.out


# ---------------------------------------------------------------- torchrun's launcher

TORCHRUN = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")


@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun (torch) is not installed")
def test_torchruns_launcher_is_told_the_ranks_command_with_its_address():
    from test_torchrun import _free_port_pair
    from torch_job import ready_lines, stop_launcher

    port = _free_port_pair()
    env = target_env(PROBE="1", PROBE_PORT="127.0.0.1:%d" % port)
    launcher = subprocess.Popen([TORCHRUN, "--nproc_per_node=2", "--master_port=%d" % _free_port_pair(),
                                 os.path.join(TARGETS, "rank.py")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, start_new_session=True)
    try:
        ranks = sorted(int(words[1]) for words in ready_lines(Proc(launcher, "torchrun"), 2,
                                                              time.monotonic() + scaled(90)))
        result = run_cli(str(launcher.pid), "health")
        assert result.code == 3 and "torchrun's launcher" in result.err, result.err
        assert "inject" not in result.err and "PROBE=1" not in result.err
        hints = _hints(result.err)
        assert hints == ["probe 127.0.0.1:%d ranks" % port, "probe 127.0.0.1:%d --all-ranks health" % port]
        listed = _follow(hints[0] + " -f json")
        assert listed.code == 0, listed.err
        assert sorted(int(pid) for pid in re.findall(r'"pid": (\d+)', listed.out)) == ranks
        every = _follow(hints[1])
        assert every.code == 0 and all("pid %d" % pid in every.out for pid in ranks), every.err
    finally:
        stop_launcher(launcher)
