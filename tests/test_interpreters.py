"""The agent's code runs on every CPython from 3.9 to 3.13 (those present under pyenv here)."""


import pytest

import probe
from procs import PYENV, REPO, pyenv_python, target_env

VERSIONS = ["3.9", "3.10", "3.11", "3.12", "3.13"]


@pytest.mark.parametrize("version", VERSIONS)
def test_agent_serves_on_each_cpython(target_factory, version):
    python = pyenv_python(version)
    if not python:
        pytest.skip("CPython %s is not installed under %s" % (version, PYENV))
    proc = target_factory("explicit_start.py", python=python, env=target_env(probe=False, PYTHONPATH=REPO))
    client = probe.connect(str(proc.pid))
    assert client.health()["python"].startswith(version + ".")
    frames = client.backtrace()
    assert any(f.thread_name == "worker-1" and f.func.endswith("waiting_worker") for f in frames)
    result = client.eval("import sys; print(sys.version_info[:2]); 6 * 7")
    assert (result.stdout.strip(), result.value) == (str(tuple(int(p) for p in version.split("."))), "42")
    rows = client.query_rows("SELECT count(*) FROM python.threads WHERE thread_name = 'worker-1'")
    assert rows.rows == [[1]]
