"""The sockets an agent's (or a node helper's) listener listens on: a unix socket only its owner may reach,
a TCP port, and the TLS context a TCP port speaks where ``PROBE_TLS_CERT`` asks for one. Stdlib only.
"""

import os
import socket
from typing import TYPE_CHECKING, Optional

from probe.errors import UsageError

if TYPE_CHECKING:
    import ssl

__all__ = ["server_tls_from_env", "_listen_unix", "_listen_tcp"]


def _listen_unix(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if os.path.lexists(path):
            os.unlink(path)  # a stale socket of a dead process with our pid, or ours that the program closed
        # No umask change: it is process-wide, and the target's threads may be creating files. The
        # directory is the owner's alone (0700), so nobody can reach the socket before the chmod.
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def _listen_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def server_tls_from_env() -> "Optional[ssl.SSLContext]":
    """The TLS context of this process's TCP listeners: ``PROBE_TLS_CERT`` and ``PROBE_TLS_KEY`` (PEM files;
    the key may be in the certificate's file), and ``PROBE_TLS_CLIENT_CA`` for mutual TLS. None where
    ``PROBE_TLS_CERT`` is unset (plain TCP). A file that cannot be used is a UsageError naming it: the
    caller serves no TCP rather than plain TCP where TLS was asked for."""
    cert = os.environ.get("PROBE_TLS_CERT")
    key = os.environ.get("PROBE_TLS_KEY") or None
    client_ca = os.environ.get("PROBE_TLS_CLIENT_CA") or None
    if not cert:
        if key or client_ca:
            raise UsageError("PROBE_TLS_KEY or PROBE_TLS_CLIENT_CA is set without PROBE_TLS_CERT",
                             hint="set PROBE_TLS_CERT to the listener's certificate (PEM)")
        return None
    import ssl  # only where TLS is asked for: the import costs a few ms

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ValueError) as exc:
        raise UsageError("cannot use PROBE_TLS_CERT=%s%s: %s" % (cert, " PROBE_TLS_KEY=%s" % key if key else "",
                                                                 getattr(exc, "strerror", None) or exc)) from None
    if client_ca:
        try:
            context.load_verify_locations(cafile=client_ca)
        except (OSError, ValueError) as exc:
            raise UsageError("cannot use PROBE_TLS_CLIENT_CA=%s: %s"
                             % (client_ca, getattr(exc, "strerror", None) or exc)) from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context
