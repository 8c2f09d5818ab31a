"""The outside reader on an interpreter that links libpython statically (Debian's /usr/bin/python3.11: the
symbols are in the executable itself, mapped at its fixed address), and the words where no reader can read
a process: that its stacks could not be read from outside, each reader's reason, and what would help."""

import os
import shutil
import subprocess
import sys
import time

import pytest

from procs import REPO, TARGETS, pyenv_python, run_cli, scaled, target_env

from probe.reader import memory, pyspy_source

pytestmark = pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64",
                                reason="the memory reader reads CPython 3.11 on Linux x86-64")

SYSTEM = "/usr/bin/python3"
TARGET = os.path.join(TARGETS, "plain_stdlib.py")
OWN_NOTE = "by probe, none of its threads running"


def _system_python() -> str:
    """Debian's python3 where it is CPython 3.11 (the version the memory reader reads), else skip."""
    if not os.path.exists(SYSTEM):
        pytest.skip("no %s here" % SYSTEM)
    done = subprocess.run([SYSTEM, "-c", "import sys; print(sys.implementation.name, *sys.version_info[:2])"],
                          capture_output=True, text=True, timeout=scaled(30))
    if done.stdout.split() != ["cpython", "3", "11"]:
        pytest.skip("%s is not CPython 3.11 (%s)" % (SYSTEM, done.stdout.strip() or done.stderr.strip()))
    return os.path.realpath(SYSTEM)


def _line(mark: str) -> int:
    with open(TARGET) as handle:
        return next(n for n, text in enumerate(handle, 1) if text.rstrip().endswith("# line: " + mark))


def _settled(pid, directory):
    """The reader's threads once the loader waits at its line (it may still be on its way at READY; a
    thread may run at a try): every thread as (name, frames outermost first)."""
    deadline = time.monotonic() + scaled(10)
    while time.monotonic() < deadline:
        threads, why = memory.read(pid, directory)
        if threads is not None:
            named = {name: [frame for frame in reversed(frames)] for _, _, name, _, frames in threads}
            if ("Loader.wait_for_batch", TARGET, _line("loader waits")) in named.get("loader-static", []):
                return threads, named
        time.sleep(0.05)
    raise AssertionError("the reader never read process %d: %s" % (pid, why))


def _spawn(python, args=(), **extra):
    popen = subprocess.Popen([python, TARGET, *args], stdout=subprocess.PIPE, env=target_env(probe=False, **extra))
    line = b""
    deadline = time.monotonic() + scaled(30)
    while not line.startswith(b"READY") and time.monotonic() < deadline and popen.poll() is None:
        line = popen.stdout.readline()
    if not line.startswith(b"READY"):
        popen.kill()
        popen.wait()
        raise AssertionError("the target did not start under %s" % python)
    return popen


def test_debian_python_is_read_from_its_memory(tmp_path):
    """Names, qualified names, files and lines of every thread of a process run by the system's python3,
    read by probe's memory reader (the note says so); the symbols' offsets kept for the executable itself,
    owner-only; the same threads as py-spy's read, where py-spy is installed."""
    python = _system_python()
    proc = _spawn(python)
    try:
        threads, named = _settled(proc.pid, str(tmp_path))
        assert sorted(named) == ["MainThread", "loader-static"]
        main = [(func, line) for func, path, line in named["MainThread"] if path == TARGET]
        assert main == [("<module>", _line("module calls")), ("outer", _line("outer calls")),
                        ("outer.<locals>.inner_sleep", _line("main sleeps"))]
        loader = named["loader-static"]
        assert [func for func, _, _ in loader[-2:]] == ["Event.wait", "Condition.wait"], loader
        assert loader[0][0] == "Thread._bootstrap" and loader[0][1].startswith("/usr/lib/python3.11/")
        assert [n for n, _, _, is_main, _ in threads if is_main] == [proc.pid]
        cache = tmp_path / memory.CACHE_NAME
        assert cache.stat().st_mode & 0o777 == 0o600
        assert [line.split("\0", 1)[0] for line in cache.read_text().splitlines()] == [python]
        if pyspy_source.binary() is not None:
            done = subprocess.run([pyspy_source.binary(), "dump", "--pid", str(proc.pid)], capture_output=True,
                                  text=True, timeout=scaled(60))
            assert done.returncode == 0 and "inner_sleep" in done.stdout, done.stderr
        for _ in range(10):  # a thread of the target may run through every try of a read: py-spy reads then
            result = run_cli(str(proc.pid), "backtrace")
            if OWN_NOTE in result.err:
                break
        assert result.code == 0 and OWN_NOTE in result.err, result.err
        assert "outer.<locals>.inner_sleep (%s:%d)" % (TARGET, _line("main sleeps")) in result.out, result.out
        assert "time.sleep(0.2)  # line: main sleeps" in result.out and '"loader-static"' in result.out
    finally:
        proc.kill()
        proc.wait()


def test_an_executable_replaced_since_it_started_is_read_through_proc(tmp_path):
    """A package upgrade replaces /usr/bin/python3.11 under a running process: its maps then name a deleted
    file, which the reader reads through /proc/PID/exe."""
    python = _system_python()
    copy = tmp_path / "bin" / "python3.11"
    copy.parent.mkdir()
    shutil.copy2(python, copy)
    proc = _spawn(str(copy))
    try:
        copy.unlink()
        _, named = _settled(proc.pid, str(tmp_path))
        assert ("outer.<locals>.inner_sleep", TARGET, _line("main sleeps")) in named["MainThread"]
    finally:
        proc.kill()
        proc.wait()


def _without_readers(tmp_path):
    """An environment for the CLI with neither py-spy (not beside its interpreter, not on PATH) nor pystack
    (a package of that name that fails to import stands first on its path, as where it is not installed)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink(os.path.realpath(sys.executable), bin_dir / "python3")
    hidden = tmp_path / "hidden" / "pystack"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('pystack is not installed for this test')\n")
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and not os.path.exists(os.path.join(d, "py-spy")))
    env = target_env(probe=False, PATH=path)
    env["PYTHONPATH"] = str(tmp_path / "hidden") + os.pathsep + REPO
    return str(bin_dir / "python3"), env


def _cli(python, env, *args):
    done = subprocess.run([python, "-m", "probe", *args], capture_output=True, text=True, timeout=scaled(60),
                          env=env, cwd=REPO)
    return done.returncode, done.stdout, done.stderr


def test_no_reader_says_that_the_stacks_could_not_be_read_and_why(tmp_path, target_factory):
    """A process the memory reader refuses (another version; a thread that runs Python), no py-spy, no
    pystack: the error says the stacks could not be read from outside, each reader's reason, and the hint
    (install py-spy, or start an agent); the exit is nonzero; the quick path and the usual one say the same."""
    python, env = _without_readers(tmp_path)
    inject = "; or `probe %d inject` starts one now (or start the program with PROBE=1"
    cases = [(target_factory("mutual_recursion.py", probe=False, wait_socket=False), "", inject)]
    other = pyenv_python("3.12") or pyenv_python("3.10")
    if other:
        version = os.path.basename(other)[len("python"):]
        cases.append((target_factory("idle.py", probe=False, wait_socket=False, python=other),
                      "it runs Python %s, and this reader reads CPython 3.11 alone" % version, inject))
    old = pyenv_python("3.8") or pyenv_python("3.7")
    if old:  # no agent can run there either: the hint is py-spy's alone (not the read from outside that failed)
        cases.append((target_factory("idle.py", probe=False, wait_socket=False, python=old),
                      "defines _PyRuntime but no Py_Version: a CPython older than 3.11", None))
    for proc, reason, then in cases:
        code, out, err = _cli(python, env, str(proc.pid), "backtrace")
        assert code != 0 and out == "", (code, out, err)
        assert "no agent in process %d" % proc.pid in err, err
        assert ", and its stacks could not be read from outside: probe's memory reader: " in err, err
        assert reason in err and "; py-spy: not installed; pystack: not installed" in err, err
        assert "`pip install py-spy` lets probe read them from outside" in err, err
        if then:
            assert then % proc.pid in err, err
        else:
            assert err.rstrip().endswith("`pip install py-spy` lets probe read them from outside"), err
        usual = _cli(python, dict(env, PROBE_CLI_FAST="0"), str(proc.pid), "backtrace")
        assert usual[0] == code and usual[2].split(": ", 1)[0] == err.split(": ", 1)[0], usual
        assert "could not be read from outside" in usual[2] and "py-spy: not installed" in usual[2], usual


IMPOSTOR = r"""
#include <stdio.h>
#include <unistd.h>
/* Looks like a statically linked CPython to the memory reader: the two symbols it looks for, in the full
   symbol table alone (not exported), in a position-independent executable; nothing of CPython behind them. */
__attribute__((used)) const unsigned int Py_Version = VERSION;
__attribute__((used)) unsigned char _PyRuntime[4096];
int main(void) {
    printf("READY %d\n", (int)getpid());
    fflush(stdout);
    for (;;) pause();
}
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build the impostor")
@pytest.mark.parametrize("version, reason", [
    ("0x030C01F0", "it runs Python 3.12, and this reader reads CPython 3.11 alone"),
    ("0x030B02F0", "what it read is not CPython 3.11's layout")])
def test_symbols_of_a_pie_executable_found_in_its_full_symbol_table(version, reason, tmp_path):
    """The symbols of a PIE executable linked without exporting them (``.symtab`` only), placed where it is
    mapped: the version read there is the one compiled in; behind a 3.11 version, memory that is no CPython's
    is refused in words, at once."""
    source, binary = tmp_path / "impostor.c", tmp_path / "impostor"
    source.write_text(IMPOSTOR)
    subprocess.run(["cc", "-fPIE", "-pie", "-o", str(binary), str(source), "-DVERSION=%s" % version], check=True,
                   timeout=scaled(60))
    with open(binary, "rb") as handle:
        assert int.from_bytes(handle.read(18)[16:18], "little") == 3  # ET_DYN: position-independent
    dynamic = subprocess.run(["nm", "-D", str(binary)], capture_output=True, text=True, timeout=scaled(30)).stdout
    assert "_PyRuntime" not in dynamic and "Py_Version" not in dynamic
    popen = subprocess.Popen([str(binary)], stdout=subprocess.PIPE)
    try:
        assert popen.stdout.readline().startswith(b"READY")
        started = time.monotonic()
        threads, why = memory.read(popen.pid, str(tmp_path))
        assert threads is None and why.startswith(reason), why
        assert time.monotonic() - started < scaled(10)
        kept = (tmp_path / memory.CACHE_NAME).read_text()
        assert kept.startswith(str(binary) + "\0") and memory.read(popen.pid, str(tmp_path)) == (None, why)
    finally:
        popen.kill()
        popen.wait()
