"""The page's HTTP server: the static files, and JSON gathered with the commands' own client calls.

A ``ThreadingHTTPServer`` in the CLI process, bound to 127.0.0.1 unless asked otherwise. The job's
token never leaves this process. Every request, the HTML included, passes probe.page.access first: the
peer must run as the page's owner (its uid read from the kernel, as ``debug`` reads it) and carry the
page token (random, new each start: in the printed URL, then a cookie), and a POST must show it was sent
by the page itself (no cross-site request forgery). Another user's connections, refused, get a few
threads of this process at most, however many they open (``_Server``); an idle connection goes after
``IDLE_S``.

Each gathering runs at most once at a time, whatever the number of tabs: a request that finds one
under way waits for it and takes its answer, and an answer younger than the refresh interval is given
again. What a gathering sends is bounded (see probe.page.data). Only reads are made: SQL, stacks,
diagnose, and ``trace export`` (the control scope, as the command); no eval, no trace start or stop.
"""

import json
import os
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, Optional, Tuple
from urllib.parse import parse_qs, urlsplit

from probe.errors import ProbeError
from probe.page.access import Gate, is_loopback, peer_uid

__all__ = ["PageServer", "is_loopback", "STATIC"]

STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
_FILES = {"/": ("index.html", "text/html; charset=utf-8"), "/index.html": ("index.html", "text/html; charset=utf-8"),
          "/static/page.js": ("page.js", "text/javascript; charset=utf-8"),
          "/static/page.css": ("page.css", "text/css; charset=utf-8")}
_MAX_BODY = 64 * 1024
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
"""Nothing from elsewhere, no inline script: the page runs only the script shipped beside it."""


class _Once:
    """A gathering run at most once at a time; an answer younger than ``ttl`` seconds, or than twice the
    time the gathering took, is given again: whatever the refresh and the tabs, the page keeps the job
    busy a third of the time at most (a diagnose of many ranks takes seconds)."""

    def __init__(self, work: Callable[[], Any], ttl: float) -> None:
        self.work = work
        self.ttl = ttl
        self.value: Any = None
        self.at = 0.0
        self.took = 0.0
        self._lock = threading.Lock()

    def get(self) -> Any:
        with self._lock:
            if self.value is not None and time.monotonic() - self.at < max(self.ttl, 2 * self.took):
                return self.value
            start = time.monotonic()
            try:
                self.value = self.work()
            except ProbeError as exc:
                self.value = {"error": exc.message + (" -- %s" % exc.hint if exc.hint else "")}
            self.at = time.monotonic()
            self.took = self.at - start
            return self.value

    def peek(self) -> Any:
        return self.value


UNCHECKED = 16
"""Connections given a thread before their peer's uid is known (the handler checks it, as for every request)."""
REFUSALS_AT_ONCE = 8
"""Beyond those, connections of refused peers (another user of the machine) answered at once; more are closed."""
IDLE_S = 30.0
"""A connection that sends nothing, or takes nothing of an answer, for this long is closed."""


class _Server(ThreadingHTTPServer):
    """A thread a connection, as ``ThreadingHTTPServer``, but another local user's connections get at most
    ``UNCHECKED + REFUSALS_AT_ONCE`` threads, however many they open: the threads of this process count
    against its user's process limit, which the job's ranks may share. While fewer than ``UNCHECKED``
    connections are open, each is given its thread at once; past that, the peer's uid is read on the accept
    thread (the kernel's TCP table) before a thread is started, and the gate's refusals are counted apart."""

    daemon_threads = True
    gate: Optional[Gate] = None

    def __init__(self, address: Tuple[str, int], handler: Any) -> None:
        super().__init__(address, handler)
        self._kinds: Dict[int, Tuple[str, Any]] = {}  # id(request) -> (how it was let in, the request)
        self._counts = {"unchecked": 0, "refused": 0, "owner": 0}
        self._lock = threading.Lock()

    def verify_request(self, request: Any, client_address: Any) -> bool:
        with self._lock:
            if self._counts["unchecked"] < UNCHECKED:
                return self._take(request, "unchecked")
        kind = "owner" if self.gate is None or self.gate.peer(peer_uid(request)) is None else "refused"
        with self._lock:
            if kind == "refused" and self._counts["refused"] >= REFUSALS_AT_ONCE:
                return False  # closed unanswered: enough of them are being answered
            return self._take(request, kind)

    def _take(self, request: Any, kind: str) -> bool:
        self._kinds[id(request)] = (kind, request)
        self._counts[kind] += 1
        return True

    def shutdown_request(self, request: Any) -> None:
        try:
            super().shutdown_request(request)
        finally:
            with self._lock:
                kind, _ = self._kinds.pop(id(request), ("", None))
                if kind:
                    self._counts[kind] -= 1


class PageServer:
    """Serves ``source`` (a probe.page.data JobSource or ProcessSource) on ``host:port`` (0: a free port)."""

    def __init__(self, source: Any, host: str = "127.0.0.1", port: int = 0, refresh: float = 5.0,
                 steps: int = 50, token: Optional[str] = None) -> None:
        from probe.page.data import StepHistory

        self.source = source
        self.refresh = refresh
        self.loopback = is_loopback(host)
        self.token = token or secrets.token_urlsafe(24)
        self.history = StepHistory(steps)
        ttl = max(1.0, refresh * 0.8)
        self._diagnose = _Once(self._gather_diagnose, ttl)
        self._overview = _Once(self._gather_overview, ttl)
        self._metrics = _Once(lambda: self.source.metrics(self.history), ttl)
        self._sql_lock = threading.Semaphore(2)  # SQL from the page: two at a time at most
        self._export_lock = threading.Lock()
        self.httpd = _Server((host, port), self._handler())
        self.port = self.httpd.server_address[1]
        self.host = host
        self.gate = self.httpd.gate = Gate(host, self.port, self.token)

    # -- what is gathered ------------------------------------------------------------------------

    def _gather_diagnose(self) -> Dict[str, Any]:
        from probe.page.data import diagnose_json

        report, sample = self.source.diagnose()
        return diagnose_json(report, sample, time.time())

    def _gather_overview(self) -> Dict[str, Any]:
        from probe.client.cluster import compact_ranks
        from probe.page.data import UNLISTED_WHY, flame, grid_state, stack_groups

        seen = self._diagnose.peek()
        states = seen.get("states", {}) if isinstance(seen, dict) else {}
        raw = self.source.overview()
        groups = stack_groups(raw["threads"])
        group_of = {r: g["group"] for g in groups for r in g["ranks"]}
        failed = {f["rank"]: f["reason"] for f in raw["failures"]}
        ranks = []
        for member in raw["members"]:
            rank = member["rank"]
            look = states.get(str(rank), {})
            state = grid_state(member.get("state"), look.get("state"))
            if state == "running" and rank in failed:
                state = "silent"  # it gave no stacks just now, whatever its node helper heard
            ranks.append({"rank": rank, "host": member.get("host"), "pid": member.get("pid"), "state": state,
                          "listed": member.get("state"), "group": group_of.get(rank),
                          "why": failed.get(rank) or raw["outside"].get(str(rank)) or look.get("why") or ""})
        unlisted = raw.get("unlisted") or []
        failures = list(raw["failures"])
        if unlisted:  # ranks of the job that no helper lists: a cell each, said as the command says them
            for rank in unlisted:
                look = states.get(str(rank), {})
                ranks.append({"rank": rank, "host": None, "pid": None, "state": grid_state("unreported", look.get("state")),
                              "listed": None, "group": None, "why": look.get("why") or UNLISTED_WHY})
            ranks.sort(key=lambda r: r["rank"])
            count = raw.get("unlisted_count", len(unlisted))
            failures.append({"rank": compact_ranks(unlisted) + (" and %d more" % (count - len(unlisted))
                                                                  if count > len(unlisted) else ""),
                             "host": "", "reason": UNLISTED_WHY})
        return {"ranks": ranks, "groups": groups, "flame": flame(raw["threads"], raw["total"]),
                "failures": failures, "total": raw["total"], "asked_directly": raw["asked_directly"],
                "at": time.strftime("%H:%M:%S"), "job": not self.source.single}

    def about(self) -> Dict[str, Any]:
        return {"target": self.source.label, "single": self.source.single, "refresh_s": self.refresh,
                "steps": self.history.steps, "backtrace": self.source.command(None, "backtrace"),
                "diagnose": self.source.command(None, "diagnose").replace(" --all-ranks diagnose", " diagnose")}

    def sql(self, body: Dict[str, Any]) -> Dict[str, Any]:
        sql = body.get("sql")
        if not isinstance(sql, str) or not sql.strip():
            raise ProbeError("no SQL given")
        rank = body.get("rank")
        if rank not in (None, "") and not (isinstance(rank, int) or (isinstance(rank, str) and rank.isdigit())):
            raise ProbeError("rank must be a number, or empty for every rank")
        rank = None if rank in (None, "") else int(rank)
        merge = body.get("merge") or None
        if merge is not None and not isinstance(merge, str):
            raise ProbeError("merge must be SQL text")
        if not self._sql_lock.acquire(timeout=30):
            raise ProbeError("two queries from the page are still running; try again once one ends")
        try:
            answer = self.source.sql(sql, rank, merge, 1000)
        finally:
            self._sql_lock.release()
        rest = "query %s" % _quote(sql) + (" --merge %s" % _quote(merge) if merge else "")
        answer["command"] = self.source.command([rank] if rank is not None else None, rest)
        return answer

    def export(self) -> Tuple[bytes, int]:
        from probe.page.data import MAX_TRACE_EVENTS

        with self._export_lock:
            events, failures = self.source.trace_events()
        if not events and failures:  # e.g. a read token (export needs control), torch not loaded: say why, no file
            raise ProbeError("no rank gave its trace: " + "; ".join("rank %s: %s" % (f["rank"], f["reason"])
                                                                    for f in failures[:3]) +
                             ("; and %d ranks more" % (len(failures) - 3) if len(failures) > 3 else ""))
        doc: Dict[str, Any] = {"traceEvents": events[:MAX_TRACE_EVENTS], "displayTimeUnit": "ms"}
        notes = []
        if len(events) > MAX_TRACE_EVENTS:
            notes.append("cut at %d events of %d" % (MAX_TRACE_EVENTS, len(events)))
        notes += ["rank %s: %s" % (f["rank"], f["reason"]) for f in failures]
        if notes:
            doc["otherData"] = {"probe": "; ".join(notes)}
        return json.dumps(doc).encode(), len(events)

    # -- serving -------------------------------------------------------------------------------------

    def urls(self) -> Dict[str, str]:
        shown = self.host if ":" not in self.host else "[%s]" % self.host
        if self.host in ("0.0.0.0", "::"):
            import socket

            shown = socket.gethostname()
        return {"url": "http://%s:%d/?token=%s" % (shown, self.port, self.token)}

    def serve(self) -> None:
        """Serve until Ctrl-C (KeyboardInterrupt), then close the socket; requests under way end with it."""
        threading.Thread(target=self._diagnose.get, name="probe-page-first-look", daemon=True).start()
        try:
            self.httpd.serve_forever(poll_interval=0.2)
        finally:
            self.httpd.server_close()

    def _handler(self) -> Any:
        page = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "probe-page"
            protocol_version = "HTTP/1.1"
            timeout = IDLE_S  # each read and write of the connection: an idle one goes, its thread with it

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: the terminal is the user's
                return

            def _send(self, code: int, body: bytes, kind: str, extra: Optional[Dict[str, str]] = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.send_header("X-Content-Type-Options", "nosniff")
                self.send_header("Content-Security-Policy", _CSP)
                self.send_header("Referrer-Policy", "no-referrer")
                for key, value in (extra or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _json(self, value: Any, code: int = 200) -> None:
                self._send(code, json.dumps(value, allow_nan=False, default=str).encode(),
                           "application/json; charset=utf-8")

            def _refused(self, method: str, path: str, query: Dict[str, Any]) -> Optional[str]:
                """Why the gate refuses this request: its peer (read once a connection), then the request."""
                if not hasattr(self, "_peer_refused"):
                    self._peer_refused = page.gate.peer(peer_uid(self.connection))
                return self._peer_refused or page.gate.refusal(method, path, self.headers, query)

            def _route(self, method: str) -> None:
                parts = urlsplit(self.path)
                query = parse_qs(parts.query)
                path = parts.path
                refused = self._refused(method, path, query)
                if refused:  # the connection closed after: a refused POST's body is never read
                    self.close_connection = True
                    if path.startswith("/api/"):
                        body, kind = json.dumps({"error": refused}).encode(), "application/json; charset=utf-8"
                    else:
                        body, kind = (refused + "\n").encode(), "text/plain; charset=utf-8"
                    self._send(403, body, kind, {"Connection": "close"})
                    return
                if method == "GET" and path in _FILES:
                    name, kind = _FILES[path]
                    with open(os.path.join(STATIC, name), "rb") as handle:
                        extra = {"Set-Cookie": page.gate.set_cookie()} if query.get("token") else None
                        self._send(200, handle.read(), kind, extra)
                    return
                if path == "/favicon.ico":
                    self._send(204, b"", "image/x-icon")
                    return
                if not path.startswith("/api/"):
                    self._json({"error": "no such page: %s" % path[:200]}, 404)
                    return
                try:
                    self._api(method, path, query)
                except ProbeError as exc:
                    self._json({"error": exc.message + (" -- %s" % exc.hint if exc.hint else "")}, 400)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                except Exception as exc:  # a surprise in a gathering: said to the page, the server goes on
                    self._json({"error": "%s: %s" % (type(exc).__name__, str(exc)[:500])}, 500)

            def _api(self, method: str, path: str, query: Dict[str, Any]) -> None:
                if method == "POST" and path == "/api/sql":  # its Content-Type, header and Origin checked by the gate
                    length = int(self.headers.get("Content-Length") or 0)
                    if length > _MAX_BODY:
                        raise ProbeError("a query of more than 64 KB")
                    try:
                        body = json.loads(self.rfile.read(length) or b"{}")
                    except ValueError:
                        raise ProbeError("the body is not JSON") from None
                    self._json(page.sql(body if isinstance(body, dict) else {}))
                    return
                if method != "GET":
                    self._json({"error": "%s is not served here" % method}, 405)
                    return
                if path == "/api/about":
                    self._json(page.about())
                elif path == "/api/diagnose":
                    self._json(page._diagnose.get())
                elif path == "/api/overview":
                    self._json(page._overview.get())
                elif path == "/api/metrics":
                    self._json(page._metrics.get())
                elif path == "/api/rank":
                    value = (query.get("rank") or [""])[0]
                    if not value.isdigit():
                        raise ProbeError("rank=N is needed")
                    self._json(page.source.rank(int(value)))
                elif path == "/api/trace":
                    body, count = page.export()
                    self._send(200, body, "application/json", {
                        "Content-Disposition": 'attachment; filename="probe-trace-%s.json"' % time.strftime("%Y%m%d-%H%M%S"),
                        "X-Probe-Events": str(count)})
                else:
                    self._json({"error": "no such endpoint: %s" % path[:200]}, 404)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self._route("GET")

            def do_HEAD(self) -> None:  # noqa: N802
                self._route("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._route("POST")

        return Handler


def _quote(text: str) -> str:
    import shlex

    return shlex.quote(text)
