"""A process holding secrets where a snapshot could copy them: a local named like a key, a password inside a
URL held by a local, and a password on its command line (``--password VALUE``, given by the test). Its main
thread waits in ``wait_here`` with them in its locals."""

import os
import threading


def wait_here(api_key: str, url: str) -> None:
    print("READY", os.getpid(), flush=True)
    threading.Event().wait(600)


def main() -> None:
    api_key = "sk-live-" + "4f9a2b7c1d8e6f3a"
    url = "https://trainer:" + "hunter2hunter2" + "@data.example.com/shards"
    wait_here(api_key, url)


main()
