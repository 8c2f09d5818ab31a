"""Stacks read from outside, as JSON: a host helper reads a rank and sends them to the client. The
client treats what arrives as hostile: every field is checked and bounded."""

from typing import Any, Dict, List, Optional

from probe.reader.stacks import OutsideFrame, Stacks, ThreadStack

__all__ = ["stacks_to_json", "stacks_from_json"]

MAX_THREADS = 4096
MAX_FRAMES = 4096


def stacks_to_json(stacks: Stacks) -> Dict[str, Any]:
    return {"pid": stacks.pid, "source": stacks.source, "python": stacks.python_version,
            "threads": [{"native_id": t.native_id, "thread_id": t.thread_id, "name": t.name, "is_main": t.is_main,
                         "holds_gil": t.holds_gil, "is_agent": t.is_agent,
                         "frames": [[f.func, f.file, f.lineno, f.frame_type, f.library] for f in t.frames]}
                        for t in stacks.threads]}


def _opt_int(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(value: Any, limit: int = 4096) -> str:
    return str(value)[:limit] if value is not None else "?"


def stacks_from_json(raw: Any, where: str) -> Stacks:
    """The stacks in ``raw``; ValueError when it is not what a helper sends."""
    if not isinstance(raw, dict) or not isinstance(raw.get("threads"), list):
        raise ValueError("no stacks in the answer")
    threads: List[ThreadStack] = []
    for t in raw["threads"][:MAX_THREADS]:
        if not isinstance(t, dict) or not isinstance(t.get("frames"), list):
            raise ValueError("a thread without frames")
        frames = []
        for f in t["frames"][:MAX_FRAMES]:
            if not isinstance(f, list) or len(f) != 5:
                raise ValueError("a malformed frame")
            frame_type = "native" if f[3] == "native" else "python"
            frames.append(OutsideFrame(_text(f[0]), _text(f[1]), _opt_int(f[2]) or 0, frame_type,
                                       None if f[4] is None else _text(f[4])))
        name = t.get("name")
        threads.append(ThreadStack(_opt_int(t.get("native_id")), _opt_int(t.get("thread_id")),
                                   None if name is None else _text(name, 256), bool(t.get("is_main")), tuple(frames),
                                   None if t.get("holds_gil") is None else bool(t.get("holds_gil")), False,
                                   bool(t.get("is_agent"))))
    source = "%s, on %s" % (_text(raw.get("source"), 300), where)
    python = raw.get("python")
    return Stacks(_opt_int(raw.get("pid")), source, tuple(threads), python if isinstance(python, str) else None)
