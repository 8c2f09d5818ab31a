"""The trace's CPU memory reader keeps /proc/self/statm open between readings (issue 17, item 11: never act
on a descriptor that is no longer ours). A program that closes descriptors it does not know and opens its
own files gets the reader's old number: the reader must see the number is no longer its file, open its
own again, and neither read nor close the program's. Each case runs in a real child process."""

import json
import subprocess
import sys
import textwrap

from procs import REPO, scaled, target_env

_PRELUDE = textwrap.dedent("""
    import json, os, sys, time
    from probe.tables.torch.trace_device import _REUSE_MAX_NS, CpuMemory

    def fds():
        return sorted(int(n) for n in os.listdir("/proc/self/fd"))

    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1048576.0

    def later():
        time.sleep(_REUSE_MAX_NS / 1e9 + 0.02)  # past the window in which readings share one
""")


def _run(body: str) -> dict:
    script = _PRELUDE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=scaled(60),
                          env=target_env(probe=False), cwd=REPO)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_number_the_program_took_over_is_neither_read_nor_closed(tmp_path) -> None:
    seen = _run("""
        memory = CpuMemory()
        memory()
        ours = memory._fd
        os.close(ours)  # the program closes what it does not know...
        path = %r
        with open(path, "w") as f:
            f.write("999999999 888888888 0 0 0 0 0\\n")  # ...and its own file, statm-shaped, takes the number
        own = os.open(path, os.O_RDONLY)
        if own != ours:
            os.dup2(own, ours)
            os.close(own)
        later()
        reading = memory()[0]
        reopened = memory._fd
        memory.close()
        still = os.readlink("/proc/self/fd/%%d" %% ours)
        print(json.dumps({"reading": reading, "rss": rss_mb(), "still": still, "reopened": reopened,
                          "ours": ours, "reopened_open": os.path.exists("/proc/self/fd/%%d" %% reopened)}))
    """ % str(tmp_path / "program.dat"))
    assert seen["still"] == str(tmp_path / "program.dat"), seen  # the program's file is still open
    assert seen["reopened"] != seen["ours"], seen
    assert seen["reading"] < 1e6 and abs(seen["reading"] - seen["rss"]) < 64, seen  # its own RSS, not the file's
    assert not seen["reopened_open"], seen  # and its own descriptor it did close


def test_a_forked_child_reads_its_own_entry_and_keeps_no_extra_descriptor() -> None:
    seen = _run("""
        memory = CpuMemory()
        memory()
        pid = os.fork()
        if pid == 0:
            before = fds()
            later()
            memory()
            after = fds()
            os.write(1, (json.dumps({"before": before, "after": after}) + "\\n").encode())
            os._exit(0)
        os.waitpid(pid, 0)
    """)
    assert seen["after"] == seen["before"], seen  # the parent's copy was let go, not kept beside the new one


def test_a_number_the_program_closed_is_opened_again() -> None:
    seen = _run("""
        memory = CpuMemory()
        memory()
        os.close(memory._fd)
        later()
        reading = memory()[0]
        print(json.dumps({"reading": reading, "rss": rss_mb()}))
    """)
    assert seen["reading"] == seen["reading"] and abs(seen["reading"] - seen["rss"]) < 64, seen  # not NaN
