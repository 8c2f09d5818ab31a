"""Whether a live local process with no agent socket is the plain case, told from /proc with ``os`` alone:
the client's explanation of the failed connect (``probe.client.explain``) says no more than "no agent in
process PID" with the hint to inject one or start with ``PROBE=1`` (``MESSAGE``, ``HINT``: its words).

``probe.cli.quick`` asks this before it prints a process's stacks read from its memory
(``probe.reader.memory``), without importing the client, the injector's advice and what they import
(typing, re, socket: more than the read itself). Every case in which the advice would say more is told
apart here and answered False, as is anything unsure; the usual path then explains as always:

* another user's process (``advice.another_users``), a zombie or a process that is gone;
* torchrun's launcher or a node helper (``advice.launcher_advice``: ``-m torch.distributed.run`` or
  ``launch``, ``torchrun``, ``probe.host`` in the first words of its command line);
* ``PROBE``, ``PROBE_LISTEN`` or ``PROBE_PORT`` in its environment (``advice.probe_requested``);
* a runtime directory of its own (``advice.agent_elsewhere``): any of ``PROBE_RUNTIME_DIR``,
  ``XDG_RUNTIME_DIR``, ``TMPDIR``, ``TEMP``, ``TMP`` set otherwise than here;
* an inject whose start is queued (``probe.injector.queued``'s note beside the socket).

The interpreter's version and whether a thread keeps the GIL are the memory reader's to tell: it reads only
CPython 3.11 (which the agent supports) and only while the GIL is free.
"""

from __future__ import annotations

import os

from probe import _paths

__all__ = ["plain", "MESSAGE", "HINT"]

MESSAGE = "no agent in process %d"
HINT = "`probe %d inject` starts one now (or start the program with PROBE=1 in its environment)"
_OWN_DIRS = (b"PROBE_RUNTIME_DIR", b"XDG_RUNTIME_DIR", b"TMPDIR", b"TEMP", b"TMP")
_LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch", "probe.host")


def plain(pid: int, socket: str) -> bool:
    """True where ``probe.client.explain`` would say ``MESSAGE`` and ``HINT`` of process ``pid`` whose agent
    would listen at ``socket`` (which does not exist); False where it might say anything else."""
    try:
        with open("/proc/%d/status" % pid, "rb") as handle:
            status = handle.read()
        with open("/proc/%d/cmdline" % pid, "rb") as handle:
            argv = handle.read().split(b"\0")[:4]
        with open("/proc/%d/environ" % pid, "rb") as handle:
            environ = handle.read().split(b"\0")
        ticks = _paths.process_start_ticks(str(pid))
    except (OSError, ValueError):
        return False
    fields = {}
    for line in status.split(b"\n"):
        name, _, value = line.partition(b":")
        fields[name] = value.split()
    me = b"%d" % os.getuid()
    if fields.get(b"State", [b"?"])[0] not in (b"R", b"S", b"D") or fields.get(b"Uid", [])[:3] != [me] * 3:
        return False
    for i, word in enumerate(argv):
        if word == b"-m" and i + 1 < len(argv) and argv[i + 1].decode("utf-8", "replace") in _LAUNCHERS:
            return False
        if word == b"probe.host" or word.rsplit(b"/", 1)[-1] == b"torchrun":
            return False
        if word.endswith(b"torch/distributed/run.py"):
            return False
    env = dict(item.partition(b"=")[::2] for item in environ if b"=" in item)
    if env.get(b"PROBE", b"0") not in (b"", b"0") or env.get(b"PROBE_LISTEN") or env.get(b"PROBE_PORT"):
        return False
    if any(env.get(name, b"") != os.environb.get(name, b"") for name in _OWN_DIRS):
        return False
    return not os.path.lexists(socket) and not os.path.lexists(
        os.path.join(os.path.dirname(socket), "%d-%d.queued" % (pid, ticks)))
