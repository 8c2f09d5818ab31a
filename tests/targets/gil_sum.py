"""A target whose main thread holds the GIL in one long C call (the agent cannot answer)."""

import os

print("READY", os.getpid(), flush=True)
print(sum(range(10 ** 13)))  # builtin_sum: never releases the GIL
