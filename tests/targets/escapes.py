"""A target whose names carry terminal escape sequences: ``escapes.py MODE DIR``.

A thread, a function (its code object renamed), a source file (written into DIR), a module and a table
(its description, a value, and the error its rows function raises) are all named with ``EVIL``: OSC 52,
which sets the terminal's clipboard, and CSI sequences that clear the screen and move the cursor.

    live  the evil thread waits on an Event in the evil function; the main thread waits too
    gil   the evil thread sleeps in libc through ctypes.PyDLL, holding the GIL (the agent cannot answer)

Prints ``READY <pid>`` once the thread is started (in ``gil`` mode, just before it takes the GIL).
"""

import ctypes
import os
import sys
import threading
import types

import probe

OSC52 = "\x1b]52;c;cHduZWQ=\x07"  # set the clipboard to "pwned"
CSI = "\x1b[2J\x1b[H\x9b1m"  # clear the screen, cursor home, and a one-byte (C1) CSI
EVIL = OSC52 + CSI

SOURCE = (
    "def evil(event):\n"
    "    event.wait()  # %s\n"  # the source line python.backtrace shows carries EVIL too
    "def evil_gil(seconds):\n"
    "    sleep(seconds)\n"
) % EVIL


def load(directory: str) -> types.SimpleNamespace:
    """The two functions, compiled from a real file whose name holds EVIL, their code renamed to it."""
    path = os.path.join(directory, "file%s.py" % EVIL)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(SOURCE)
    namespace = {"sleep": ctypes.PyDLL(None).sleep}
    exec(compile(SOURCE, path, "exec"), namespace)
    for name in ("evil", "evil_gil"):
        function = namespace[name]
        function.__code__ = function.__code__.replace(co_name=name + EVIL, co_qualname=name + EVIL)
    return types.SimpleNamespace(**namespace)


def failing_rows():
    raise RuntimeError("broken" + EVIL)


def main() -> None:
    mode, directory = sys.argv[1], sys.argv[2]
    code = load(directory)
    sys.modules["mod" + EVIL] = types.ModuleType("mod" + EVIL)
    probe.register_table("escapes.values", [("value", "VARCHAR", "A value" + EVIL)], lambda: [(EVIL,)],
                         "Rows" + EVIL)
    probe.register_table("escapes.failing", [("value", "VARCHAR", "Never returned.")], failing_rows,
                         "A table whose rows function raises.")
    stop = threading.Event()
    if mode == "live":
        threading.Thread(target=code.evil, args=(stop,), name="thread" + EVIL, daemon=True).start()
        print("READY", os.getpid(), flush=True)
    else:
        holder = threading.Thread(target=code.evil_gil, args=(3600,), name="thread" + EVIL, daemon=True)
        print("READY", os.getpid(), flush=True)
        holder.start()
    stop.wait()


if __name__ == "__main__":
    main()
