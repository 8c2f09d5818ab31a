"""``probe T debug``: debugpy inside the target, for an IDE to attach to.

debugpy runs with its debug adapter in the process (``in_process_debug_adapter``): no helper process
that would outlive the target, and no need for the target's interpreter to be able to start one. Where
the target's environment lacks debugpy, the client (on the same host) names a private directory that
holds only a ``debugpy`` link to its own copy, as the injector does for probe; it is on ``sys.path``
only for the import. debugpy has no authentication, so a listener on anything but a loopback address
needs the caller's explicit ``insecure`` consent.

debugpy has no call to stop listening: stopping tells its accepting thread to end, shuts its listening
socket down to wake it (a plain close would leave it blocked in ``accept`` serving on), closes the
socket, and ends debugpy's tracing and threads; a later start listens afresh, on the same port or
another. Runs in the target; stdlib only (debugpy is imported on the first start), 3.9+.
"""

import importlib
import importlib.util
import ipaddress
import os
import socket
import stat
import sys
import threading
from typing import Any, Dict, Optional, Tuple

from probe.errors import BadRequest, Forbidden, InternalError

__all__ = ["start", "stop", "status", "is_loopback"]

_lock = threading.Lock()
_address: Optional[Tuple[str, int]] = None


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
            "port": address[1] if address else None, "pid": os.getpid()}


def start(host: str, port: int, insecure: bool = False, import_dir: Optional[str] = None) -> Dict[str, Any]:
    """Listen for a debugger client on ``host:port``; the address it listens on (port 0: a free one)."""
    global _address
    if not is_loopback(host) and not insecure:
        raise Forbidden("debugpy has no authentication: on %s anyone who reaches the port can run code in this "
                        "process" % host, hint="keep 127.0.0.1 and tunnel with ssh -L, or insist with --insecure")
    with _lock:
        if _address is not None:
            return dict(status(), already=True)
        debugpy = _import_debugpy(import_dir)
        if port:
            _check_port_free(host, port)
        try:
            _allow_restart()
            bound = debugpy.listen((host, port), in_process_debug_adapter=True)
        except Exception as exc:
            raise InternalError("debugpy could not listen on %s:%d: %s" % (host, port, exc),
                                hint="choose another port with --port (0: any free one)") from None
        _address = (str(bound[0]), int(bound[1]))
        return dict(status(), already=False)


def stop() -> Dict[str, Any]:
    """Stop listening and debugging; a no-op where debugpy does not run."""
    global _address
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
        except Exception as exc:
            raise InternalError("debugpy did not stop cleanly: %s: %s" % (type(exc).__name__, exc)) from None
        finally:
            for _, server in servers:  # shut down, the socket still held the port: a later start there failed
                try:
                    server.close()
                except OSError:
                    pass
        _address = None
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


def _allow_restart() -> None:
    """debugpy refuses a second ``listen`` in one process even after it was stopped; we stop it fully.
    pydevd also keeps the first session's address (``SetupHolder.setup``) and would listen there again,
    whatever the new port: forgotten once the stopped session's debugger is gone."""
    api = sys.modules.get("debugpy.server.api")
    if api is not None and getattr(getattr(api, "listen", None), "called", False):
        api.listen.called = False
    pydevd = sys.modules.get("pydevd")
    holder = getattr(pydevd, "SetupHolder", None)
    current = getattr(pydevd, "get_global_debugger", None)
    if holder is not None and callable(current) and current() is None:
        holder.setup = None


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
