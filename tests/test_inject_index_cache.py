"""Where gdb reads libpython's and libc's debug information (``PROBE_GDB_SYMBOLS=full``, or no copies
without it can be had: see ``test_inject_symbols``), it keeps its index of it in a directory of ours
(``$XDG_CACHE_HOME/probe/gdb-index``), so that an injection after the first reads the symbols from it;
a directory others can write is never used (gdb trusts what it finds there)."""

import os
import shutil

import pytest

from probe.injector import inject
from procs import scaled, spawn

pytestmark = pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed")


def _inject_into_fresh_target(tmp_path) -> None:
    proc = spawn("inject_sleeping.py", probe=False)
    try:
        result = inject(proc.pid, timeout=scaled(20))
        assert result.method in ("pending_call", "gil_ensure")
        assert proc.alive()
    finally:
        proc.kill()


def test_the_symbols_index_is_kept_in_our_cache_and_used_again(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("PROBE_GDB_SYMBOLS", "full")
    _inject_into_fresh_target(tmp_path)
    index = tmp_path / "probe" / "gdb-index"
    kept = sorted(p.name for p in index.iterdir()) if index.is_dir() else []
    assert any(name.endswith(".gdb-index") for name in kept), kept
    assert (index.stat().st_mode & 0o777) == 0o700
    _inject_into_fresh_target(tmp_path)  # from the index: the same files, none rebuilt under another name
    assert sorted(p.name for p in index.iterdir()) == kept


def test_a_cache_directory_others_can_write_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("PROBE_GDB_SYMBOLS", "full")
    index = tmp_path / "probe" / "gdb-index"
    index.mkdir(parents=True)
    os.chmod(index, 0o777)
    _inject_into_fresh_target(tmp_path)
    assert list(index.iterdir()) == []
