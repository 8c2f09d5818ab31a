import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from procs import Proc, spawn  # noqa: E402


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
