"""A process with an agent that forks a child without an exec (as a DataLoader worker or a multiprocessing
fork is made): the child runs no agent, and ends when its parent does. Prints ``READY <pid>`` (the
parent), then ``CHILD <pid>``."""

import os
import time

parent = os.getpid()
print("READY", parent, flush=True)
child = os.fork()
if child == 0:
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(0)
print("CHILD", child, flush=True)
while True:
    time.sleep(1)
