"""A target that gets stuck (or dies) in a way the agent cannot answer from, named by the first argument.

    gil         the main thread calls libc sleep() through ctypes.PyDLL, which keeps the GIL   (hold_gil)
    gil_thread  a thread named "holder" does the same; the main thread waits on an Event
    gil_import  the main thread imports a module whose import keeps the GIL in the same call
    gil_for     the main thread keeps the GIL for the seconds given as the second argument, then
                sleeps in Python (time.sleep), where the agent can answer again
    gil_until   the same, until a byte comes on the FIFO named by the second argument (libc read()
                through ctypes.PyDLL keeps the GIL while it waits): as long as the test needs, no longer
    segv        dies of SIGSEGV (reads address 0)                                   (die)
    abort       dies of SIGABRT (os.abort(), as NCCL's watchdog does)
    exception   dies of an uncaught ValueError

Prints ``READY <pid>`` just before it enters the state (the call that holds the GIL is the next line;
tests wait until the kernel shows the thread in that sleep). A worker thread named "loader" waits
on an Event throughout.
"""

import ctypes
import os
import sys
import threading
import time


def loader() -> None:
    threading.Event().wait()


def hold_gil(seconds: int) -> None:
    ctypes.PyDLL(None).sleep(seconds)  # STATE:gil


def hold_gil_until(fifo: str) -> None:
    fd = os.open(fifo, os.O_RDWR)  # O_RDWR: opened at once, with no writer yet
    ctypes.PyDLL(None).read(fd, ctypes.create_string_buffer(1), 1)  # keeps the GIL until the byte comes


def die(kind: str) -> None:
    if kind == "segv":
        ctypes.string_at(0)  # STATE:segv
    elif kind == "abort":
        os.abort()  # STATE:abort
    raise ValueError("poisoned batch at step 7")  # STATE:exception


def main() -> None:
    mode = sys.argv[1]
    threading.Thread(target=loader, name="loader", daemon=True).start()
    if mode == "gil_thread":
        holder = threading.Thread(target=hold_gil, args=(3600,), name="holder", daemon=True)
        print("READY", os.getpid(), flush=True)
        holder.start()
        threading.Event().wait()
    print("READY", os.getpid(), flush=True)
    if mode == "gil":
        hold_gil(3600)
    elif mode == "gil_import":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import holds_gil_on_import  # noqa: F401
    elif mode in ("gil_for", "gil_until"):
        if mode == "gil_for":
            hold_gil(int(sys.argv[2]))
        else:
            hold_gil_until(sys.argv[2])
        while True:
            time.sleep(0.05)  # STATE:released
    else:
        die(mode)


main()
