"""A target whose main thread is held in one state, named by the first argument.

    sleep   time.sleep in a loop                    (main_sleep)
    busy    a pure-Python counting loop            (main_busy; ``counter`` counts iterations)
    lock    blocked acquiring a Lock that another thread holds forever   (main_lock)
    event   threading.Event().wait()               (main_event)
    cwait   select.select on a pipe nobody writes: a C call that releases the GIL   (main_cwait)
    exit    polls for the file named by the second argument, then sys.exit(0) from the main thread,
            so exit handlers run (main_exit)
    fork    forks a child after the agent started; the parent keeps its pid in ``child_pid`` (read it
            with eval). The child waits for the file named by the second argument and then leaves by
            sys.exit(0), running the exit handlers it inherited; with a third argument ``agent`` it
            first starts an agent of its own. The parent reaps the child and sets ``child_exit`` to
            its exit code. The child also leaves when its parent dies.

Each mode prints ``READY <pid>`` just before it enters the state; the line that holds the main thread
carries a ``# STATE:<mode>`` marker that tests look up to assert the backtrace's line number.
"""

import os
import select
import sys
import threading
import time

counter = 0


def main_sleep() -> None:
    print("READY", os.getpid(), flush=True)
    while True:
        time.sleep(1000)  # STATE:sleep


def main_busy() -> None:
    global counter
    print("READY", os.getpid(), flush=True)
    while True:  # STATE:busy
        counter += 1


def main_lock() -> None:
    lock = threading.Lock()
    held = threading.Event()

    def holder() -> None:
        lock.acquire()
        held.set()
        threading.Event().wait()  # holds the lock forever

    threading.Thread(target=holder, name="lock-holder", daemon=True).start()
    held.wait(10)
    print("READY", os.getpid(), flush=True)
    lock.acquire()  # STATE:lock


def main_event() -> None:
    print("READY", os.getpid(), flush=True)
    threading.Event().wait()  # STATE:event


def main_cwait() -> None:
    read_end, _write_end = os.pipe()
    print("READY", os.getpid(), flush=True)
    while True:
        select.select([read_end], [], [], 1000)  # STATE:cwait


def main_exit(trigger: str) -> None:
    print("READY", os.getpid(), flush=True)
    while not os.path.exists(trigger):  # STATE:exit
        time.sleep(0.02)
    sys.exit(0)


child_pid = 0
child_exit = None


def _child(parent: int, trigger: str, own_agent: bool) -> None:
    if own_agent:
        import probe

        probe.start()
    while not os.path.exists(trigger) and os.getppid() == parent:
        time.sleep(0.02)
    sys.exit(0)


def main_fork(trigger: str, own_agent: bool) -> None:
    global child_pid, child_exit
    parent = os.getpid()  # taken before the fork: the parent may be gone before the child runs
    child = os.fork()
    if child == 0:
        _child(parent, trigger, own_agent)
        return
    child_pid = child
    print("READY", os.getpid(), flush=True)
    while child_exit is None:
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            child_exit = os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    while True:
        time.sleep(1000)  # STATE:fork


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "sleep"
    if mode == "exit":
        main_exit(sys.argv[2])
    elif mode == "fork":
        main_fork(sys.argv[2], len(sys.argv) > 3 and sys.argv[3] == "agent")
    else:
        {"sleep": main_sleep, "busy": main_busy, "lock": main_lock, "event": main_event,
         "cwait": main_cwait}[mode]()


main()
