"""A target with a table of every plain column type (``plain.t``: NULLs, negatives, a NaN, text beyond
ASCII, whole numbers in a DOUBLE column), for queries answered with and without DuckDB."""

import os
import time

import probe

ROWS = [
    (1, True, 10, 2.5, "alpha", 1 << 40),
    (2, False, -3, 7, "Émile", None),
    (3, None, 10, None, "beta", -(1 << 62)),
    (4, True, None, -1.25, None, 5),
    (5, False, 0, float("nan"), "zeta", 7),
    (6, True, 2, 1e300, "ärger", 0),
]

probe.register_table(
    "plain.t",
    [("id", "INTEGER"), ("ok", "BOOLEAN"), ("n", "INTEGER"), ("score", "DOUBLE"), ("name", "VARCHAR"),
     ("big", "BIGINT")],
    lambda: list(ROWS),
    "Every plain column type.",
)

print("READY", os.getpid(), flush=True)
while True:
    time.sleep(0.2)
