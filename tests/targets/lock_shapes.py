"""Locks waited for in shapes other than ``with <something>_lock:``; the first argument picks one:

- ``cycle``: thread ``left`` holds module-level ``a`` (a Lock) and waits for ``b`` (an RLock); thread
  ``right`` holds ``b`` and waits for ``a`` through a helper whose parameter is ``gate`` (``with gate:``);
  comments on every ``with`` line; the main thread waits to join them.
- ``guard``: two services each with a Lock at ``self.state.guard``; thread ``decoy`` sits inside the first
  one's ``with self.state.guard:``, thread ``keeper`` inside the second one's; the main thread waits at the
  second one's ``with self.state.guard:``.
- ``owner``: thread ``owner`` takes RLock ``b`` with ``acquire()`` and keeps it; the main thread waits at
  ``with b:``.
- ``property``: ``Watched.guard`` is a property (it counts its calls in ``Watched.calls``); thread ``keeper``
  sits inside ``with self.guard:``, the main thread waits at the same line of another call: reading the
  lock must not call the property (``Watched.calls`` stays 2, the program's own two reads).
- ``stop``: the main thread waits in ``Event.wait`` (the standard library) called from ``wait_for_peer``
  (it is meant to be stopped with SIGSTOP and diagnosed from outside).

Prints ``READY <pid>`` once every thread is where it is meant to be.
"""

import os
import sys
import threading
import time

a = threading.Lock()
b = threading.RLock()
never = threading.Event()


def ready() -> None:
    sys.stdout.write("READY %d\n" % os.getpid())
    sys.stdout.flush()


def take(gate) -> None:  # type: ignore[no-untyped-def]
    with gate:  # the caller's lock, by another name
        pass


def left(both: threading.Barrier) -> None:
    with a:  # first a
        both.wait()
        with b:  # then b
            pass


def right(both: threading.Barrier) -> None:
    with b:  # first b
        both.wait()
        take(a)


class State:
    def __init__(self) -> None:
        self.guard = threading.Lock()


class Service:
    def __init__(self) -> None:
        self.state = State()

    def keep(self, inside: threading.Event) -> None:
        with self.state.guard:  # kept while waiting for a reply
            inside.set()
            never.wait()

    def update(self) -> None:
        with self.state.guard:
            pass


class Watched:
    calls = 0

    def __init__(self) -> None:
        self._guard = threading.Lock()

    @property
    def guard(self) -> threading.Lock:
        Watched.calls += 1
        return self._guard

    def keep(self, inside: threading.Event) -> None:
        with self.guard:
            if not inside.is_set():
                inside.set()
                never.wait()


def own_rlock(taken: threading.Event) -> None:
    b.acquire()
    taken.set()
    never.wait()


def at_second_lock(workers, lines, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    """Until each worker's innermost frame is at one of ``lines`` (blocked there: both locks are taken)."""
    import linecache

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        frames = sys._current_frames()
        here = [frames.get(w.ident) for w in workers]
        if all(f is not None and linecache.getline(f.f_code.co_filename, f.f_lineno).strip() in lines for f in here):
            return
        time.sleep(0.01)
    raise SystemExit("the workers did not reach their second lock within %.0f s" % timeout)


def wait_for_peer() -> None:
    threading.Thread(target=announce_when_waiting, args=(threading.get_ident(),), name="announce").start()
    never.wait()


def announce_when_waiting(main: int, timeout: float = 60.0) -> None:
    """READY once ``main`` waits in ``never.wait()``: inside threading's waits, called from wait_for_peer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(main)
        inner, outer = frame, None  # threading's innermost and outermost frames, then the caller
        while frame is not None and frame.f_code.co_filename == threading.__file__:
            outer, frame = frame, frame.f_back
        if inner is not None and outer is not None and frame is not None and inner.f_code.co_name == "wait" \
                and outer.f_code.co_name == "wait" and frame.f_code.co_name == "wait_for_peer":  # never.wait()
            ready()
            return
        frame = inner = outer = None
        time.sleep(0.01)


def main(mode: str) -> None:
    if mode == "cycle":
        both = threading.Barrier(3)
        workers = [threading.Thread(target=left, args=(both,), name="left"),
                   threading.Thread(target=right, args=(both,), name="right")]
        for worker in workers:
            worker.start()
        both.wait()
        at_second_lock(workers, ("with b:  # then b", "with gate:  # the caller's lock, by another name"))
        ready()
        for worker in workers:
            worker.join()
    elif mode == "guard":
        first, second = Service(), Service()
        for name, service in (("decoy", first), ("keeper", second)):
            inside = threading.Event()
            threading.Thread(target=service.keep, args=(inside,), name=name, daemon=True).start()
            inside.wait()
        ready()
        second.update()
    elif mode == "owner":
        taken = threading.Event()
        threading.Thread(target=own_rlock, args=(taken,), name="owner", daemon=True).start()
        taken.wait()
        ready()
        with b:  # the owner never lets go
            pass
    elif mode == "property":
        watched, inside = Watched(), threading.Event()
        threading.Thread(target=watched.keep, args=(inside,), name="keeper", daemon=True).start()
        inside.wait()
        ready()
        watched.keep(inside)
    else:
        wait_for_peer()


if __name__ == "__main__":
    main(sys.argv[1])
