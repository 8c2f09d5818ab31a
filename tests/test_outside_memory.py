"""probe's own reader of a process's stacks from its memory (probe/reader/memory.py, issue 37 item 5): the
same threads, names, idents and frames as py-spy reads; its symbol cache kept owner-only and trusted no
further than what it reads from the target; and where it cannot be sure (a thread running, an interpreter
it does not read, a cache that lies), it gives way to py-spy, so the command's answer never changes."""

import json
import os
import subprocess
import sys
import time

import pytest

from procs import REPO, pyenv_python, run_cli, scaled, target_env

from probe.reader import memory, pyspy_source

pytestmark = pytest.mark.skipif(sys.version_info[:2] != (3, 11) or sys.platform != "linux",
                                reason="the memory reader reads CPython 3.11 on Linux")

BENCH_TARGET = os.path.join(REPO, "bench", "targets", "nested.py")


def _pyspy(pid):
    exe = pyspy_source.binary()
    if exe is None:
        pytest.skip("py-spy is not installed")
    done = subprocess.run([exe, "dump", "--json", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [(t["os_thread_id"], t["thread_id"], t["thread_name"], t["os_thread_id"] == pid,
             [(f["name"], f["filename"], f["line"]) for f in t["frames"]]) for t in json.loads(done.stdout)]


def _own(pid, directory):
    """The reader's threads, tried until it reads (a thread of the target may be running at a try)."""
    deadline = time.monotonic() + scaled(10)
    while time.monotonic() < deadline:
        threads = memory.read_threads(pid, directory)
        if threads is not None:
            return [(n, i, name, m, [tuple(f) for f in frames]) for n, i, name, m, frames in threads]
        time.sleep(0.05)
    raise AssertionError("the reader never read process %d" % pid)


def test_the_reader_sees_what_py_spy_sees(target_factory, tmp_path):
    """Named threads (threading's), qualified names, lines, the interpreter's thread order: py-spy's."""
    idle = target_factory("idle.py", probe=False, wait_socket=False)
    assert _own(idle.pid, str(tmp_path)) == _pyspy(idle.pid)
    wide = target_factory("unicode_names.py", probe=False, wait_socket=False)
    mine = _own(wide.pid, str(tmp_path))
    assert sorted(name for _, _, name, _, _ in mine) == ["main-renamed", "naïve", "スレッド😀"]
    assert mine == _pyspy(wide.pid)
    spawned = subprocess.Popen([sys.executable, BENCH_TARGET, "--threads", "3"], stdout=subprocess.PIPE,
                               env=target_env(probe=False))
    try:
        assert spawned.stdout.readline().startswith(b"READY")
        mine = _own(spawned.pid, str(tmp_path))
        assert [name for _, _, name, _, _ in mine] != [] and mine == _pyspy(spawned.pid)
        assert any(func == "Thread.run" for _, _, _, _, frames in mine for func, _, _ in frames)
    finally:
        spawned.kill()
        spawned.wait()


def test_the_symbol_cache_is_the_users_own_and_checked_when_read(target_factory, tmp_path):
    proc = target_factory("idle.py", probe=False, wait_socket=False)
    right = _own(proc.pid, str(tmp_path))
    cache = tmp_path / memory.CACHE_NAME
    assert cache.exists() and cache.stat().st_mode & 0o777 == 0o600
    lines = cache.read_text().splitlines()
    assert len(lines) == 1 and "python3.11" in lines[0], lines
    key = lines[0].rpartition("\0=")[0]
    assert _own(proc.pid, str(tmp_path)) == right  # read back
    # offsets that lie (within the file, or far off) are caught by what they point at: no read, never a wrong one
    for numbers in ("0,64,64", "0,4096,8192", "0,99999999999,5", "1,2,3"):
        cache.write_text("%s\0=%s\n" % (key, numbers))
        cache.chmod(0o600)
        read = memory.read_threads(proc.pid, str(tmp_path))
        assert read is None or [(n, i, name, m, [tuple(f) for f in frames]) for n, i, name, m, frames in read] == right
    for text in ("garbage\n", "%s\0=-1,2,3\n" % key, "%s\0=1,2\n" % key, "\0\0\0=\n" * 50):
        cache.write_text(text)
        cache.chmod(0o600)
        assert _own(proc.pid, str(tmp_path)) == right  # not parsed: the symbols are read again
    cache.write_text("%s\0=0,64,64\n" % key)
    cache.chmod(0o644)  # open to others: not the user's own file, not read
    assert _own(proc.pid, str(tmp_path)) == right


def test_a_process_running_python_is_left_to_py_spy(target_factory, tmp_path):
    """Its threads never all sleep through a read: the reader gives way, and py-spy stops it to read."""
    proc = target_factory("mutual_recursion.py", probe=False, wait_socket=False)
    assert all(memory.read_threads(proc.pid, str(tmp_path)) is None for _ in range(5))
    result = run_cli(str(proc.pid), "backtrace")
    assert result.code == 0 and "by py-spy, which stopped it for the read" in result.err, result.err


def test_a_lying_cache_leaves_the_command_its_answer(target_factory):
    """``probe PID backtrace`` with a cache whose offsets point elsewhere: py-spy's read, the same stacks."""
    proc = target_factory("idle.py", probe=False, wait_socket=False)
    for _ in range(5):  # a thread of the target may run through every try of a read: py-spy reads then
        right = run_cli(str(proc.pid), "backtrace")
        if "by probe" in right.err:
            break
    assert right.code == 0 and "by probe, none of its threads running" in right.err, right.err
    directory = os.environ["PROBE_RUNTIME_DIR"]
    cache = os.path.join(directory, memory.CACHE_NAME)
    with open(cache) as handle:
        lines = handle.read().splitlines()
    with open(cache, "w") as handle:
        handle.write("\n".join(line.rpartition("\0=")[0] + "\0=0,4096,8192" for line in lines) + "\n")
    try:
        lied = run_cli(str(proc.pid), "backtrace")
    finally:
        os.unlink(cache)
    assert lied.code == 0 and "by py-spy" in lied.err, lied.err
    assert lied.out == right.out


def test_not_python_and_no_process_say_what_they_said(target_factory):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        result = run_cli(str(sleeper.pid), "backtrace")
        usual = run_cli(str(sleeper.pid), "backtrace", env=target_env(probe=False, PROBE_CLI_FAST="0"))
    finally:
        sleeper.kill()
        sleeper.wait()
    assert result.code != 0 and "is not a Python interpreter" in result.err, result.err
    assert (result.code, result.out, result.err) == (usual.code, usual.out, usual.err)
    result = run_cli(str(sleeper.pid), "backtrace")
    assert result.code != 0 and "no process with pid %d" % sleeper.pid in result.err, result.err


@pytest.mark.parametrize("version", ["3.10", "3.12"])
def test_another_interpreter_is_left_to_py_spy(version, target_factory, tmp_path):
    """The reader knows CPython 3.11's layout alone: another version says so by its Py_Version (or has none)."""
    python = pyenv_python(version)
    if not python:
        pytest.skip("no CPython %s here" % version)
    proc = target_factory("idle.py", probe=False, wait_socket=False, python=python)
    assert memory.read_threads(proc.pid, str(tmp_path)) is None
    result = run_cli(str(proc.pid), "backtrace")
    assert result.code == 0 and "by py-spy" in result.err and "main_sleep" in result.out, result.err
