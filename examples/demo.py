"""The demo: start a hung "training" process with an agent, look inside it, and stop it.

    python examples/demo.py

It runs the real ``probe`` command line against a real process, showing each command before its output.
"""

import os
import select
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EXIT_STUCK = 11  # what `probe PID diagnose` exits with on a hung process

STEPS = [
    ("what is wrong, which thread, where (exit 11: stuck)", ["diagnose"]),
    ("where is every thread right now", ["backtrace"]),
    ("the innermost frames, in SQL", ["query", "SELECT thread_name, func, lineno, code FROM python.backtrace "
                                               "WHERE depth = 0 ORDER BY thread_name"]),
    ("threads with their CPU time", ["query", "SELECT t.thread_name, t.daemon, t.cpu_user, count(*) AS frames "
                                              "FROM python.backtrace b JOIN python.threads t USING (thread_id) "
                                              "GROUP BY ALL ORDER BY frames DESC"]),
    ("the process", ["query", "SELECT pid, round(rss / 1e6, 1) AS rss_mb, num_threads, python_version "
                              "FROM process.info"]),
    ("read the training state", ["eval", "print(f'step={step} loss={loss:.3f} queued={batches.qsize()} "
                                         "weights={weights.locked()} metrics={metrics.locked()}')"]),
    ("the tables there are", ["tables"]),
]


def wait_ready(proc: subprocess.Popen, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if ready:
            line = proc.stdout.readline()
            if not line:
                raise SystemExit("the example process exited before it was ready")
            if line.startswith("READY"):
                return int(line.split()[1])
    raise SystemExit("the example process was not ready within %.0f s" % timeout)


def wait_agent(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = subprocess.run([sys.executable, "-m", "probe", str(pid), "health"], capture_output=True, text=True)
        if done.returncode == 0:
            return
        time.sleep(0.05)
    raise SystemExit("no agent answered in process %d within %.0f s" % (pid, timeout))


def main() -> int:
    env = dict(os.environ, PROBE="1", PYTHONUNBUFFERED="1")
    target = subprocess.Popen([sys.executable, os.path.join(HERE, "stuck.py")], stdout=subprocess.PIPE, text=True,
                              env=env)
    failed = 0
    try:
        pid = wait_ready(target)
        wait_agent(pid)
        print("started examples/stuck.py as pid %d with PROBE=1 (at step 5 its trainer and its checkpoint writer "
              "deadlock on two locks)\n" % pid)
        for title, args in STEPS:
            shown = " ".join(a if " " not in a else '"%s"' % a for a in args)
            print("# %s\n$ probe %d %s" % (title, pid, shown), flush=True)
            done = subprocess.run([sys.executable, "-m", "probe", str(pid), *args], text=True, timeout=60)
            failed += done.returncode != (EXIT_STUCK if args == ["diagnose"] else 0)
            print(flush=True)
    finally:
        target.terminate()
        try:
            target.wait(5)
        except subprocess.TimeoutExpired:
            target.kill()
            target.wait(5)
    print("stopped pid %d; %s" % (target.pid, "all commands succeeded" if not failed else "%d commands failed" % failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
