"""What the client answers when the agent cannot: the stacks read from outside the process (GIL held,
stopped), its crash record (dead) or a core file, as frames, a health answer, and a note that says
where they came from. The host helper's gathering uses the same (``probe.host.gather``), so that a
rank read from outside reads the same through it as directly.
"""

import time
from typing import Any, Dict, List

from probe.client.results import Frame
from probe.client.targets import Target
from probe.errors import ProbeError, ProcessDead

__all__ = ["outside_stacks", "note_for", "frames_of", "health_from_outside"]


def outside_stacks(exc: ProbeError, agentless: bool = False) -> Any:
    """The stacks that came with an error: read from outside (agent blocked), a crash record (dead), or
    with ``agentless``, read now from a live process that runs no agent (None where that fails)."""
    pid = getattr(exc, "agentless_pid", None)
    if agentless and getattr(exc, "outside", None) is not None:
        return exc.outside  # type: ignore[attr-defined]
    if agentless and pid is not None:
        from probe.errors import ReaderError
        from probe.reader import live

        try:
            return live.read_live(pid)
        except ReaderError as unread:  # the error says so, and why, and what would let a reader read it
            if getattr(exc, "unread", None) is None:
                exc.unread = unread  # type: ignore[attr-defined]
                words, exc.hint = live.unread_words(pid, unread, exc.hint)
                exc.message = "%s, and %s" % (exc.message, words)
            return None
    diagnosis = getattr(exc, "diagnosis", None)
    if diagnosis is not None and diagnosis.stacks is not None:
        return diagnosis.stacks
    record = getattr(exc, "record", None)
    if record is not None and record.has_stacks:
        return record.stacks()
    return None


def note_for(exc: ProbeError, stacks: Any) -> str:
    """Why the agent did not answer, and where the stacks shown come from (the CLI prints it on stderr)."""
    if isinstance(exc, ProcessDead):
        return "%s; these are its last stacks, from its %s" % (exc.message, stacks.source)
    return "%s\n  %s\n  stacks %s" % (exc.message, exc.hint or "", stacks.source)


def frames_of(stacks: Any) -> List[Frame]:
    return [Frame(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], code=r[9], frame_type=r[8]) for r in stacks.rows()]


def health_from_outside(target: Target, exc: ProbeError, stacks: Any) -> Dict[str, Any]:
    """What health can say when the agent cannot: the process's state and who holds the GIL."""
    diagnosis = getattr(exc, "diagnosis", None)
    record = getattr(exc, "record", None)
    holder = stacks.gil_holder() if stacks is not None else None
    out: Dict[str, Any] = {"pid": stacks.pid if stacks is not None else target.pid, "agent": "unavailable",
                           "why": exc.message, "hint": exc.hint}
    if target.core is not None:
        out.update(state="core file", source=stacks.source, signal=stacks.facts.get("signal"))
    elif record is not None:
        out.update(state="dead", cause=record.cause, died_at=record.written_at, record=record.path)
    elif diagnosis is not None:
        out.update(state=diagnosis.state, agent="blocked" if diagnosis.state != "no_answer" else "silent")
        if diagnosis.silent_for is not None:
            out["agent_silent_s"] = round(diagnosis.silent_for, 1)
            out["agent_last_ran"] = time.strftime("%H:%M:%S", time.localtime(time.time() - diagnosis.silent_for))
    if holder is not None:
        out["gil_holder"] = {"native_id": holder.native_id, "thread_name": holder.name, "where": holder.where()}
    if stacks is not None:
        out["python"] = stacks.python_version
        out["threads"] = len(stacks.program_threads())
    return out


