"""gdb reads the target's libpython and libc symbols from copies without debug information
(``probe.injector.symbols``): made once per library in ``$XDG_CACHE_HOME/probe/gdb-symbols`` (a directory
of ours alone), used again by later injections, and never where the directory is not ours alone or
objcopy is missing (gdb then reads the libraries themselves, as before); the executable is read before
attaching and no other library file is opened. Real targets throughout."""

import os
import shutil
import time
from typing import Dict

import pytest

from probe.injector import inject
from probe.injector.elf import build_id, has_debug_info
from probe.injector.bootstrap_line import bootstrap_code, exposure_dir
from probe.injector.gdb import finish_detached
from probe.injector.inject import _wait_for_agent
from probe.injector.methods import _libraries, attach_and_look, plan, run_plan
from probe.injector.symbols import symbol_files
from probe.injector.target import expected_socket_path, process_state, read_target, tracer_pid
from probe.injector.threads import Frame, ThreadState, wait_site
from procs import scaled, spawn, target_env

pytestmark = pytest.mark.skipif(shutil.which("gdb") is None or shutil.which("objcopy") is None,
                                reason="gdb and objcopy are needed")


def _env() -> Dict[str, str]:
    env = target_env(probe=False, OMP_NUM_THREADS="2")
    env.pop("PYTHONPATH", None)
    return env


def _copies(cache) -> Dict[str, float]:
    """{file name: mtime} of the copies kept (the separate debug files under debug/ included)."""
    root = cache / "probe" / "gdb-symbols"
    return {p.name: p.stat().st_mtime for p in root.rglob("*") if p.is_file()} if root.is_dir() else {}


def test_a_torch_process_is_injected_from_copies_without_debug_information(tmp_path, monkeypatch):
    pytest.importorskip("torch", reason="torch is not installed")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("PROBE_GDB_SYMBOLS", raising=False)
    proc = spawn("inject_torch.py", env=_env(), probe=False, timeout=scaled(60))
    try:
        info = read_target(proc.pid)
        session, threads = attach_and_look(info, deadline=_deadline(30))
        assert session.lean_symbols, "gdb read the libraries' debug information"
        assert any(t.lwp == proc.pid for t in threads) and len(threads) > 1
        # gdb opened none of torch's libraries as it attached (they have no addresses in its list): it
        # did so for each of them, symbols or not, with the target stopped.
        listed = [line for line in session.run(["info sharedlibrary"], scaled(10)).splitlines() if "/torch/lib/" in line]
        assert listed and not any(line.lstrip().startswith("0x") for line in listed), listed[:3]
        run_plan(session, plan(threads, proc.pid), bootstrap_code("", exposure_dir(info.uid, proc.pid)), _deadline(30))
        # run_plan returns once gdb said it detached, before gdb has exited: the target runs untraced.
        assert tracer_pid(proc.pid) == 0 and process_state(proc.pid) not in ("t", "T")
        finish_detached()
        assert _wait_for_agent(expected_socket_path(proc.pid, info.uid), proc.pid, _deadline(20))
        assert proc.alive()
        kept = _copies(tmp_path)
        for path, _base in _libraries(info):  # libpython and libc (its separate debug file), by build id
            assert any(build_id(path)[2:] in name for name in kept), (path, kept)
        assert any(name.endswith(".debug") for name in kept) or not os.path.isdir("/usr/lib/debug/.build-id")
        assert not (tmp_path / "probe" / "gdb-index").exists() or not os.listdir(tmp_path / "probe" / "gdb-index")
        assert (tmp_path / "probe" / "gdb-symbols").stat().st_mode & 0o777 == 0o700
    finally:
        proc.kill()
    proc = spawn("inject_sleeping.py", env=_env(), probe=False)
    try:  # a later injection reads the same copies: none made again
        assert inject(proc.pid, timeout=scaled(20)).method in ("pending_call", "gil_ensure")
        assert _copies(tmp_path) == kept
    finally:
        proc.kill()


def test_a_directory_others_can_write_or_no_objcopy_means_the_libraries_themselves(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("PROBE_GDB_SYMBOLS", raising=False)
    shared = tmp_path / "probe" / "gdb-symbols"
    shared.mkdir(parents=True)
    os.chmod(shared, 0o777)
    bare = tmp_path / "bin"  # gdb on the PATH, objcopy not
    bare.mkdir()
    os.symlink(shutil.which("gdb"), bare / "gdb")
    proc = spawn("inject_sleeping.py", env=_env(), probe=False)
    try:
        assert inject(proc.pid, timeout=scaled(20)).method in ("pending_call", "gil_ensure")
        assert list(shared.iterdir()) == []
        os.chmod(shared, 0o700)
        monkeypatch.setenv("PATH", str(bare))
        session, threads = attach_and_look(read_target(proc.pid), deadline=_deadline(20))
        session.detach()
        assert not session.lean_symbols and threads
        assert list(shared.iterdir()) == []
        assert proc.alive()
    finally:
        proc.kill()


def test_a_wait_site_the_compiler_inlined_is_read_from_its_caller():
    def thread(funcs, gil=False):
        return ThreadState(1, 1, "python", tuple(Frame(f) for f in funcs), gil)

    # Symbol tables alone: pysleep was inlined into time_sleep, which stands right above libc's frames.
    assert wait_site(thread(["clock_nanosleep", "time_sleep", "cfunction_vectorcall_O", "_PyEval_EvalFrameDefault"])) \
        == "pysleep"
    assert wait_site(thread(["__GI___clock_nanosleep", "pysleep", "time_sleep", "_PyEval_EvalFrameDefault"])) == "pysleep"
    # time_sleep's own code (computing the deadline, with the GIL) is no wait.
    assert wait_site(thread(["time_sleep", "_PyEval_EvalFrameDefault"])) is None
    assert wait_site(thread(["_PyTime_GetMonotonicClockWithInfo", "time_sleep", "_PyEval_EvalFrameDefault"])) is None


def _deadline(seconds: float) -> float:
    return time.monotonic() + scaled(seconds)



def test_copies_unused_for_a_month_go_when_a_new_one_is_made(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("PROBE_GDB_SYMBOLS", raising=False)
    with open("/proc/self/maps") as handle:  # this interpreter's libpython: a real library with DWARF here
        mapped = [line.split()[-1] for line in handle if "/libpython3" in line]
    if not mapped or not has_debug_info(mapped[0]):
        pytest.skip("this interpreter has no libpython with debug information")
    first = symbol_files([(mapped[0], 0)], scaled(30))
    assert first.lean and first.libraries[0][0] != mapped[0]
    copy = first.libraries[0][0]
    stale = tmp_path / "probe" / "gdb-symbols" / ("0" * 40 + "-1-1.so")
    stale.write_bytes(b"")
    month = time.time() - 40 * 86400
    os.utime(stale, (month, month))
    os.utime(copy, (month, month))
    assert symbol_files([(mapped[0], 0)], scaled(30)).libraries == first.libraries
    assert os.stat(copy).st_mtime > time.time() - 3600 and stale.exists()  # used: kept, marked; none made
    os.unlink(copy)
    assert symbol_files([(mapped[0], 0)], scaled(30)).libraries == first.libraries
    assert os.path.isfile(copy) and not stale.exists()


SYSTEM_PYTHON = "/usr/bin/python3.11"


def _links_libpython(path: str) -> bool:
    with open(path, "rb") as handle:
        return b"libpython3" in handle.read()


@pytest.mark.skipif(not os.path.isfile(SYSTEM_PYTHON) or _links_libpython(SYSTEM_PYTHON),
                    reason="no statically linked system Python 3.11 here")
def test_a_statically_linked_interpreter_is_read_from_its_executable(tmp_path, monkeypatch):
    """The interpreter's symbols are in the executable itself (Debian's python3.11): gdb reads them from
    /proc/PID/exe before attaching, sees the busy main thread in the eval loop, and the agent starts."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("PROBE_GDB_SYMBOLS", raising=False)
    proc = spawn("inject_busy.py", env=_env(), probe=False, python=SYSTEM_PYTHON)
    try:
        info = read_target(proc.pid)
        assert info.libpython is None
        session, threads = attach_and_look(info, deadline=_deadline(30))
        main = next(t for t in threads if t.lwp == proc.pid)
        assert session.lean_symbols and any(f.startswith("_PyEval_EvalFrame") for f in main.funcs()), main
        run_plan(session, plan(threads, proc.pid), bootstrap_code("", exposure_dir(info.uid, proc.pid)), _deadline(30))
        finish_detached()
        assert _wait_for_agent(expected_socket_path(proc.pid, info.uid), proc.pid, _deadline(20))
        assert proc.alive()
    finally:
        proc.kill()
