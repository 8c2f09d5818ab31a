"""A rank tells its node's helper who it is, under any launcher (``PROBE_PORT`` set).

One daemon thread per rank. Until the rank knows its number it looks every tenth of a second for two
minutes, then every two seconds (the launcher's variables, or ``torch.distributed`` once the program initialised
it: ``probe._rank.current``, which never imports torch); once registered, every two seconds it checks
that nothing changed: its identity, and the helper
(``node-PORT.sock``, the same file). A change costs one small request over the unix socket. Where no
helper serves the node's socket, this rank starts one (``python -m probe.host``, a process of its own, in
a session of its own, holding none of this process's descriptors); two ranks doing so at once are
sorted out by the helper's lock file.

Where Yama restricts ptrace to a process's ancestors (``ptrace_scope`` 1), the rank names its helper as
allowed to read it (``PR_SET_PTRACER``): that is how a helper that is not the rank's parent reads a rank
whose GIL a C call holds. Nothing here may raise into the program or wait on its behalf: every failure
is said once on stderr and the thread tries again later.
"""

import json
import os
import sys
import time
from typing import Any, Dict, Optional, Tuple

from probe import _paths, _rank
from probe._stderr import say as _say
from probe._threads import daemon_thread

__all__ = ["start"]

UNKNOWN_WAKE_S = 0.1  # while the rank does not know its number yet, for its first UNKNOWN_FAST_S: a rank that
# only torch.distributed numbers (Lightning's ddp, mp.spawn) is listed this soon after init_process_group; at
# 0.5 s a job asked right after its first steps was often answered without it (about 20 us a look)
UNKNOWN_FAST_S = 120.0  # then every KNOWN_WAKE_S: a process that never becomes a rank (mp.spawn's parent)
KNOWN_WAKE_S = 2.0
SPAWN_AGAIN_S = 10.0  # a helper that did not come up is started again no sooner than this
HELPER_UP_S = 10.0  # how long a freshly started helper may take to serve its socket
_PR_SET_PTRACER = 0x59616D61


def start(agent: Any, probe_port: str) -> None:
    """Register this process with its node's helper from now on (in a daemon thread); never raises."""
    try:
        if _rank.mp_role() == "helper":
            return  # multiprocessing's resource tracker or fork server: never a rank
        from probe.agent.options import probe_port_binding

        host, base = probe_port_binding(dict(os.environ, PROBE_PORT=probe_port))
        daemon_thread(_Registrar(agent, base, host).run, "probe-register").start()
    except BaseException as exc:
        _say("probe: rank in process %d does not register with its node's helper: %s" % (os.getpid(), exc))


class _Registrar:
    def __init__(self, agent: Any, base: int, host: str) -> None:
        self.agent = agent
        self.base = base
        self.host = host
        self.path = _paths.node_socket_path(base)
        self.sent: Optional[Tuple[Any, ...]] = None  # what the helper was last told, and which helper
        self.helper_pid = 0
        self.candidate_at: Optional[Tuple[int, int]] = None  # the helper told that this process may be a rank
        self.offered_start = False  # a process that knows no rank starts the node's helper once at most
        self.spawned_at = -SPAWN_AGAIN_S
        self.child: Any = None  # the helper this rank started, reaped once it exits
        self.complained = False

    def run(self) -> None:
        import probe.agent

        started = time.monotonic()
        while probe.agent.current() is self.agent:
            try:
                known = self.step()
            except Exception as exc:  # never into the program; said once
                known = True
                self._complain("%s: %s" % (type(exc).__name__, exc))
            if self.child is not None and self.child.poll() is not None:
                self.child = None
            fast = not known and time.monotonic() - started < UNKNOWN_FAST_S
            time.sleep(UNKNOWN_WAKE_S if fast else KNOWN_WAKE_S)

    def step(self) -> bool:
        """Register where something changed; False while the rank does not know its number."""
        who = _rank.current()
        if who.rank is None:
            self._offer_candidate(who)
            return False
        body = self._body(who)
        served = self._served()
        if served is None:
            served = self._start_helper()
            if served is None:
                return True
        if self.sent == (served, body):
            return True
        import probe.client.transport as transport

        answer = transport.request(transport.UnixAddress(self.path), "POST", "/v1/register",
                                   json.dumps(body).encode("utf-8"), {}, 2.0)
        if answer.status != 200:
            self._complain("the node helper refused the registration (HTTP %d): %s" % (
                answer.status, bytes(answer.body)[:300].decode("utf-8", "replace")))
            return True
        helper_pid = json.loads(bytes(answer.body)).get("helper_pid")
        if isinstance(helper_pid, int) and helper_pid != self.helper_pid:
            self.helper_pid = helper_pid
            _allow_tracer(helper_pid)
        self.sent = (served, body)
        return True

    def _offer_candidate(self, who: "_rank.Rank") -> None:
        """Before it knows its rank: tell the node's helper that this process may be one (once per helper;
        starting one, once, where none serves), so that if a C call takes its GIL right after it learns its
        rank, the helper can still put the job's one missing rank down to it."""
        served = self._served_now()
        if served is None and not self.offered_start:  # the job's first process: start the node's helper,
            self.offered_start = True  # once (one that finds no rank leaves after a while)
            served = self._start_helper()
        if served is None or self.candidate_at == served:
            return
        import probe.client.transport as transport

        body = dict(self._body(who), rank=None, source="unknown")
        self.candidate_at = served  # offered once to this helper, whatever it answers
        transport.request(transport.UnixAddress(self.path), "POST", "/v1/register", json.dumps(body).encode("utf-8"),
                          {}, 2.0)

    def _served_now(self) -> Optional[Tuple[int, int]]:
        """The node socket's identity where a helper listens on it now (a stat while it is the same file)."""
        try:
            info = os.stat(self.path)
        except OSError:
            return None
        identity = (info.st_dev, info.st_ino)
        if identity == self.candidate_at:
            return identity
        return identity if _paths.socket_state(self.path) == "listening" else None

    def _body(self, who: "_rank.Rank") -> Dict[str, Any]:
        address = getattr(self.agent, "tcp_address", None)
        port = int(address.rpartition(":")[2]) if address else None
        restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
        return {"pid": os.getpid(), "rank": who.rank, "local_rank": who.local_rank, "world_size": who.world_size,
                "node": who.node, "port": port, "source": who.source or "torchrun",
                "restarts": int(restarts) if restarts.isdigit() else 0,
                "master_addr": os.environ.get("MASTER_ADDR") or None}

    def _served(self) -> Optional[Tuple[int, int]]:
        """The node socket's identity (device, inode) where a helper serves it; else None. Where it is the
        socket this rank registered at and that helper is alive, a ``stat`` tells (no connection made, no
        socket table read, every two seconds in every rank)."""
        try:
            info = os.stat(self.path)
        except OSError:
            return None
        identity = (info.st_dev, info.st_ino)
        if self.sent is not None and self.sent[0] == identity and _alive(self.helper_pid):
            return identity
        if _paths.socket_state(self.path) != "listening":
            return None
        return identity

    def _start_helper(self) -> Optional[Tuple[int, int]]:
        """Start the node's helper (at most every ``SPAWN_AGAIN_S``) and wait for it to serve, bounded."""
        now = time.monotonic()
        if now - self.spawned_at < SPAWN_AGAIN_S:
            return None
        self.spawned_at = now
        import subprocess

        env = {k: v for k, v in os.environ.items() if k not in ("PROBE", "PROBE_LISTEN", "PROBE_TORCH_TRACE")}
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        log = _open_log(self.base)
        try:
            self.child = subprocess.Popen(
                [sys.executable, "-m", "probe.host", "--port", str(self.base), "--host", self.host],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, cwd="/", close_fds=True,
                start_new_session=True)
        finally:
            os.close(log)
        deadline = time.monotonic() + HELPER_UP_S
        while time.monotonic() < deadline:
            served = self._served()
            if served is not None:
                return served
            if self.child.poll() is not None and self.child.returncode != 0:
                break
            time.sleep(0.05)
        self._complain("the node helper it started did not serve %s (see %s)" % (self.path, _paths.node_log_path(self.base)))
        return None

    def _complain(self, why: str) -> None:
        if not self.complained:
            self.complained = True
            _say("probe: rank in process %d cannot register with its node's helper: %s" % (os.getpid(), why))


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists (not ours to signal)
    return True


def _open_log(base: int) -> int:
    """The node helper's log, opened for it to append to (started anew past 1 MB)."""
    path = _paths.node_log_path(base)
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        if os.stat(path).st_size > 1 << 20:
            flags |= os.O_TRUNC
    except OSError:
        pass
    return os.open(path, flags, 0o600)


def _allow_tracer(pid: int) -> None:
    """Let ``pid`` (the node helper) ptrace this process where Yama allows only ancestors to."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as handle:
            if handle.read().strip() != "1":
                return
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PTRACER, pid, 0, 0, 0)
    except Exception:
        pass
