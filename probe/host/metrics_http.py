"""The metrics port's server: ``GET /metrics`` alone, on the agent's own bounded listener.

Why not ``prometheus_client.start_http_server``: it starts a thread for every connection and gives none a
time limit, so anyone who can reach the port (no token is asked: Prometheus scrapes it) could hold a
thread of torchrun's launcher per connection, a thousand of them with one process, and the threads count
against the job's user's process limit. ``probe.agent.listener`` bounds what the ranks' and the helper's
ports take: ``MAX_CONNECTIONS`` at once, a request within its read timeout, a slow or idle client evicted
for one that sends. It answers ``/metrics`` in the format the scraper asks for (``choose_encoder``), every
other path 404 and every other method 405; nothing a request says reaches the collector. Scrapes are made
one at a time, and the requests that waited for one made after they came take it too: a flood of scrapes
costs the launcher one collection at a time, never one a connection at once. Plain HTTP always, as Prometheus scrapes it by default;
nothing served here is a secret (docs/metrics.md says what is).
"""

import threading
import time
from typing import Any, Dict, Tuple

from probe.agent.http import Request, Response
from probe.errors import NotFound, ProbeError

__all__ = ["serve", "MetricsHandler"]


class _MethodNotAllowed(ProbeError):
    status = 405
    code = "method_not_allowed"


class MetricsHandler:
    """What the metrics port answers: the registry's text for ``GET /metrics``, an error for anything else."""

    def __init__(self, registry: Any) -> None:
        self.registry = registry
        self._lock = threading.Lock()
        self._made: Dict[str, Tuple[float, bytes]] = {}  # content type -> (when made, body)

    def __call__(self, request: Request) -> Response:
        try:
            path = request.path.split("?", 1)[0]
            if path != "/metrics":
                raise NotFound("the metrics port serves /metrics only, not %s" % path[:100])
            if request.method != "GET":
                raise _MethodNotAllowed("the metrics port takes GET only, not %s" % request.method[:20])
            content_type, body = self._body(request.headers.get("accept", ""))
            return Response(200, body, content_type)
        except ProbeError as exc:
            return Response.error(exc)
        except Exception as exc:  # noqa: BLE001 -- a bug of a collector: said to the scraper, the port serves on
            return Response.error(ProbeError("metrics error: %s: %s" % (type(exc).__name__, exc)))

    def _body(self, accept: str) -> Tuple[str, bytes]:
        from prometheus_client.exposition import choose_encoder

        came = time.monotonic()
        encoder, content_type = choose_encoder(accept[:1024])
        with self._lock:
            made = self._made.get(content_type)
            if made is None or made[0] < came:  # else made while this request waited: as fresh as its own
                made = self._made[content_type] = (time.monotonic(), encoder(self.registry))
            return content_type, made[1]


def serve(host: str, port: int, registry: Any) -> Any:
    """Listen on ``host:port`` and serve ``registry`` there, in daemon threads; the listener. Raises
    OSError where the port cannot be bound (EADDRINUSE: the caller tries again later)."""
    from probe.agent.listener import Listener
    from probe.agent.sockets import _listen_tcp

    sock = _listen_tcp(host, port)
    listener = Listener(sock, "tcp", MetricsHandler(registry), "probe-metrics-accept",
                        lambda: _listen_tcp(host, port))
    listener.start()
    return listener
