"""``probe T debug``: debugpy inside the target, for an IDE to attach to.

debugpy runs with its debug adapter in the process (``in_process_debug_adapter``): no helper process
that would outlive the target, and no need for the target's interpreter to be able to start one. Where
the target's environment lacks debugpy, the client (on the same host) names a private directory that
holds only a ``debugpy`` link to its own copy, as the injector does for probe; it is on ``sys.path``
only for the import.

debugpy has no authentication of its own: whoever connects to its port can run code in the process. So
its listening socket admits only peers that the kernel says run as this process's user (or root): the
client's end of a connection from this host is in the kernel's TCP table (/proc/net/tcp) with its owner's
uid. A peer that is not there (another host, another network namespace) is refused unless the caller
insisted with ``insecure`` (a listener on an address other than loopback needs that anyway). An IDE on
another host reaches it through ``ssh -L``, whose forwarding runs as the user who logged in. And it does
not listen for ever: when no IDE is attached ``window_s`` after the start (or after the last one left),
debugpy is stopped.

debugpy has no call to stop listening: stopping tells its accepting thread to end, shuts its listening
socket down to wake it (a plain close would leave it blocked in ``accept`` serving on), closes the
socket, and ends debugpy's tracing and threads, its trace functions included wherever they were left on
a frame. It is not started again in the same process: pydevd does not start cleanly a second time (seen:
after a stop and an interrupted snippet, a second start left a new thread spinning with the GIL inside
pydevd's hook for new threads, and the agent answered nothing more), so one session serves the process's
lifetime, and IDEs attach to and detach from it freely. probe's own threads are never traced (see
``probe._threads``). Runs in the target; stdlib only (debugpy is imported on the first start), 3.9+.
"""

import importlib
import importlib.util
import ipaddress
import os
import socket
import stat
import struct
import sys
import threading
import time
from typing import Any, Dict, Optional, Tuple

from probe._threads import daemon_thread
from probe.errors import BadRequest, Forbidden, InternalError

__all__ = ["start", "stop", "status", "is_loopback", "peer_uid", "DEFAULT_WINDOW_S"]

DEFAULT_WINDOW_S = 600.0
"""How long debugpy listens with no IDE attached before it stops by itself."""

_lock = threading.Lock()
_address: Optional[Tuple[str, int]] = None
_session = 0  # bumped by every start and stop: a window timer of an earlier session does nothing
_window_s = DEFAULT_WINDOW_S
_stops_at: Optional[float] = None  # wall-clock time the window ends, while nothing is attached
_refused = 0  # connections refused by the peer check in this session
_stopped_at: Optional[float] = None  # when debugpy was stopped in this process: it is not started again


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def status() -> Dict[str, Any]:
    address = _address
    return {"listening": address is not None, "host": address[0] if address else None,
            "port": address[1] if address else None, "pid": os.getpid(), "uid": os.getuid(),
            "window_s": _window_s if address else None, "stops_at": _stops_at if address else None,
            "refused": _refused if address else 0}


def start(host: str, port: int, insecure: bool = False, import_dir: Optional[str] = None,
          window_s: float = DEFAULT_WINDOW_S) -> Dict[str, Any]:
    """Listen for a debugger client on ``host:port``; the address it listens on (port 0: a free one).
    ``window_s``: stop by itself when no IDE is attached that long after the start (or after the last one
    left)."""
    global _address, _session, _window_s, _stops_at, _refused
    if _stopped_at is not None and _address is None:
        raise Forbidden("debugpy was started and stopped in this process already (stopped at %s), and is not started "
                        "a second time: pydevd does not start cleanly twice in one process, and a second start can "
                        "leave the process's threads stuck for good" % time.strftime("%H:%M:%S", time.localtime(_stopped_at)),
                        hint="one debugpy session per process: an IDE may detach and attach again as often as it likes "
                             "while it listens, so stop it only when done (`--window` sets how long it waits for one)")
    if not is_loopback(host) and not insecure:
        raise Forbidden("debugpy has no authentication of its own: on %s anyone who reaches the port from another "
                        "host could run code in this process" % host,
                        hint="keep 127.0.0.1 and tunnel with ssh -L, or insist with --insecure")
    if not 1.0 <= window_s <= 7 * 86400.0:
        raise BadRequest("the listening window must be between 1 s and 7 days, not %r s" % window_s)
    with _lock:
        if _address is not None:
            return dict(status(), already=True)
        debugpy = _import_debugpy(import_dir)
        if port:
            _check_port_free(host, port)
        _refused = 0
        restore = _gate_server_sockets(insecure)
        try:
            bound = _listen_on_own_thread(debugpy, host, port)
        except Exception as exc:
            raise InternalError("debugpy could not listen on %s:%d: %s" % (host, port, exc),
                                hint="choose another port with --port (0: any free one)") from None
        finally:
            restore()
        _clear_frame_traces(only_agent=True)  # pydevd set its frame tracers on every thread's frames as it started
        _address = (str(bound[0]), int(bound[1]))
        _session += 1
        _window_s = float(window_s)
        _stops_at = time.time() + _window_s
        daemon_thread(_watch_window, "probe-debug-window", (_session,)).start()
        return dict(status(), already=False)


LISTEN_TIMEOUT_S = 30.0


def _listen_on_own_thread(debugpy: Any, host: str, port: int) -> Tuple[str, int]:
    """``debugpy.listen`` on a short-lived thread of its own. pydevd turns tracing on in the thread that
    starts it; the agent's threads carry the marks that make pydevd leave them alone, and a marked thread
    that starts it anyway deadlocks inside pydevd on a second start (seen: a request thread stopped on
    entering pydevd's ``set_trace_to_threads``, and the agent then answered nothing). The starting
    thread is unmarked, is traced for the moment it runs, and ends."""
    outcome: Dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["bound"] = debugpy.listen((host, port), in_process_debug_adapter=True)
        except BaseException as exc:  # reported to the request below; never raised in the target
            outcome["error"] = exc

    starter = threading.Thread(target=run, name="probe-debug-start", daemon=True)
    starter.start()
    starter.join(LISTEN_TIMEOUT_S)
    if starter.is_alive():
        raise InternalError("debugpy did not start listening within %.0f s" % LISTEN_TIMEOUT_S)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["bound"]


def _watch_window(session: int) -> None:
    """Stop debugpy once no IDE has been attached for the window: listening is an open door, kept open only
    while someone may be about to come in. Never raises into the target."""
    global _stops_at
    try:
        while True:
            time.sleep(1.0)
            if session != _session or _address is None:
                return
            if _client_attached():
                _stops_at = time.time() + _window_s  # counted again from when the IDE leaves
                continue
            if _stops_at is not None and time.time() >= _stops_at:
                with _lock:
                    if session != _session:
                        return
                stop()
                return
    except Exception:
        pass


def _client_attached() -> bool:
    debugpy = sys.modules.get("debugpy")
    try:
        return bool(debugpy is not None and debugpy.is_client_connected())
    except Exception:
        return False


# -- who may connect ---------------------------------------------------------------------------------

def _gate_server_sockets(insecure: bool) -> Any:
    """Make the listening socket pydevd is about to create one that admits only this user's (or root's)
    connections; returns the function that puts pydevd's own factory back once it listens."""
    try:  # imports pydevd the way debugpy sets it up (its vendored copy, on the path debugpy gives it)
        importlib.import_module("debugpy.server.api")
    except ImportError:
        pass
    pydevd = sys.modules.get("pydevd")
    original = getattr(pydevd, "create_server_socket", None)
    if pydevd is None or original is None:
        raise InternalError("this debugpy's server cannot be restricted to the process's user, so it is not started",
                            hint="use the debugpy version probe is tested with (pip install 'debugpy>=1.8')")

    def create_gated(host: str, port: int) -> socket.socket:
        server = original(host=host, port=port)
        gated = _OwnerOnlyServer(server.family, server.type, server.proto, fileno=server.detach())
        gated.insecure = insecure
        return gated

    pydevd.create_server_socket = create_gated

    def restore() -> None:
        if getattr(pydevd, "create_server_socket", None) is create_gated:
            pydevd.create_server_socket = original
    return restore


class _OwnerOnlyServer(socket.socket):
    """A listening socket whose ``accept`` hands over only connections from this user's processes (or
    root's); others are closed at once, and counted."""

    insecure = False

    def accept(self) -> Tuple[socket.socket, Any]:  # type: ignore[override]
        global _refused
        while True:
            conn, address = super().accept()
            uid = peer_uid(conn)
            if uid in (os.getuid(), 0) or (uid is None and self.insecure):
                return conn, address
            _refused += 1
            try:
                conn.close()
            except OSError:
                pass


def peer_uid(conn: socket.socket) -> Optional[int]:
    """The uid that owns the other end of TCP connection ``conn``, where that end is on this host (in this
    network namespace): the kernel's TCP table lists it, local and remote addresses swapped, with its
    owner. None where it is not listed."""
    try:
        ours, theirs = conn.getsockname(), conn.getpeername()
    except OSError:
        return None
    six = conn.family == socket.AF_INET6
    wanted = (_proc_net_address(theirs, six), _proc_net_address(ours, six))
    for table in ("/proc/net/tcp6", "/proc/net/tcp") if six else ("/proc/net/tcp",):
        try:
            with open(table) as handle:
                next(handle, None)
                for line in handle:
                    fields = line.split()
                    if len(fields) > 7 and (fields[1], fields[2]) == wanted:
                        return int(fields[7])
        except (OSError, ValueError):
            continue
    return None


def _proc_net_address(address: Any, six: bool) -> str:
    """``(host, port)`` as /proc/net/tcp{,6} writes it: the address's 32-bit words in host byte order, in
    hex, then the port."""
    host, port = address[0], address[1]
    if six:
        packed = socket.inet_pton(socket.AF_INET6, host)
        words = struct.unpack("=4I", packed)
        return "%08X%08X%08X%08X:%04X" % (words + (port,))
    return "%08X:%04X" % (struct.unpack("=I", socket.inet_aton(host))[0], port)


def stop() -> Dict[str, Any]:
    """Stop listening and debugging; a no-op where debugpy does not run."""
    global _address, _session, _stops_at, _stopped_at
    with _lock:
        if _address is None:
            return dict(status(), stopped=False)
        pydevd = sys.modules.get("pydevd")
        servers = []
        for thread in list(threading._active.values()):  # type: ignore[attr-defined]  # pydevd hides its own from enumerate()
            server = getattr(thread, "_server_socket", None) if type(thread).__name__ == "_WaitForConnectionThread" else None
            if server is not None:
                servers.append((thread, server))
                # Told to end first: woken from accept() while still meant to run, the thread listens again
                # on the same socket and blocks for ever, and the port stays taken after the close below.
                thread._kill_received = True
                try:
                    server.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
                except OSError:
                    pass
                thread.join(1.0)
        try:
            if pydevd is not None:
                pydevd.stoptrace()
                _untrace_other_threads()
                _clear_frame_traces()
        except Exception as exc:
            raise InternalError("debugpy did not stop cleanly: %s: %s" % (type(exc).__name__, exc)) from None
        finally:
            for _, server in servers:  # shut down, the socket still held the port: a later start there failed
                try:
                    server.close()
                except OSError:
                    pass
        _address = None
        _stops_at = None
        _stopped_at = time.time()
        _session += 1
        return dict(status(), stopped=True)


def _untrace_other_threads() -> None:
    """Take debugpy's trace function off every thread, not only this one.

    On Pythons without ``sys.monitoring`` (3.11 and older) pydevd traces every thread that existed when
    it started, and its ``stoptrace`` unsets only the calling thread's: the others kept calling into a
    debugger that was gone (seen: after ``debug --stop`` and an interrupted snippet, the agent's accept
    thread spun and answered nothing more). pydevd's own way into other threads sets each one a trace
    function that removes itself the first time it runs there."""
    tracing = sys.modules.get("pydevd_tracing")
    if tracing is None or getattr(sys.modules.get("_pydevd_bundle.pydevd_constants"), "PYDEVD_USE_SYS_MONITORING", False):
        return

    def remove_itself(frame: Any, event: str, arg: Any) -> None:
        sys.settrace(None)
        return None

    try:
        tracing.set_trace_to_threads(remove_itself, create_dummy_thread=False)
    except Exception:
        pass
    sys.settrace(None)


def _clear_frame_traces(only_agent: bool = False) -> None:
    """Take debugpy's per-frame trace functions off every frame of every thread. pydevd leaves them on the
    frames it traced; should anything turn tracing on again in that thread (a profiler, coverage, a new
    debug session), they would call into the debugger that is gone and could stop the thread for good."""
    try:
        frames = sys._current_frames()
    except Exception:
        return
    agent = {ident for ident, thread in list(threading._active.items())  # type: ignore[attr-defined]
             if getattr(thread, "pydev_do_not_trace", False)} if only_agent else None
    for ident, frame in frames.items():
        if agent is not None and ident not in agent:
            continue
        while frame is not None:
            trace = frame.f_trace
            if trace is not None and _is_pydevd(trace):
                try:
                    frame.f_trace = None
                except (AttributeError, TypeError, ValueError):
                    pass
            frame = frame.f_back


def _is_pydevd(function: Any) -> bool:
    """A trace function of pydevd's: its own class or function, possibly inside ``functools.partial``."""
    for _ in range(8):
        inner = getattr(function, "func", None)  # functools.partial, as pydevd wraps its frame tracers
        if inner is None:
            break
        function = inner
    for module in (getattr(type(function), "__module__", None), getattr(function, "__module__", None)):
        if isinstance(module, str) and ("pydevd" in module or "pydev_" in module):
            return True
    return False


def _check_port_free(host: str, port: int) -> None:
    """Refuse a port something already listens on. debugpy, started in the process, does not fail there:
    its server thread fails to bind and ``listen`` waits for it for ever, with a request thread of the
    agent inside and debugpy's tracing threads half started (seen with two ranks of a job on one host,
    both asked for 5678). A check, not a guarantee: a port taken between it and debugpy's bind still
    hangs, which the check makes a race instead of the rule."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        probe_socket = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise BadRequest("cannot listen on %s:%d: %s" % (host, port, exc)) from None
    try:
        probe_socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as debugpy's own: TIME_WAIT is no obstacle
        probe_socket.bind((host, port))
    except OSError as exc:
        raise BadRequest("port %d on %s is in use (%s): another process listens there, perhaps another rank's "
                         "debugpy" % (port, host, exc.strerror or exc),
                         hint="choose another port with --port, or --port 0 for any free one") from None
    finally:
        probe_socket.close()


def _import_debugpy(import_dir: Optional[str]) -> Any:
    if "debugpy" in sys.modules or _findable("debugpy"):
        return importlib.import_module("debugpy")
    if not import_dir:
        raise BadRequest("debugpy is not installed in this process's environment",
                         hint="install it there (pip install debugpy), or run probe from the same host")
    _check_dir(import_dir)
    sys.path.insert(0, import_dir)
    try:
        return importlib.import_module("debugpy")
    except ImportError as exc:
        raise BadRequest("debugpy from %s cannot be imported here: %s" % (import_dir, exc),
                         hint="install debugpy in the target's environment") from None
    finally:
        try:
            sys.path.remove(import_dir)
        except ValueError:
            pass


def _findable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _check_dir(path: str) -> None:
    """Only a directory of this process's user that nobody else may write goes on ``sys.path``."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise BadRequest("cannot use %s for debugpy: %s" % (path, exc.strerror)) from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise Forbidden("%s is not a directory of this process's user closed to others; debugpy is not "
                        "imported from it" % path, hint="install debugpy in the target's environment")
