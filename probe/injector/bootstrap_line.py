"""The code the injector runs in the target: one statement that imports the real bootstrap module.

Everything the agent does lives in ``probe.agent.bootstrap`` (a real, tested module); the injected text
only makes that module importable and calls ``start_from_injector``. The target's environment may lack
probe (another virtualenv, another Python version), so the statement puts a private directory holding
only a ``probe`` symlink to this package at the front of ``sys.path`` for the import, and takes it out
again: the target sees this package and nothing else of the client's site-packages. Safe to run twice:
``start_from_injector`` returns the running agent.

The statement runs through ``PyRun_SimpleString`` in ``__main__``, so it binds no names there, and it
swallows every exception: from a pending call, an exception (even SystemExit from a broken import)
would surface in the target's main thread.
"""

import hashlib
import os
import tempfile
from typing import Optional

from probe import _paths
from probe.injector.exposure_users import exposure_lock, record_user

__all__ = ["package_dir", "exposure_dir", "bootstrap_code"]


def package_dir() -> str:
    """The directory of this ``probe`` package, symlinks resolved."""
    return os.path.dirname(os.path.realpath(os.path.join(os.path.dirname(__file__), "..", "__init__.py")))


def exposure_dir(target_uid: int, target_pid: Optional[int] = None) -> str:
    """A directory, enterable by the target's user, that holds only ``probe`` -> this package.

    It stays in place after the injection: the agent imports its submodules lazily, through the
    package's ``__path__``, which points into it. ``target_pid`` is recorded as its user (in
    ``pkg-<hash>.users``), so that ``probe list`` removes it once no process that uses it runs.
    """
    source = package_dir()
    if target_uid == os.getuid():
        digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        runtime = _paths.ensure_runtime_dir()
        path = os.path.join(runtime, "pkg-" + digest)
        with exposure_lock(runtime):  # not removed between here and the injection (taken or not after 5 s)
            os.makedirs(path, mode=0o700, exist_ok=True)
            if target_pid is not None:
                record_user(path, target_pid)
            _link(path, source)
        return path
    # We are root (or hold CAP_SYS_PTRACE) injecting into another user's process: our runtime directory
    # is closed to it, so the directory is made for it and handed to it.
    path = tempfile.mkdtemp(prefix="probe-pkg-")
    os.chown(path, target_uid, -1)
    _link(path, source)
    return path


def _link(path: str, source: str) -> None:
    link = os.path.join(path, "probe")
    if os.path.realpath(link) != source:
        tmp = "%s.%d.tmp" % (link, os.getpid())
        os.symlink(source, tmp)
        os.replace(tmp, link)


def bootstrap_code(options_json: str, import_dir: str) -> str:
    """The statement run in the target (the only code the injector writes as a string)."""
    return (
        "try:__import__('sys').path.insert(0,{d!r});"
        "__import__('probe.agent.bootstrap').agent.bootstrap.start_from_injector({o!r})\n"
        "except BaseException:pass\n"
        "finally:\n"
        " try:__import__('sys').path.remove({d!r})\n"
        " except BaseException:pass\n"
    ).format(d=import_dir, o=options_json)
