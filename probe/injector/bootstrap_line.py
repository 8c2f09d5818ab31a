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

from probe import _paths

__all__ = ["package_dir", "exposure_dir", "bootstrap_code"]


def package_dir() -> str:
    """The directory of this ``probe`` package, symlinks resolved."""
    return os.path.dirname(os.path.realpath(os.path.join(os.path.dirname(__file__), "..", "__init__.py")))


def exposure_dir(target_uid: int) -> str:
    """A directory, enterable by the target's user, that holds only ``probe`` -> this package.

    It stays in place after the injection: the agent imports its submodules lazily, through the
    package's ``__path__``, which points into it.
    """
    source = package_dir()
    if target_uid == os.getuid():
        digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        path = os.path.join(_paths.ensure_runtime_dir(), "pkg-" + digest)
        os.makedirs(path, mode=0o700, exist_ok=True)
    else:
        # We are root (or hold CAP_SYS_PTRACE) injecting into another user's process: our runtime
        # directory is closed to it, so the directory is made for it and handed to it.
        path = tempfile.mkdtemp(prefix="probe-pkg-")
        os.chown(path, target_uid, -1)
    link = os.path.join(path, "probe")
    if os.path.realpath(link) != source:
        tmp = "%s.%d.tmp" % (link, os.getpid())
        os.symlink(source, tmp)
        os.replace(tmp, link)
    return path


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
