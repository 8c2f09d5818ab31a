"""probe's cache (gdb's symbols, its register fix) when root runs probe with another user's HOME or
XDG_CACHE_HOME (issue 33 item 11): gdb loads code from there, so probe makes nothing in a directory that
user controls (uid 65534, a real second user); it uses root's own cache instead, and the injection works."""

import os
import sys

import pytest

from procs import run_cli, target_env
from test_inject import needs_ptrace
from test_runtime_fallback import _as_nobody, shared_tmp  # noqa: F401 (a fixture)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to be a second user")
@needs_ptrace
@pytest.mark.parametrize("variable", ["HOME", "XDG_CACHE_HOME"])
def test_root_with_another_users_home_makes_nothing_there(shared_tmp, target_factory, variable):  # noqa: F811
    theirs = os.path.join(shared_tmp, "alice")

    def make_home() -> None:
        os.mkdir(theirs)
        os.chmod(theirs, 0o755)  # theirs: they may rename what root would make in it

    _as_nobody(make_home)
    env = target_env(probe=False, **{variable: theirs if variable == "HOME" else os.path.join(theirs, ".cache")})
    env.pop("PROBE_GDB_SYMBOLS", None)
    target = env.copy()
    target.pop("PYTHONPATH", None)  # the injector has to expose probe to it
    proc = target_factory("inject_sleeping.py", probe=False, env=target, python=sys.executable)
    done = run_cli(str(proc.pid), "inject", env=env)
    assert done.code == 0, done.err
    assert os.listdir(theirs) == [], list(os.walk(theirs))
    health = run_cli(str(proc.pid), "health", "--json", env=env)
    assert health.code == 0 and str(proc.pid) in health.out, health
