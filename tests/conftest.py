import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The suite's agents, tokens and crash records go to a directory of its own, never the user's real one
# (where `probe list` would show them for days). Set before anything imports probe; tests that need
# another directory set their own.
_RUNTIME = tempfile.mkdtemp(prefix="probe-tests-")
os.chmod(_RUNTIME, 0o700)
os.environ["PROBE_RUNTIME_DIR"] = _RUNTIME

from procs import Proc, spawn  # noqa: E402


def pytest_unconfigure(config) -> None:
    shutil.rmtree(_RUNTIME, ignore_errors=True)


@pytest.fixture
def target_factory():
    """Start real target scripts; every one is killed and reaped at the end of the test."""
    started = []

    def start(script: str, *args: str, **kwargs) -> Proc:
        proc = spawn(script, args, **kwargs)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()


@pytest.fixture
def idle_target(target_factory) -> Proc:
    """A target with an agent (PROBE=1), main thread asleep, a few named threads."""
    return target_factory("idle.py")
