"""A default runtime directory another user made first (issue 33 item 10): in a shared /tmp anyone may
make /tmp/probe-<uid> before the user does. The agent then keeps its files in a private directory of its
own beside it, says so on stderr and in health, and the client finds it there (probe list, probe PID)."""

import json
import os
import shutil
import stat
import tempfile
from typing import Callable, Dict, Iterator

import pytest

from procs import running, run_cli, target_env
from test_files_tokens import _probe_lines, _stderr_until
from test_inject import needs_ptrace

NOBODY = 65534


def _as_nobody(action: Callable[[], None]) -> None:
    """Run ``action`` in a forked child that has dropped to uid 65534 (a real second user)."""
    child = os.fork()
    if child == 0:
        code = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            action()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


@pytest.fixture
def shared_tmp() -> Iterator[str]:
    """A world-writable sticky directory that every user can reach, as /tmp is (the tests' own tmp_path
    is root's alone, so that nobody could not enter it)."""
    path = tempfile.mkdtemp(prefix="probe-shared-tmp-")
    os.chmod(path, 0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _default_env(tmp: str, probe: bool = True) -> Dict[str, str]:
    """The environment of a user who set no PROBE_RUNTIME_DIR (nor XDG_RUNTIME_DIR), with ``tmp`` as /tmp."""
    env = target_env(probe=probe, TMPDIR=tmp)
    env.pop("PROBE_RUNTIME_DIR", None)
    env.pop("XDG_RUNTIME_DIR", None)
    return env


def _planted(default: str, shape: str) -> Callable[[], None]:
    def plant() -> None:
        if shape == "a directory":
            os.mkdir(default)
            os.chmod(default, 0o777)
        elif shape == "a link to a directory":
            os.mkdir(default + ".theirs")
            os.chmod(default + ".theirs", 0o777)
            os.symlink(default + ".theirs", default)
        else:
            with open(default, "w"):
                pass
    return plant


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to be a second user")
@pytest.mark.parametrize("shape", ["a directory", "a link to a directory", "a file"])
def test_a_default_runtime_dir_made_by_another_user_is_left_and_a_private_one_is_used(shared_tmp, shape):
    default = os.path.join(shared_tmp, "probe-%d" % os.getuid())
    _as_nobody(_planted(default, shape))
    assert os.lstat(default).st_uid == NOBODY
    before = sorted(os.listdir(shared_tmp))
    client_env = _default_env(shared_tmp, probe=False)
    nothing_yet = run_cli("list", "--agents-only", "--json", env=client_env)
    assert nothing_yet.code == 0 and json.loads(nothing_yet.out) == [], nothing_yet
    with running("idle.py", env=_default_env(shared_tmp), wait_socket=False) as first, \
            running("idle.py", env=_default_env(shared_tmp), wait_socket=False) as second:
        said = {}
        for proc in (first, second):
            lines = _probe_lines(_stderr_until(proc, lambda t: "\n" in t, timeout=60))
            assert len(lines) == 1 and default in lines[0] and "keeps its socket in" in lines[0], lines
            said[proc.pid] = lines[0]
        fallbacks = [n for n in os.listdir(shared_tmp) if n.startswith("probe-%d-" % os.getuid())
                     and not n.endswith(".theirs")]
        assert len(fallbacks) == 1, fallbacks  # both processes meet in one
        private = os.path.join(shared_tmp, fallbacks[0])
        info = os.lstat(private)
        assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) == 0o700
        assert all(private in line for line in said.values()), said
        assert sorted(os.listdir(shared_tmp)) == sorted(before + fallbacks)  # nothing else made or changed
        if shape != "a file":
            assert os.listdir(default) == [] and stat.S_IMODE(os.stat(default).st_mode) == 0o777
        for proc in (first, second):
            health = run_cli(str(proc.pid), "health", "--json", env=client_env)
            assert health.code == 0, health.err
            info_ = json.loads(health.out)
            assert info_["pid"] == proc.pid and info_["runtime_dir"] == private, info_
            assert default in info_["runtime_dir_fallback"] and private in info_["runtime_dir_fallback"], info_
            done = run_cli(str(proc.pid), "eval", "6 * 7", env=client_env)
            assert done.code == 0 and done.out.strip() == "42", done
        listing = run_cli("list", "--agents-only", "--json", env=client_env)
        assert listing.code == 0, listing.err
        assert {first.pid, second.pid} <= {row["pid"] for row in json.loads(listing.out)}, listing.out


def test_a_runtime_dir_the_user_named_is_never_replaced(shared_tmp, tmp_path):
    """The fallback is for the default name only: a PROBE_RUNTIME_DIR that is a link stays an error."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = os.path.join(shared_tmp, "named")
    os.symlink(str(real), link)
    with running("idle.py", env=target_env(PROBE_RUNTIME_DIR=link), wait_socket=False) as proc:
        lines = _probe_lines(_stderr_until(proc, lambda t: "\n" in t, timeout=60))
        assert len(lines) == 1 and link in lines[0] and "symbolic link" in lines[0], lines
    assert [n for n in os.listdir(shared_tmp) if n != "named"] == []


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to be a second user")
@needs_ptrace
def test_an_agent_injected_while_another_user_holds_the_default_is_found(shared_tmp, target_factory):
    default = os.path.join(shared_tmp, "probe-%d" % os.getuid())
    _as_nobody(_planted(default, "a directory"))
    env = _default_env(shared_tmp, probe=False)
    target = env.copy()
    target.pop("PYTHONPATH", None)  # the injector has to expose probe to it
    proc = target_factory("inject_sleeping.py", probe=False, env=target)
    done = run_cli(str(proc.pid), "inject", env=env)
    assert done.code == 0, done.err
    health = run_cli(str(proc.pid), "health", "--json", env=env)
    assert health.code == 0, health.err
    info = json.loads(health.out)
    assert info["pid"] == proc.pid and info["runtime_dir"].startswith(default + "-"), info
    assert default in info["runtime_dir_fallback"], info
