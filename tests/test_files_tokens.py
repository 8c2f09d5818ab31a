"""The agent's files: nothing planted or left over is trusted or followed, no directory we did not make
is changed, `probe list` removes only what provably belongs to nobody, and failures say what happened.

Every test runs in a runtime directory of its own (``PROBE_RUNTIME_DIR``), for the targets, the CLI and
this process alike.
"""

import json
import os
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, List

import pytest
import hmac_auth
from procs import TARGETS, Proc, run_cli, target_env, wait_for_socket

import probe
from probe import _paths

NOBODY = 65534
as_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to make files of another user (chown)")


@pytest.fixture
def runtime(tmp_path, monkeypatch) -> str:
    path = str(tmp_path / "rt")
    os.mkdir(path, 0o700)
    monkeypatch.setenv("PROBE_RUNTIME_DIR", path)
    return path


def _env(runtime: str, probe: bool = True, **extra: str):
    return target_env(probe=probe, PROBE_RUNTIME_DIR=runtime, **extra)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _unused_pid(offset: int = 0) -> int:
    """A pid that no process has, here or anywhere: above the kernel's limit."""
    with open("/proc/sys/kernel/pid_max") as handle:
        return int(handle.read()) + 1000 + offset


def _status(port: int, token: str) -> int:
    """The HTTP status of GET /v1/health over TCP with ``token``."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(("GET /v1/health HTTP/1.1\r\nHost: x\r\nAuthorization: %s\r\n"
                      "Content-Length: 0\r\n\r\n" % hmac_auth.authorization(port, token, "GET", "/v1/health")).encode())
        head = b""
        while b"\r\n" not in head:
            chunk = sock.recv(4096)
            if not chunk:
                break
            head += chunk
    return int(head.split(b" ")[1])


def _tcp_refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def _stderr_until(proc: Proc, done: Callable[[str], bool], timeout: float = 10.0) -> str:
    """What the target wrote to stderr, read until ``done(text)`` holds (bounded)."""
    assert proc.popen.stderr is not None
    fd = proc.popen.stderr.fileno()
    text = ""
    deadline = time.monotonic() + timeout
    while not done(text):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("stderr of %s so far: %r" % (proc.script, text))
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            text += chunk.decode("utf-8", "replace")
    return text


def _probe_lines(text: str) -> List[str]:
    return [line for line in text.splitlines() if line.startswith("probe:")]


def _eval_in(pid: int, code: str) -> str:
    result = run_cli(str(pid), "eval", code, env=target_env(probe=False, PROBE_RUNTIME_DIR=_paths.runtime_dir()))
    assert result.code == 0, result.err
    return result.out.strip()


@contextmanager
def held_before_exec(script: str, env, *args: str) -> Iterator[Proc]:
    """A target whose pid is known before its interpreter (and agent) starts: a shell that waits for a
    line on stdin, then execs Python in its own place. ``release(proc)`` lets it go."""
    popen = subprocess.Popen(["/bin/sh", "-c", 'read go && exec "$@"', "sh", sys.executable,
                              os.path.join(TARGETS, script), *args],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc = Proc(popen, script)
    try:
        yield proc
    finally:
        if popen.stdin:
            popen.stdin.close()
        proc.kill()


def release(proc: Proc, timeout: float = 20.0) -> None:
    assert proc.popen.stdin is not None
    proc.popen.stdin.write(b"go\n")
    proc.popen.stdin.flush()
    while not proc.read_line(timeout).startswith("READY"):
        pass


# -- 1. token files ----------------------------------------------------------------------------------

@pytest.mark.parametrize("planted", ["left by a killed agent", "symlink to a file of ours"])
def test_a_token_file_at_the_default_path_before_start_is_never_trusted(runtime, target_factory, tmp_path, planted):
    port = _free_port()
    victim = tmp_path / "victim"
    if planted == "left by a killed agent":
        # A real leftover: an agent with TCP, ended by SIGTERM (no exit handlers), leaves its token file.
        earlier = target_factory("idle.py", env=_env(runtime, PROBE_LISTEN="127.0.0.1:%d" % _free_port()))
        old_file = _paths.token_path(earlier.pid)
        with open(old_file) as handle:
            old_token = handle.read().strip()
        earlier.kill()
        assert os.path.exists(old_file)
    else:
        old_token = "attacker-chosen-token"
        victim.write_text(old_token + "\n")
        os.chmod(victim, 0o600)
    with held_before_exec("idle.py", _env(runtime, PROBE_LISTEN="127.0.0.1:%d" % port)) as proc:
        path = _paths.token_path(proc.pid)
        if planted == "left by a killed agent":
            os.rename(old_file, path)  # as if the new process had been given the dead one's pid
        else:
            os.symlink(str(victim), path)
        release(proc)
        wait_for_socket(proc.pid)
        assert _status(port, old_token) == 401, "the agent accepted a token it did not make"
        info = os.lstat(path)
        assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
        with open(path) as handle:
            fresh = handle.read().strip()
        assert fresh != old_token and len(fresh) >= 32
        assert _status(port, fresh) == 200
    if planted != "left by a killed agent":
        assert victim.read_text() == old_token + "\n", "the agent wrote through a planted link"


@pytest.fixture
def shared_dir(tmp_path) -> str:
    """A world-writable sticky directory, as /tmp is."""
    path = str(tmp_path / "shared")
    os.mkdir(path)
    os.chmod(path, 0o1777)
    return path


def _refused_tcp(runtime, target_factory, token_file: str, why: str) -> Proc:
    """Start a target with PROBE_LISTEN and this token file; check it serves no TCP, says so, and
    still serves its unix socket."""
    port = _free_port()
    proc = target_factory("idle.py", env=_env(runtime, PROBE_LISTEN="127.0.0.1:%d" % port,
                                              PROBE_TOKEN_FILE=token_file))
    assert _tcp_refused(port)
    err = _probe_lines(_stderr_until(proc, lambda t: "\n" in t))
    assert len(err) == 1 and token_file in err[0] and why in err[0], err
    assert "Traceback" not in err[0]
    assert probe.connect(str(proc.pid)).health()["tcp"] is None
    tcp_error = _eval_in(proc.pid, "import probe.agent; print(probe.agent.current().tcp_error)")
    assert token_file in tcp_error and why in tcp_error
    return proc


def test_a_token_file_that_is_a_symlink_is_refused(runtime, target_factory, shared_dir, tmp_path):
    secret = tmp_path / "hostname"  # stands for /etc/hostname: a file of ours, readable only by us
    secret.write_text("myhost\n")
    os.chmod(secret, 0o600)
    token_file = os.path.join(shared_dir, "job.token")
    os.symlink(str(secret), token_file)
    _refused_tcp(runtime, target_factory, token_file, "symbolic link")
    assert secret.read_text() == "myhost\n"


def test_a_dangling_symlink_as_token_file_creates_nothing(runtime, target_factory, shared_dir, tmp_path):
    chosen = tmp_path / "chosen-by-attacker"
    token_file = os.path.join(shared_dir, "job.token")
    os.symlink(str(chosen), token_file)
    _refused_tcp(runtime, target_factory, token_file, "symbolic link")
    assert not os.path.lexists(str(chosen)), "root created a file where the link pointed"


@as_root
def test_a_directory_link_planted_by_another_user_is_not_followed(runtime, target_factory, shared_dir, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = os.path.join(shared_dir, "job")
    os.symlink(str(elsewhere), link)
    os.lchown(link, NOBODY, NOBODY)
    token_file = os.path.join(link, "token")
    _refused_tcp(runtime, target_factory, token_file, "uid %d" % NOBODY)
    assert os.listdir(str(elsewhere)) == []


def test_a_token_file_open_to_others_is_refused(runtime, target_factory, tmp_path):
    token_file = tmp_path / "tok"
    token_file.write_text("guessable-shared-token\n")
    os.chmod(token_file, 0o644)
    _refused_tcp(runtime, target_factory, str(token_file), "chmod 600 %s" % token_file)


@as_root
def test_a_token_file_of_another_user_is_refused(runtime, target_factory, shared_dir):
    token_file = os.path.join(shared_dir, "tok")
    with open(token_file, "w") as handle:
        handle.write("planted-token\n")
    os.chmod(token_file, 0o600)
    os.chown(token_file, NOBODY, NOBODY)
    _refused_tcp(runtime, target_factory, token_file, "belongs to uid %d" % NOBODY)


def test_a_missing_token_file_is_created_owner_only_and_shared_by_ranks(runtime, target_factory, tmp_path):
    token_file = str(tmp_path / "job.token")
    ports = [_free_port(), _free_port()]
    procs = [target_factory("idle.py", env=_env(runtime, PROBE_LISTEN="127.0.0.1:%d" % port,
                                                PROBE_TOKEN_FILE=token_file)) for port in ports]
    info = os.lstat(token_file)
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.getuid()
    with open(token_file) as handle:
        token = handle.read().strip()
    assert len(token) >= 32
    for port in ports:
        assert _status(port, token) == 200
    assert not [n for n in os.listdir(str(tmp_path)) if n.endswith(".tmp")]
    for proc in procs:
        proc.kill()
    assert os.path.exists(token_file), "a token file the user named is the user's: it stays"


# -- 2. the runtime directory --------------------------------------------------------------------------

def test_a_shared_sticky_runtime_dir_is_not_chmodded(target_factory, shared_dir, monkeypatch):
    monkeypatch.setenv("PROBE_RUNTIME_DIR", shared_dir)
    proc = target_factory("idle.py", env=_env(shared_dir), wait_socket=False)
    err = _probe_lines(_stderr_until(proc, lambda t: "\n" in t))
    assert len(err) == 1, err
    assert shared_dir in err[0] and "open to other users" in err[0] and "PROBE_RUNTIME_DIR" in err[0]
    assert stat.S_IMODE(os.stat(shared_dir).st_mode) == 0o1777, "the agent changed a directory it did not make"
    assert not os.path.exists(_paths.socket_path(proc.pid))

    env = _env(shared_dir, probe=False)
    health = run_cli(str(proc.pid), "health", env=env)
    assert health.code == 3
    assert shared_dir in health.err and "open to other users" in health.err and "chmod 700" in health.err
    listing = run_cli("list", "--agents-only", env=env)
    assert listing.code != 0 and shared_dir in listing.err and "open to other users" in listing.err
    assert "Traceback" not in health.err + listing.err
    assert stat.S_IMODE(os.stat(shared_dir).st_mode) == 0o1777


@pytest.mark.parametrize("case", ["a regular file", "under a regular file", "a symlink to a directory",
                                  "another user's directory"])
def test_an_unusable_runtime_dir_gives_one_clear_line(target_factory, tmp_path, case):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    if case == "a regular file":
        runtime = tmp_path / "file"
        runtime.write_text("")
    elif case == "under a regular file":
        (tmp_path / "file").write_text("")
        runtime = tmp_path / "file" / "rt"
    elif case == "a symlink to a directory":
        runtime = tmp_path / "link"
        runtime.symlink_to(real)
    else:
        if os.getuid() != 0:
            pytest.skip("needs root to make a directory of another user")
        os.chown(real, NOBODY, NOBODY)
        runtime = real
    proc = target_factory("idle.py", env=_env(str(runtime)), wait_socket=False)
    text = _stderr_until(proc, lambda t: "\n" in t)
    err = _probe_lines(text)
    assert len(err) == 1 and "Traceback" not in text, text
    assert str(runtime) in err[0] and "PROBE_RUNTIME_DIR" in err[0], err[0]
    assert proc.alive()
    assert stat.S_IMODE(os.stat(str(real)).st_mode) == 0o700


def test_a_missing_runtime_dir_is_made_owner_only(target_factory, tmp_path, monkeypatch):
    runtime = str(tmp_path / "a" / "b" / "rt")
    monkeypatch.setenv("PROBE_RUNTIME_DIR", runtime)
    proc = target_factory("idle.py", env=_env(runtime))
    info = os.lstat(runtime)
    assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    assert probe.connect(str(proc.pid)).health()["pid"] == proc.pid


# -- 3. stale sockets ----------------------------------------------------------------------------------

def _socket_file(path: str, age: float = 0.0) -> None:
    """A socket file nobody listens on (what a killed agent leaves), ``age`` seconds old."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.close()
    if age:
        then = time.time() - age
        os.utime(path, (then, then))


def test_list_removes_only_sockets_nobody_listens_on(runtime, target_factory):
    # A live agent whose pid we cannot see, as from another PID namespace sharing the directory: a real
    # agent's socket under the name of a pid that does not exist here.
    agent = target_factory("idle.py", env=_env(runtime))
    ghost = _unused_pid()
    ghost_sock = os.path.join(runtime, "%d.sock" % ghost)
    os.rename(_paths.socket_path(agent.pid), ghost_sock)
    ghost_token = os.path.join(runtime, "%d.token" % ghost)
    open(ghost_token, "w").close()

    stale, young = _unused_pid(1), _unused_pid(2)
    stale_sock, stale_token = (os.path.join(runtime, "%d.%s" % (stale, ext)) for ext in ("sock", "token"))
    _socket_file(stale_sock, age=60)
    open(stale_token, "w").close()
    young_sock = os.path.join(runtime, "%d.sock" % young)
    _socket_file(young_sock)  # may be an agent between bind and listen: not provably stale yet

    listing = run_cli("list", "--json", "--agents-only", env=_env(runtime, probe=False))
    assert listing.code == 0, listing.err
    assert [r["pid"] for r in json.loads(listing.out)] == [ghost]
    assert os.path.exists(ghost_sock) and os.path.exists(ghost_token), "a live agent's files were removed"
    assert probe.connect("unix:" + ghost_sock).health()["pid"] == agent.pid
    assert not os.path.exists(stale_sock) and not os.path.exists(stale_token)
    assert os.path.exists(young_sock)


class _Listening:
    """A unix socket that accepts connections, served by a thread of this test."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(8)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.close()

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(5)


def test_the_agent_does_not_take_a_socket_someone_serves_on(runtime):
    with held_before_exec("idle.py", _env(runtime)) as proc:
        path = _paths.socket_path(proc.pid)
        other = _Listening(path)
        try:
            inode = os.lstat(path).st_ino
            release(proc)
            err = _probe_lines(_stderr_until(proc, lambda t: "\n" in t))
            assert len(err) == 1 and "already serves on %s" % path in err[0], err
            assert os.lstat(path).st_ino == inode, "the agent replaced a live socket"
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as still_there:
                still_there.settimeout(5)
                still_there.connect(path)  # the test's own listener still answers there
            assert proc.alive()
        finally:
            other.close()


def test_the_agent_replaces_a_socket_nobody_listens_on(runtime):
    with held_before_exec("idle.py", _env(runtime)) as proc:
        path = _paths.socket_path(proc.pid)
        _socket_file(path)
        release(proc)
        assert probe.connect(str(proc.pid)).health()["pid"] == proc.pid


# -- 4. a TCP port that is taken -----------------------------------------------------------------------

def _kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_a_spawned_child_that_inherits_probe_listen_still_serves_unix(runtime, target_factory):
    port = _free_port()
    address = "127.0.0.1:%d" % port
    parent = target_factory("mp_spawn.py", env=_env(runtime, PROBE_LISTEN=address))
    child = int(parent.lines[-1].split()[1])  # "CHILD <pid>", printed before READY
    try:
        wait_for_socket(child)
        assert probe.connect(address, token_file=_paths.token_path(parent.pid)).health()["pid"] == parent.pid
        health = probe.connect(str(child)).health()
        assert health["pid"] == child and health["tcp"] is None
        tcp_error = _eval_in(child, "import probe.agent; print(probe.agent.current().tcp_error)")
        assert address in tcp_error and "in use" in tcp_error
        err = _stderr_until(parent, lambda t: "process %d " % child in t and "\n" in t.split("process %d " % child)[1])
        line = [x for x in _probe_lines(err) if "process %d " % child in x]
        assert len(line) == 1 and address in line[0] and "in use" in line[0] and "unix socket" in line[0], err
        assert not os.path.exists(_paths.token_path(child))
    finally:
        _kill_pid(child)  # the parent's exit handlers end it too; the resource tracker leaves with the parent


# -- 5. the probe command itself -----------------------------------------------------------------------

@pytest.mark.parametrize("how", ["python -m probe", "the probe script"])
def test_probe_1_in_the_shell_starts_no_agent_in_the_cli(runtime, how):
    env = _env(runtime)  # PROBE=1, as if exported in the shell
    if how == "python -m probe":
        command = [sys.executable, "-m", "probe"]
    else:
        script = os.path.join(os.path.dirname(sys.executable), "probe")
        if not os.path.exists(script):
            pytest.skip("no probe console script beside %s" % sys.executable)
        command = [script]
    done = subprocess.run(command + ["list", "--json", "--agents-only"], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [], "the CLI found an agent in itself"
    assert "probe:" not in done.stderr


# -- 6. what happened to a pid -------------------------------------------------------------------------

def _zombie(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with open("/proc/%d/stat" % pid) as handle:
            if handle.read().rpartition(")")[2].split()[0] == "Z":
                return
        if time.monotonic() > deadline:
            raise TimeoutError("%d did not become a zombie" % pid)
        time.sleep(0.01)


def test_a_target_that_dies_is_reported_as_such(runtime, target_factory):
    proc = target_factory("idle.py", env=_env(runtime))
    env = _env(runtime, probe=False)
    pid = str(proc.pid)
    # This test process is its parent and does not reap it yet: it stays a zombie.
    died = run_cli(pid, "eval", "import os; os._exit(3)", env=env)
    assert died.code == 3
    assert "process %s died while answering" % pid in died.err, died.err
    assert "PROBE=1" not in died.err and "inject" not in died.err

    _zombie(proc.pid)
    zombie = run_cli(pid, "health", env=env)
    assert zombie.code == 3
    assert "process %s has exited" % pid in zombie.err and "not reaped" in zombie.err, zombie.err
    assert "PROBE=1" not in zombie.err and "inject" not in zombie.err

    assert proc.popen.wait(10) == 3
    gone = run_cli(pid, "health", env=env)
    assert gone.code == 3
    assert "process %s is gone (it exited or was killed)" % pid in gone.err, gone.err
    assert "PROBE=1" not in gone.err and "inject" not in gone.err

    os.unlink(_paths.socket_path(proc.pid))
    never = run_cli(pid, "health", env=env)
    assert never.code == 3 and "no process with pid %s" % pid in never.err


def test_a_socket_nobody_listens_on_in_a_live_process(runtime, target_factory):
    plain = target_factory("idle.py", env=_env(runtime, probe=False), probe=False)
    _socket_file(_paths.socket_path(plain.pid))
    result = run_cli(str(plain.pid), "health", env=_env(runtime, probe=False))
    assert result.code == 3
    assert "no agent listens in process %d" % plain.pid in result.err and "refuses connections" in result.err
    assert "probe %d inject" % plain.pid in result.err


def test_no_agent_in_a_live_process_still_says_how_to_start_one(runtime, target_factory):
    plain = target_factory("idle.py", env=_env(runtime, probe=False), probe=False)
    result = run_cli(str(plain.pid), "health", env=_env(runtime, probe=False))
    assert result.code == 3
    assert "no agent in process %d" % plain.pid in result.err and "PROBE=1" in result.err
    shutil.rmtree(runtime)
    missing_dir = run_cli(str(plain.pid), "health", env=_env(runtime, probe=False))
    assert missing_dir.code == 3 and "no agent in process %d" % plain.pid in missing_dir.err


def test_a_sigterm_leaves_its_stacks_and_the_next_command_clears_its_files(runtime, target_factory):
    env = _env(runtime, probe=False)
    proc = target_factory("idle.py", env=_env(runtime, PROBE_LISTEN="127.0.0.1:0"))
    other = target_factory("idle.py", env=_env(runtime))
    assert run_cli(str(proc.pid), "health", env=env).code == 0  # up, with its token file written
    sock, token = _paths.socket_path(proc.pid), _paths.token_path(proc.pid)
    assert os.path.exists(token)
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(10) == -signal.SIGTERM  # the default action, as without probe
    assert os.path.exists(sock) and os.path.exists(token)  # no exit hook ran
    then = time.time() - 60
    os.utime(sock, (then, then))  # it died a minute ago: past the 2 s guard of a socket being set up

    assert run_cli(str(other.pid), "health", env=env).code == 0  # any command that looks at the directory
    assert not os.path.exists(sock) and not os.path.exists(token)
    assert os.path.exists(_paths.socket_path(other.pid))

    rows = json.loads(run_cli("list", "--json", "--agents-only", env=env).out)
    dead = [r for r in rows if r["pid"] == proc.pid]
    assert dead and dead[0]["agent"] == "dead" and "SIGTERM" in dead[0]["state"], rows
    stacks = run_cli(str(proc.pid), "backtrace", env=env)
    assert stacks.code == 0 and "main_sleep" in stacks.out and "data_loader_wait" in stacks.out, stacks.out


def test_a_program_that_handles_sigterm_keeps_its_handler(runtime, target_factory):
    proc = target_factory("own_sigterm.py", env=_env(runtime))
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.read_line(10) == "TERM" and proc.alive()
    proc.popen.kill()
    proc.popen.wait(10)
    record = [n for n in os.listdir(runtime) if n.startswith("%d-" % proc.pid) and n.endswith(".crash")]
    assert record, os.listdir(runtime)
    with open(os.path.join(runtime, record[0])) as handle:
        assert "Thread 0x" not in handle.read()  # its SIGTERM wrote no stacks: its own handler ran instead


def test_the_injectors_copy_of_probe_goes_once_no_live_process_uses_it(runtime, target_factory):
    if shutil.which("gdb") is None:
        pytest.skip("probe PID inject needs gdb (apt-get install gdb)")
    from probe.injector import diagnose

    env = _env(runtime, probe=False)
    bare = dict(env)
    bare.pop("PYTHONPATH", None)  # the targets' own environment lacks probe: the injector exposes it
    first, second = (target_factory("inject_sleeping.py", env=bare, probe=False) for _ in range(2))
    problems = diagnose(first.pid)
    if problems:
        pytest.skip(problems[0].message)
    for proc in (first, second):
        injected = run_cli(str(proc.pid), "inject", "--timeout", "20", env=env)
        assert injected.code == 0, injected.err
    dirs = [n for n in os.listdir(runtime) if n.startswith("pkg-") and "." not in n]
    assert len(dirs) == 1, os.listdir(runtime)
    package = os.path.join(runtime, dirs[0])
    assert os.listdir(package) == ["probe"]  # the target's sys.path sees the package and nothing else
    assert len(os.listdir(package + ".users")) == 2

    first.kill()
    assert run_cli("list", env=env).code == 0
    assert os.path.isdir(package) and len(os.listdir(package + ".users")) == 1  # the second still imports from it
    query = run_cli(str(second.pid), "query", "SELECT count(*) AS n FROM python.threads", "-f", "json", env=env)
    assert query.code == 0 and json.loads(query.out)[0]["n"] >= 1, query.err  # lazy imports from the copy

    second.kill()
    assert run_cli("list", env=env).code == 0
    assert not os.path.exists(package) and not os.path.exists(package + ".users")


def test_probe_port_alone_binds_the_address_shown_and_every_interface_must_be_asked_for(runtime, target_factory):
    env = _env(runtime, probe=False)
    shown = socket.gethostbyname(socket.gethostname())  # what the host helper shows for this node
    port = _free_port()
    # A rank (LOCAL_RANK 0) serves on PROBE_PORT itself; a process with no rank known would take any port.
    alone = target_factory("idle.py", env=_env(runtime, PROBE="", PROBE_PORT=str(port), LOCAL_RANK="0"))
    health = json.loads(run_cli(str(alone.pid), "health", "--json", env=env).out)
    assert health["tcp"] == "%s:%d" % (shown, port) and health["tcp_reach"] == health["tcp"], health
    assert alone.popen.stderr is not None  # the agent started before READY: a warning would be there already
    ready, _, _ = select.select([alone.popen.stderr.fileno()], [], [], 0.2)
    assert not ready or not _probe_lines(os.read(alone.popen.stderr.fileno(), 65536).decode()), "a warning"

    port = _free_port()
    every = target_factory("idle.py", env=_env(runtime, PROBE="", PROBE_PORT="0.0.0.0:%d" % port, LOCAL_RANK="0"))
    warned = _probe_lines(_stderr_until(every, lambda text: "every interface" in text))
    assert warned == ["probe: the agent in process %d serves TCP on every interface (0.0.0.0:%d; token required); "
                      "PROBE_LISTEN=ADDRESS:PORT binds one" % (every.pid, port)], warned
    health = json.loads(run_cli(str(every.pid), "health", "--json", env=env).out)
    assert health["tcp"] == "0.0.0.0:%d" % port and health["tcp_reach"] == "%s:%d" % (socket.gethostname(), port)
    assert health["token_file"] == _paths.job_token_path(port)
