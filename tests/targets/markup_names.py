"""A target whose names carry HTML: ``markup_names.py DIR``.

A thread, a function (its code object renamed) and a source file (written into DIR) are named with
``MARKUP``: a script element and an image whose error handler would run, as a page that set them as HTML
would. The marked thread waits on an Event in the marked function, a line of source that carries the
markup too; the main thread waits in ``main``. Prints ``READY <pid>`` once the thread is started.
"""

import os
import sys
import threading
import types

MARKUP = '<script>window.pwned=1</script><img src=x onerror="window.pwned=2">'
FILE_MARKUP = '<img src=x onerror="window.pwned=3">'  # a file's name holds no "/"

SOURCE = (
    "def marked(event):\n"
    "    event.wait()  # %s\n"
) % MARKUP


def load(directory: str) -> types.SimpleNamespace:
    """The function, compiled from a real file whose name holds markup, its code renamed to markup."""
    path = os.path.join(directory, "file%s.py" % FILE_MARKUP)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(SOURCE)
    namespace: dict = {}
    exec(compile(SOURCE, path, "exec"), namespace)
    function = namespace["marked"]
    function.__code__ = function.__code__.replace(co_name="marked" + MARKUP, co_qualname="marked" + MARKUP)
    return types.SimpleNamespace(**namespace)


def main() -> None:
    code = load(sys.argv[1])
    stop = threading.Event()
    threading.Thread(target=code.marked, args=(stop,), name="thread" + MARKUP, daemon=True).start()
    print("READY", os.getpid(), flush=True)
    stop.wait()


if __name__ == "__main__":
    main()
