"""A program that closes every file descriptor it does not know, then listens and writes on its own.

Daemons and some servers do this (``os.closerange(3, ...)``): the agent's sockets and crash record are
closed under it, and the program's next sockets and files get the agent's old descriptor numbers. The
program's listening socket takes the number the agent listened on, and its own files take every other
number the agent had, so that an agent that still acts on its old numbers acts on the program's.

    closes_fds.py SOCKET_PATH DATA_DIR

stdin, one line each: ``close`` (close, listen, fill the numbers; prints ``SERVING <fds>``), ``raise``
(an uncaught exception ends the program). Every client of SOCKET_PATH.N gets ``PROGRAM\\n``.
"""

import os
import socket
import sys
import threading
import time


def agent_fds() -> tuple:
    """The agent's sockets and its other files (the crash record), by number."""
    sockets, others = [], []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            target = os.readlink("/proc/self/fd/%d" % fd)
        except OSError:
            continue
        if fd > 2 and target.startswith("socket:"):
            sockets.append(fd)
        elif fd > 2 and target.endswith(".crash"):
            others.append(fd)
    return sorted(sockets), sorted(others)


def serve(sock: socket.socket) -> None:
    while True:
        conn, _ = sock.accept()
        with conn:
            conn.sendall(b"PROGRAM\n")
        time.sleep(0.1)  # a busy program: its clients wait in the backlog a while


def main() -> None:
    path, data_dir = sys.argv[1], sys.argv[2]
    print("READY", os.getpid(), flush=True)
    files = []
    for line in sys.stdin:
        command = line.strip()
        if command == "close":
            sockets, others = agent_fds()
            os.closerange(3, 65536)
            # Each number the agent had goes to the program: a listening socket where the agent listened
            # (at SOCKET_PATH.0, .1, ...), a file of its own elsewhere.
            listening = []
            for number in range(3, max(sockets + others) + 1):
                if number in sockets:
                    own = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    own.bind("%s.%d" % (path, len(listening)))
                    own.listen(64)
                    threading.Thread(target=serve, args=(own,), daemon=True).start()
                    listening.append(own.fileno())
                else:
                    files.append(os.open(os.path.join(data_dir, "data-%d" % number), os.O_WRONLY | os.O_CREAT, 0o600))
            print("SERVING %d agent=%s listening=%s files=%s" % (len(listening), sockets + others, listening, files),
                  flush=True)
        elif command == "raise":
            raise RuntimeError("the program's own error")


main()
