import os
import shutil
import signal
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
# pytest-xdist's workers start with COLUMNS=80 and LINES=24 in their environment, which the CLI run by a
# test would take for its terminal's size (it fits tables to $COLUMNS): a test that wants a width sets it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)

# A shell starts a background job (`bash tests/run.sh &`, nohup, CI runners) with SIGINT ignored, and an ignored
# signal stays ignored across exec: every target, CLI and terminal a test starts would then shrug off the
# Ctrl-C the test sends it. A handler (unlike SIG_IGN) is reset to the default by exec, so installing
# Python's own here gives every child SIGINT at its default, in the foreground or not.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

from procs import Proc, spawn  # noqa: E402


def pytest_unconfigure(config) -> None:
    shutil.rmtree(_RUNTIME, ignore_errors=True)


# The forty modules that take longest (20 s to 100 s each: torchrun jobs, browsers, frameworks), longest
# first, as measured in a whole run on two workers. Under pytest-xdist with --dist loadfile and
# --no-loadscope-reorder (tests/run.sh), a module runs whole on one worker and the modules go out in
# collection order: these go first, so that none of them is left to run alone at the end, and the short
# ones fill in the tail. A module missing here only costs balance, never a result.
SLOW_MODULES = ("test_snapshot_watch.py", "test_sql_blowups.py", "test_every_launcher.py", "test_frameworks.py",
                "test_checkpoint.py", "test_diagnose.py", "test_snapshot_runs.py", "test_torch_tables.py",
                "test_fr_copy.py", "test_framework_values.py", "test_alerts_straggler.py", "test_diagnose_steps.py",
                "test_page.py", "test_torch_trace.py", "test_alerts.py",
                "test_target_first.py", "test_cluster.py", "test_torch_reads.py", "test_diagnose_logged_loss.py",
                "test_profile_launchers.py", "test_memory_verdict.py", "test_examples.py", "test_other_user.py",
                "test_checkpoint_paths.py", "test_profile_frameworks.py", "test_diagnose_dist_training.py",
                "test_launchers.py", "test_cluster_helper_answer.py", "test_inject.py", "test_gpu_check.py", "test_diagnose_training.py",
                "test_skill_file.py", "test_snapshot_read.py", "test_diagnose_shapes.py", "test_watch_check.py",
                "test_step_extras.py", "test_hints.py", "test_tracked_scan.py", "test_diagnose_groups.py",
                "test_outside_placed.py")


def pytest_collection_modifyitems(config, items) -> None:
    if not hasattr(config, "workerinput"):  # not a pytest-xdist worker: the usual order
        return
    rank = {name: i for i, name in enumerate(SLOW_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable


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
