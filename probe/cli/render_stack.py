"""Text from a target made safe for a terminal, and a backtrace's lines: the part of the presentation that
``probe PID backtrace`` needs (``probe.cli.quick``), in a module that imports nothing at run time (typing
alone costs some 4 ms of a command's start); ``probe.cli.render`` holds the rest and re-exports these."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    import re
    from typing import Any, Dict, Iterator, List, Sequence

__all__ = ["visible", "render_backtrace"]

# Characters a terminal acts on rather than shows: C0 controls (ESC starts CSI and OSC sequences: OSC 52
# writes the clipboard, CSI moves the cursor and erases lines), DEL, C1 controls (0x9b is a one-byte CSI on
# some terminals), the line and paragraph separators, the bidirectional overrides and isolates that make a
# line read in another order than it is, and lone surrogates (undecodable bytes, which no terminal can show).
_CONTROLS = "\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff"
_PATTERNS: Dict[bool, re.Pattern[str]] = {}  # lines -> the pattern, compiled on first need (~0.4 ms each)


def _pattern(lines: bool) -> re.Pattern[str]:
    """The characters :func:`visible` escapes: every control above, and (``lines`` False) newlines and tabs."""
    if lines not in _PATTERNS:
        import re

        _PATTERNS[lines] = re.compile(("[%s]" if lines else "[%s\t\n]") % _CONTROLS)
    return _PATTERNS[lines]


_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    return _NAMED.get(char) or ("\\x%02x" % code if code < 0x100 else "\\u%04x" % code)


def visible(text: str, lines: bool = False) -> str:
    """``text`` from a target, safe to show on a terminal: every control character written out as an
    escape (ESC as ``\\x1b``, a carriage return as ``\\r``), so that no sequence in a thread name, a
    file name or a snippet's output can reach the terminal and act there. ``lines``: newlines and tabs
    are kept (text laid out in lines); else they are escaped too (one field, one line)."""
    if text.isprintable() or (lines and text.replace("\n", " ").replace("\t", " ").isprintable()):
        return text  # no control character at all (every one above is Cc, Cf, Cs, Zl or Zp): as it is
    return _pattern(lines).sub(_escape, text)


def render_backtrace(frames: Sequence[Any]) -> Iterator[str]:
    """One block per thread (main thread first), innermost frame first, with the source line. ``frames``:
    ``probe.client.results.Frame`` records, or anything with their attributes."""
    threads: Dict[int, List[Any]] = {}
    for frame in frames:
        threads.setdefault(frame.thread_id, []).append(frame)
    order = sorted(threads.values(), key=lambda fs: (not fs[0].is_main, fs[0].thread_name or "", fs[0].thread_id))
    for i, stack in enumerate(order):
        first = stack[0]
        if i:
            yield ""
        tags = ["native %s" % first.native_id] if first.native_id is not None else []
        if first.is_main:
            tags.append("main")
        yield 'Thread %d "%s"%s' % (first.thread_id, visible(first.thread_name or "?"),
                                    " (%s)" % ", ".join(tags) if tags else "")
        for frame in sorted(stack, key=lambda f: f.depth):
            func, file = visible(str(frame.func)), visible(str(frame.file))
            if frame.frame_type == "native":
                yield "    [C] %s (%s)" % (func, "%s:%d" % (file, frame.lineno) if frame.lineno else file)
                continue
            yield "    %s (%s:%d)" % (func, file, frame.lineno)
            if frame.code:
                yield "        %s" % visible(frame.code)
