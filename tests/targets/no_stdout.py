"""A daemon-like target started with stdout and stderr closed: ``sys.stdout is None``.

Its main loop prints all the time (print() with no stdout does nothing) and records the first error
a print raised: an eval must not make the target's own print fail.
"""

import sys
import time

state = {"prints": 0, "error": None, "stdout_was_none": sys.stdout is None}


def main_loop() -> None:
    while True:
        try:
            print("tick")
            state["prints"] += 1
        except Exception as exc:  # recorded for the test; the real bug killed the loop here
            if state["error"] is None:
                state["error"] = repr(exc)
        time.sleep(0.01)


main_loop()
