"""One webhook post with a deadline for the whole of it, not for each read.

``urllib``'s ``timeout`` bounds each socket operation alone: an endpoint that sends its answer a byte a
second (a header line of 64 KB, a hundred of them, then a body) keeps a post going for a day, and with it
every later alert to that webhook. Here each connection the post opens is remembered, and at the deadline
it is shut down, whatever it is doing (connecting, the TLS handshake, reading headers or the body), which
ends the post with an error. The opener is urllib's own otherwise (proxies from the environment,
``https_proxy``; TLS checked against the system's CAs) but for redirects, which are not followed: urllib turns
a redirected POST into a GET without its body, which delivers no alert, and a webhook that answers one should
not make the helper ask a URL of its choosing on the node's network; a 3xx is a failed post. The answer's
body is read up to ``MAX_ANSWER_BYTES`` and dropped. A URL's ``user:password@`` (which urllib takes for
part of the host name: every post to it failed) is sent as HTTP basic authentication instead, to that host
alone.
"""

import base64
import http.client
import socket
import threading
import urllib.parse
import urllib.request
from typing import Any, List

__all__ = ["post", "Expired", "MAX_ANSWER_BYTES"]

MAX_ANSWER_BYTES = 4096


class Expired(OSError):
    """The post passed its deadline and was cut."""


class _Watch:
    """The sockets one post opened; all shut at the deadline, and any opened after it at once."""

    def __init__(self) -> None:
        self.socks: List[socket.socket] = []
        self.expired = False
        self._lock = threading.Lock()

    def add(self, sock: socket.socket) -> None:
        with self._lock:
            self.socks.append(sock)
            if not self.expired:
                return
        _shut(sock)

    def expire(self) -> None:
        with self._lock:
            self.expired = True
            socks = list(self.socks)
        for sock in socks:
            _shut(sock)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # the blocked recv/send/connect returns; the owner closes it
    except OSError:
        pass


def _watched(base: Any, watch: _Watch) -> Any:
    """``base`` (``HTTPConnection`` or ``HTTPSConnection``) whose sockets ``watch`` learns of as they are made:
    before the TLS handshake, which a slow endpoint could drag out too."""

    class Connection(base):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            make = self._create_connection

            def made(*a: Any, **k: Any) -> socket.socket:
                sock = make(*a, **k)
                watch.add(sock)
                return sock

            self._create_connection = made

        def connect(self) -> None:
            super().connect()
            watch.add(self.sock)  # HTTPS: the TLS socket the plain one was moved into

    return Connection


class _Http(urllib.request.HTTPHandler):
    def __init__(self, watch: _Watch) -> None:
        super().__init__()
        self.watch = watch

    def http_open(self, req: Any) -> Any:
        return self.do_open(_watched(http.client.HTTPConnection, self.watch), req)


class _Https(urllib.request.HTTPSHandler):
    def __init__(self, watch: _Watch) -> None:
        super().__init__()
        self.watch = watch

    def https_open(self, req: Any) -> Any:
        return self.do_open(_watched(http.client.HTTPSConnection, self.watch), req, context=self._context)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # urllib raises the 3xx as an HTTPError


def post(request: urllib.request.Request, deadline_s: float) -> int:
    """Send ``request`` and read (at most ``MAX_ANSWER_BYTES`` of) its answer within ``deadline_s`` in all; its
    HTTP status. Raises as ``urlopen`` does (``HTTPError`` for a status of 400 or more), and ``Expired`` where
    the deadline cut it."""
    _credentials_to_header(request)
    watch = _Watch()
    timer = threading.Timer(deadline_s, watch.expire)
    timer.daemon = True
    opener = urllib.request.build_opener(_Http(watch), _Https(watch), _NoRedirect())
    timer.start()
    try:
        with opener.open(request, timeout=deadline_s) as answer:
            answer.read(MAX_ANSWER_BYTES)
            status = int(answer.status)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        if watch.expired:
            raise Expired("no whole answer within %.0f s" % deadline_s) from None
        if isinstance(exc, http.client.HTTPException):
            raise OSError("%s: %s" % (type(exc).__name__, exc)) from None
        raise
    finally:
        timer.cancel()
        for sock in watch.socks:
            try:
                sock.close()
            except OSError:
                pass
    if watch.expired:
        raise Expired("no whole answer within %.0f s" % deadline_s)
    return status


def _credentials_to_header(request: urllib.request.Request) -> None:
    """Move ``user:password@`` out of the URL into an ``Authorization: Basic`` header for its host only."""
    parts = urllib.parse.urlsplit(request.full_url)
    if "@" not in parts.netloc:
        return
    userinfo, _, host = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    pair = "%s:%s" % (urllib.parse.unquote(user), urllib.parse.unquote(password))
    request.full_url = urllib.parse.urlunsplit(parts._replace(netloc=host))
    request.add_unredirected_header("Authorization", "Basic " + base64.b64encode(pair.encode("utf-8")).decode("ascii"))
