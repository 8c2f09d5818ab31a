"""What the injector and ``probe list`` must never do to a process they inspect: run its binary, or
attach to it when it is stopped or gone. Real processes: a compiled impostor, SIGSTOP, a zombie."""

import os
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from procs import run_cli, target_env

from probe.injector.elf import python_version_of
from probe.injector.target import read_target
from probe.injector.xstate import needs_fix

IMPOSTOR_C = textwrap.dedent("""
    #include <stdio.h>
    #include <unistd.h>
    /* Looks like a static Python to a scanner: it names the C API probe looks for. */
    const char api[] = "Py_AddPendingCall";
    int main(int argc, char **argv) {
        if (argc > 1) {               /* run with arguments: somebody executed us */
            FILE *f = fopen(MARKER, "w");
            if (f) { fputs(api, f); fclose(f); }
            return 0;
        }
        printf("READY %d\\n", (int)getpid());
        fflush(stdout);
        for (;;) pause();
    }
""")


def _read_ready(popen: subprocess.Popen, timeout: float = 10.0) -> None:
    assert popen.stdout is not None
    ready, _, _ = select.select([popen.stdout], [], [], timeout)
    assert ready, "the target printed nothing within %.0f s" % timeout
    assert popen.stdout.readline().startswith(b"READY")


def _stop(popen: subprocess.Popen) -> None:
    if popen.poll() is None:
        popen.kill()
    popen.wait(10)
    if popen.stdout:
        popen.stdout.close()


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build the impostor")
def test_list_and_inject_never_execute_the_targets_binary(tmp_path):
    marker = tmp_path / "executed"
    binary = tmp_path / "python"  # a name that says python, and no version in it
    source = tmp_path / "impostor.c"
    source.write_text(IMPOSTOR_C)
    subprocess.run(["cc", "-o", str(binary), str(source), '-DMARKER="%s"' % marker], check=True, timeout=60)
    popen = subprocess.Popen([str(binary)], stdout=subprocess.PIPE)
    try:
        _read_ready(popen)
        assert read_target(popen.pid).is_python  # it does pass for an interpreter...
        listed = run_cli("list", "--json")
        injected = run_cli(str(popen.pid), "inject", "--timeout", "3")
        assert not marker.exists(), "probe executed the target's binary"  # ...but is never run
        assert listed.code == 0, listed.err
        assert injected.code == 6 and "Traceback" not in injected.err
        assert "cannot tell which Python version" in injected.err
    finally:
        _stop(popen)


@pytest.mark.parametrize("version", ["3.9", "3.10", "3.11", "3.12", "3.13"])
def test_python_version_read_from_the_file(version):
    from procs import pyenv_python

    python = pyenv_python(version)
    if not python:
        pytest.skip("CPython %s is not installed" % version)
    popen = subprocess.Popen([python, "-c", "import sys, time; print('READY', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE)
    try:
        _read_ready(popen)
        major, minor = map(int, version.split("."))
        assert read_target(popen.pid).version == (major, minor)
        info = read_target(popen.pid)
        library = info.libpython or "/proc/%d/exe" % popen.pid
        assert python_version_of(library) == (major, minor)
    finally:
        _stop(popen)


def test_inject_refuses_a_stopped_process():
    popen = subprocess.Popen([sys.executable, "-c", "import time; print('READY', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, env=target_env(probe=False))
    try:
        _read_ready(popen)
        os.kill(popen.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while _state(popen.pid) != "T":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        result = run_cli(str(popen.pid), "inject", "--timeout", "3")
        assert result.code == 6
        assert "is stopped" in result.err and "kill -CONT %d" % popen.pid in result.err
        assert _state(popen.pid) == "T"  # left as it was
        os.kill(popen.pid, signal.SIGCONT)
    finally:
        _stop(popen)


def test_inject_says_a_zombie_has_exited():
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, time
        child = os.fork()
        if child == 0:
            os._exit(0)
        print("READY", child, flush=True)
        time.sleep(60)      # never reaps the child
    """)], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        ready, _, _ = select.select([parent.stdout], [], [], 10)
        assert ready
        child = int(parent.stdout.readline().split()[1])
        deadline = time.monotonic() + 10
        while _state(child) != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        result = run_cli(str(child), "inject", "--timeout", "3")
        assert result.code == 6 and "has exited" in result.err and "Traceback" not in result.err
    finally:
        _stop(parent)


def _state(pid: int) -> str:
    with open("/proc/%d/stat" % pid, "rb") as handle:
        stat = handle.read()
    return stat[stat.rfind(b")") + 2:][:1].decode()


@pytest.mark.skipif(not needs_fix() or shutil.which("gdb") is None,
                    reason="only CPUs with register state gdb cannot write back (AMX) need probe's gdb fix")
def test_without_a_compiler_inject_refuses_rather_than_crash_the_target(tmp_path):
    only_gdb = tmp_path / "bin"
    only_gdb.mkdir()
    (only_gdb / "gdb").symlink_to(shutil.which("gdb"))  # gdb, and no C compiler
    popen = subprocess.Popen([sys.executable, "-c", "import time; print('READY', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, env=target_env(probe=False))
    try:
        _read_ready(popen)
        env = target_env(probe=False, PATH=str(only_gdb), XDG_CACHE_HOME=str(tmp_path / "cache"))
        result = run_cli(str(popen.pid), "inject", "--timeout", "5", env=env)
        assert result.code == 6 and "needs a C compiler" in result.err and "apt-get install gcc" in result.err
        assert popen.poll() is None  # untouched and alive
    finally:
        _stop(popen)
