"""The injector against real processes in every state a training rank can be in.

Each test starts a target (``tests/targets/inject_*.py``) with no agent, waits for its ``READY`` line,
injects, then checks that the agent answers, that the target is alive and that nothing traces it.
The rules that pick a method are tested on hand-built thread states first (no process needed).
"""

import os
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Optional

import pytest

import probe
from probe.errors import InjectError, ProcessDead
from probe.injector import diagnose, inject
from probe.injector.bootstrap_line import bootstrap_code, exposure_dir
from probe.injector.diagnose import _version_problems
from probe.injector.methods import GIL_ENSURE, PENDING, attach_and_look, plan, run_plan
from probe.injector.target import TargetInfo, read_target
from probe.injector.threads import Frame, ThreadState, parse_backtraces, parse_gil_checks
from procs import PYENV, pyenv_python, run_cli, target_env

VERSIONS = ["3.9", "3.10", "3.11", "3.12", "3.13"]


# ---------------------------------------------------------------- capabilities

def _ptrace_blocker() -> Optional[str]:
    """Why this host cannot inject (gdb missing, ptrace refused), or None; checked on a real child."""
    if shutil.which("gdb") is None:
        return "gdb is not installed (apt-get install gdb)"
    child = subprocess.Popen(["sleep", "30"])
    try:
        from probe.injector.diagnose import ptrace_problems

        info = TargetInfo(child.pid, "/bin/sleep", os.getuid(), None, True, (3, 11))
        problems = ptrace_problems(info)
        return problems[0].message if problems else None
    finally:
        child.kill()
        child.wait(5)


_BLOCKER = _ptrace_blocker() if sys.platform.startswith("linux") else "injection needs Linux"
needs_ptrace = pytest.mark.skipif(_BLOCKER is not None, reason=str(_BLOCKER))


def _no_probe_env(**extra: str) -> Dict[str, str]:
    """The target's own environment must not provide probe: the injector has to expose it."""
    env = target_env(probe=False, **extra)
    env.pop("PYTHONPATH", None)
    return env


def _tracer(pid: int) -> int:
    with open("/proc/%d/status" % pid) as handle:
        for line in handle:
            if line.startswith("TracerPid:"):
                return int(line.split()[1])
    raise AssertionError("no TracerPid line")


def _assert_served_and_untouched(proc, result=None) -> Dict[str, object]:
    assert proc.alive(), "the target died: %s" % (proc.popen.stderr.read() if proc.popen.poll() is not None else "")
    assert _tracer(proc.pid) == 0, "the target is still traced"
    path = result.socket_path if result is not None else None
    health = probe.connect("unix:" + path if path else str(proc.pid)).health()
    assert health["pid"] == proc.pid
    return health


@pytest.fixture
def start(target_factory):
    """Start an injection target without an agent and without probe on its path."""
    def _start(script: str, *args: str, python: str = sys.executable, env: Optional[Dict[str, str]] = None):
        return target_factory(script, *args, probe=False, python=python, env=env or _no_probe_env())
    return _start


# ---------------------------------------------------------------- rules, no process

def _thread(num: int, lwp: int, funcs: List[str], gil: Optional[bool]) -> ThreadState:
    return ThreadState(num, lwp, "python", tuple(Frame(f) for f in funcs), gil)


EVENT_WAIT = ["__futex_abstimed_wait_common", "do_futex_wait", "__new_sem_wait_slow64", "PyThread_acquire_lock_timed",
              "acquire_timed", "lock_PyThread_acquire_lock", "method_vectorcall_VARARGS_KEYWORDS"]
BYTECODE = ["_Py_dict_lookup", "_PyEval_EvalFrameDefault", "_PyEval_Vector"]
C_CALL = ["rangeiter_next", "PyIter_Next", "builtin_sum_impl", "builtin_sum", "cfunction_vectorcall_FASTCALL",
          "_PyEval_EvalFrameDefault"]


def test_plan_busy_main_gets_a_pending_call():
    chosen = plan([_thread(1, 100, BYTECODE, True), _thread(2, 101, EVENT_WAIT, False)], 100)
    assert chosen.method == PENDING and chosen.delay is None and chosen.thread.num == 1


def test_plan_blocked_main_runs_on_itself_when_the_gil_is_free():
    chosen = plan([_thread(1, 100, EVENT_WAIT, False), _thread(2, 101, BYTECODE, True)], 100)
    assert (chosen.method, chosen.thread.num) == (GIL_ENSURE, 1)


def test_plan_never_waits_for_a_gil_held_in_c():
    chosen = plan([_thread(1, 100, EVENT_WAIT, False), _thread(2, 101, C_CALL, True)], 100)
    assert chosen.method == PENDING and "holds the GIL inside a C call" in chosen.delay


def test_plan_main_in_long_c_call_is_reported():
    chosen = plan([_thread(1, 100, C_CALL, True)], 100)
    assert chosen.method == PENDING and "builtin_sum" in chosen.delay


@pytest.mark.parametrize("drop", [
    ["__futex_abstimed_wait_common", "pthread_cond_wait", "drop_gil", "eval_frame_handle_pending",
     "_PyEval_EvalFrameDefault"],  # 3.11: a forced switch waits until the asking thread has the GIL
    ["pthread_cond_signal", "drop_gil", "_PyEval_ReleaseLock", "_PyThreadState_Detach", "_Py_HandlePending",
     "_PyEval_EvalFrameDefault"],  # 3.13's names
    ["pthread_mutex_lock", "drop_gil", "_PyEval_EvalFrameDefault"]])  # the handler inlined out of sight
def test_plan_main_handing_the_gil_over_gets_a_pending_call(drop):
    """Between two bytecodes the busy main thread gives the GIL to a thread that asked for it: no thread
    holds it, and the main thread is back in bytecode within a switch interval."""
    chosen = plan([_thread(1, 100, drop, False), _thread(2, 101, EVENT_WAIT, False)], 100)
    assert chosen.method == PENDING and chosen.delay is None


def test_plan_a_c_call_releasing_the_gil_is_no_switch():
    releasing = ["pthread_cond_signal", "drop_gil", "PyEval_SaveThread", "time_sleep", "cfunction_vectorcall_O",
                 "_PyEval_EvalFrameDefault"]
    chosen = plan([_thread(1, 100, releasing, False), _thread(2, 101, EVENT_WAIT, False)], 100)
    assert chosen.method == GIL_ENSURE and chosen.thread.num == 2


def test_plan_does_not_trust_unknown_waits():
    malloc_lock = ["__lll_lock_wait_private", "_int_malloc", "malloc", "some_extension_call"]
    chosen = plan([_thread(1, 100, malloc_lock, False)], 100)
    assert chosen.method == PENDING and chosen.delay


def test_parse_gdb_output():
    text = ('Thread 2 (Thread 0x7f (LWP 11) "worker"):\n#0  0x1 in __futex_abstimed_wait_common () from libc\n'
            '#1  0x2 in PyThread_acquire_lock_timed (lock=0x1) at Python/thread_pthread.h:497\n\n'
            'Thread 1 (Thread 0x7e (LWP 10) "python"):\n#0  _PyEval_EvalFrameDefault (tstate=0x0) at ceval.c:1\n')
    threads = parse_backtraces(text)
    assert [(t.num, t.lwp, t.name, t.funcs()[0]) for t in threads] == [
        (2, 11, "worker", "__futex_abstimed_wait_common"), (1, 10, "python", "_PyEval_EvalFrameDefault")]
    assert parse_gil_checks('\nThread 2 (Thread 0x7f (LWP 11) "w"):\n$1 = 0\n\nThread 1 (LWP 10):\n$2 = 1\n') == {
        2: False, 1: True}


def test_bootstrap_binds_nothing_and_swallows_errors():
    code = bootstrap_code('{"listen": null}', "/nonexistent-dir")
    namespace: Dict[str, object] = {}
    saved = sys.modules.pop("probe.agent.bootstrap", None)
    try:
        exec(compile(code.replace("probe.agent.bootstrap", "probe_missing_module"), "<bootstrap>", "exec"), namespace)
    finally:
        if saved is not None:
            sys.modules["probe.agent.bootstrap"] = saved
    assert set(namespace) == {"__builtins__"} and "/nonexistent-dir" not in sys.path


def test_exposure_dir_holds_only_this_package():
    path = exposure_dir(os.getuid())
    assert os.listdir(path) == ["probe"]
    assert os.path.realpath(os.path.join(path, "probe")) == os.path.dirname(os.path.realpath(probe.__file__))


# ---------------------------------------------------------------- diagnoses

def test_diagnose_no_such_process():
    with pytest.raises(ProcessDead) as info:  # as every command says it (exit 3), not an injection failure
        inject(2 ** 22 + 12345, timeout=2)
    assert "no process" in info.value.message and info.value.hint


def test_diagnose_not_python():
    child = subprocess.Popen(["sleep", "30"])
    try:
        problems = diagnose(child.pid)
        assert [p.code for p in problems] == ["not_python"]
        with pytest.raises(InjectError, match="not a Python interpreter"):
            inject(child.pid, timeout=2)
    finally:
        child.kill()
        child.wait(5)


def test_diagnose_old_python():
    info = TargetInfo(1, "/usr/bin/python3.8", 0, None, True, (3, 8))
    assert [p.code for p in _version_problems(info)] == ["old_python"]
    assert "3.9" in _version_problems(info)[0].message


def test_diagnose_gdb_missing_says_how_to_install_it(start):
    proc = start("inject_sleeping.py")
    env = target_env(probe=False, PATH="/nonexistent")  # no gdb to be found
    result = run_cli(str(proc.pid), "inject", env=env)
    assert result.code == 6
    assert "gdb is not installed" in result.err and "apt-get install gdb" in result.err
    assert proc.alive()


@needs_ptrace
def test_diagnose_a_process_traced_by_another_debugger(start):
    proc = start("inject_sleeping.py")
    holder = subprocess.Popen(["gdb", "-nx", "-batch", "-p", str(proc.pid), "-ex", "shell read line"],
                              stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while _tracer(proc.pid) != holder.pid:
            assert time.monotonic() < deadline, "gdb did not attach"
            time.sleep(0.05)
        result = run_cli(str(proc.pid), "inject")
        assert result.code == 6
        assert "already traced by pid %d (gdb)" % holder.pid in result.err and "detach" in result.err
    finally:
        holder.communicate(b"\n", timeout=20)
    assert proc.alive()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run the CLI as another user")
def test_diagnose_another_users_process(start):
    proc = start("inject_sleeping.py")

    def as_nobody() -> None:
        os.setgid(65534)
        os.setuid(65534)

    env = target_env(probe=False, PROBE_RUNTIME_DIR="/tmp", HOME="/tmp")
    try:
        done = subprocess.run([sys.executable, "-m", "probe", str(proc.pid), "inject"], capture_output=True,
                              text=True, env=env, cwd="/", preexec_fn=as_nobody, timeout=60)
    except PermissionError as exc:
        pytest.skip("user nobody cannot run this Python (%s)" % exc)
    if "No module named" in done.stderr:
        pytest.skip("user nobody cannot read this checkout: %s" % done.stderr.strip()[-200:])
    assert done.returncode == 4, done.stderr  # refused, as every command refuses another user's process
    assert "belongs to uid 0, and probe runs as uid 65534" in done.stderr
    assert "sudo probe %d inject" % proc.pid in done.stderr
    assert proc.alive() and _tracer(proc.pid) == 0


# ---------------------------------------------------------------- injection, real targets

@needs_ptrace
def test_inject_sleeping_target(start):
    proc = start("inject_sleeping.py")
    result = inject(proc.pid, timeout=10)
    assert result.method == PENDING and not result.already_attached
    _assert_served_and_untouched(proc, result)
    again = inject(proc.pid, timeout=10)
    assert again.already_attached and again.method == "none"


@needs_ptrace
def test_attach_from_python_returns_a_connected_client(start):
    proc = start("inject_sleeping.py")
    client = probe.attach(proc.pid, timeout=15, eval_enabled=False)
    assert client.health()["pid"] == proc.pid
    assert client.health()["capabilities"]["eval"] is False  # options reach the agent
    assert any(f.func == "idle_loop" for f in client.backtrace())
    with pytest.raises(probe.ProbeError) as refused:
        client.eval("1")
    assert refused.value.code == "forbidden"
    again = probe.attach(proc.pid, timeout=15)  # already attached: the same agent answers
    assert again.health()["pid"] == proc.pid
    _assert_served_and_untouched(proc)


@needs_ptrace
def test_inject_busy_target_repeatedly_never_crashes(start):
    proc = start("inject_busy.py")
    result = inject(proc.pid, timeout=10)
    assert result.method == PENDING
    _assert_served_and_untouched(proc, result)
    info = read_target(proc.pid)
    code = bootstrap_code("", exposure_dir(info.uid))
    for _ in range(8):  # the agent runs already: each round attaches, schedules a no-op start, detaches
        session, threads = attach_and_look(info, time.monotonic() + 10)
        chosen = plan(threads, proc.pid)
        if chosen.method != PENDING:  # the busy main thread holds the GIL or hands it over: never re-entrantly
            session.detach()  # a traced target would outlive the test's SIGKILL until gdb reaped it
            pytest.fail("%s chosen for %r" % (chosen.method, threads))
        run_plan(session, chosen, code, time.monotonic() + 10)
        assert proc.alive() and _tracer(proc.pid) == 0
    time.sleep(0.3)  # let the last queued no-op start run on the main thread
    _assert_served_and_untouched(proc, result)


@needs_ptrace
@pytest.mark.parametrize("round_", range(3))
def test_inject_fresh_busy_targets(start, round_):
    proc = start("inject_busy.py")
    _assert_served_and_untouched(proc, inject(proc.pid, timeout=10))


@needs_ptrace
@pytest.mark.parametrize("mode", ["event", "lock", "sleep", "queue"])
def test_inject_main_thread_blocked_in_c(start, mode):
    proc = start("inject_blocked.py", mode)
    result = inject(proc.pid, timeout=10)
    assert result.method == GIL_ENSURE  # a pending call would wait forever here
    _assert_served_and_untouched(proc, result)


@needs_ptrace
def test_inject_waits_for_a_short_c_call_holding_the_gil(start):
    proc = start("inject_c_call.py", "1.5")
    result = inject(proc.pid, timeout=15)
    assert result.method == PENDING
    _assert_served_and_untouched(proc, result)


@needs_ptrace
def test_inject_gives_up_on_a_long_c_call_and_starts_later(start):
    # The call outlasts the timeout by a wide margin, and the timeout leaves gdb room to start on a
    # loaded machine: what is tested is the diagnosis and the bound, not gdb's speed.
    proc = start("inject_c_call.py", "9")
    began = time.monotonic()
    with pytest.raises(InjectError) as info:
        inject(proc.pid, timeout=3.0)
    assert time.monotonic() - began < 6.0
    assert "holds the GIL" in info.value.message and "builtin_sum" in info.value.message
    assert "queued" in (info.value.hint or "")
    assert proc.alive() and _tracer(proc.pid) == 0
    assert proc.read_line(timeout=20) == "RETURNED"
    deadline = time.monotonic() + 10
    while not inject(proc.pid, timeout=10).already_attached:  # the queued start ran, so no second injection
        assert time.monotonic() < deadline
    _assert_served_and_untouched(proc)


@needs_ptrace
def test_inject_fifty_threads(start):
    proc = start("inject_threads.py", "50")
    result = inject(proc.pid, timeout=20)
    health = _assert_served_and_untouched(proc, result)
    assert health["pid"] == proc.pid


@needs_ptrace
def test_inject_torch_process(start):
    pytest.importorskip("torch", reason="torch is not installed")
    proc = start("inject_torch.py", env=_no_probe_env(OMP_NUM_THREADS="2"))
    result = inject(proc.pid, timeout=15)
    _assert_served_and_untouched(proc, result)


@needs_ptrace
def test_already_attached_changes_nothing(target_factory):
    proc = target_factory("inject_agent.py", probe=False, env=target_env(probe=False))
    result = inject(proc.pid, timeout=5)
    assert result.already_attached and result.method == "none"
    assert _tracer(proc.pid) == 0


@needs_ptrace
@pytest.mark.parametrize("version", VERSIONS)
def test_inject_each_cpython(start, version):
    python = pyenv_python(version)
    if not python:
        pytest.skip("CPython %s is not installed under %s" % (version, PYENV))
    proc = start("inject_blocked.py", "event", python=python)
    pid = str(proc.pid)
    attached = run_cli(pid, "inject", "--timeout", "15")  # the CLI itself runs on this test's Python
    assert attached.code == 0, attached.err
    health = _assert_served_and_untouched(proc)
    assert str(health["python"]).startswith(version + ".")
    backtrace = run_cli(pid, "backtrace")
    assert backtrace.code == 0 and "block (" in backtrace.out and "inject_blocked.py" in backtrace.out
    query = run_cli(pid, "query", "SELECT count(*) AS n FROM python.backtrace WHERE func LIKE '%block'", "-f", "csv")
    assert (query.code, query.out.split()) == (0, ["n", "1"]), query.err
    evaluated = run_cli(pid, "eval", "import sys; sys.version_info[:2]")
    assert (evaluated.code, evaluated.out.strip()) == (0, str(tuple(int(p) for p in version.split("."))))


@needs_ptrace
def test_inject_into_an_environment_without_duckdb(start):
    python = pyenv_python("3.12")
    if not python:
        pytest.skip("CPython 3.12 is not installed under %s" % PYENV)
    lacks = subprocess.run([python, "-c", "import duckdb"], capture_output=True, timeout=30).returncode != 0
    if not lacks:
        pytest.skip("this 3.12 has duckdb; the case needs an environment without it")
    proc = start("inject_sleeping.py", python=python)
    result = inject(proc.pid, timeout=15)
    _assert_served_and_untouched(proc, result)
    client = probe.connect("unix:" + result.socket_path)
    assert any(f.func == "idle_loop" for f in client.backtrace())
    assert client.health()["capabilities"]["sql"] is False
    # SQL still works: the client runs it over the table data it fetches
    rows = client.query_rows("SELECT count(*) FROM python.backtrace WHERE func = 'idle_loop'")
    assert rows.rows == [[1]]
    assert client.eval("6 * 7").value == "42"
    assert "python.backtrace" in {t.name for t in client.tables()}
