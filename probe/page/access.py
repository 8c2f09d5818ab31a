"""Who the page answers, and which requests it takes: its owner's browser (and scripts), nobody else.

The server listens on TCP, which every user of the machine reaches, and what it gives (the job's locals
through SQL, its stacks, the control-scope trace export) is the job's. So, for every request, the HTML and
the script included:

- the peer's uid, read from the kernel's TCP table as ``probe T debug`` reads it
  (``probe.agent.debugger.peer_uid``), must be the page's owner's (or root's, who may read the job
  anyway). A peer the table does not list (another machine) is let on only where the page serves on an
  address other than loopback, as ``--host`` says on start;
- the page token (random, new at each start) must come with it: in the printed URL's ``?token=``, which
  sets a cookie (HttpOnly, so no script reads it; SameSite=Strict, so no other site's page sends it;
  named for the port, as cookies ignore ports), or in ``X-Probe-Page-Token`` from a script.

The owner's browser also visits other sites, whose pages can send requests here with the owner's uid
(cross-site request forgery). A POST needs ``Content-Type: application/json`` exactly, the header
``X-Probe-Page: 1`` and an ``Origin`` that is the page's own: a form or a fetch without a preflight can
send none of the first two, and a browser names the page that sent it in the third. An ``/api/`` request
that a browser marks as sent from another origin (``Sec-Fetch-Site``) is refused too. Bound to loopback,
a request naming another host (``Host:``) is refused: a site pointing a DNS name of its own at this
address (DNS rebinding) reaches nothing.
"""

import hmac
import ipaddress
import os
from typing import Any, Dict, List, Mapping, Optional

from probe.agent.debugger import peer_uid

__all__ = ["Gate", "is_loopback", "peer_uid", "PAGE_HEADER"]

PAGE_HEADER = "X-Probe-Page"
"""The custom header a POST needs (value ``1``): a browser sends it cross-origin only after a preflight,
which this server never grants."""


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _user(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "uid %d" % uid


class Gate:
    """The page's admission rules for one server: ``peer`` decides on a connection, ``refusal`` on a
    request; both give the words of a refusal, or None."""

    def __init__(self, host: str, port: int, token: str) -> None:
        self.loopback = is_loopback(host)
        self.owner = os.getuid()
        self.token = token
        self.cookie = "probe_page_%d" % port

    def admits(self, uid: Optional[int]) -> bool:
        if uid is None:  # not in this machine's TCP table: another machine, reached only off loopback
            return not self.loopback
        return uid in (self.owner, 0)

    def peer(self, uid: Optional[int]) -> Optional[str]:
        """Why a connection whose peer runs as ``uid`` (None: not known) is refused, or None."""
        if self.admits(uid):
            return None
        who = "a process whose user cannot be told" if uid is None else "uid %d" % uid
        return ("this page admits only uid %d (%s), who started it; %s is refused: start `probe ... page` "
                "as yourself" % (self.owner, _user(self.owner), who))

    def says(self) -> str:
        """Whom it admits, for the line said on start."""
        owner = "uid %d (%s: you)" % (self.owner, _user(self.owner))
        if self.loopback:
            return "it admits %s only, with the token in the URL above" % owner
        return ("it admits %s on this machine and anyone on another one (whose user cannot be told), each "
                "with the token in the URL above" % owner)

    def given(self, headers: Mapping[str, str], query: Dict[str, List[str]]) -> str:
        """The token the request carries: its header, its ?token=, or its cookie."""
        value = headers.get("X-Probe-Page-Token") or (query.get("token") or [""])[0]
        if value:
            return value
        for raw in _all(headers, "Cookie"):  # split here: other sites' cookies on this host may not parse
            for pair in raw.split(";"):
                name, _, value = pair.strip().partition("=")
                if name == self.cookie:
                    return value.strip().strip('"')
        return ""

    def valid(self, value: str) -> bool:
        return bool(value) and hmac.compare_digest(value.encode("utf-8", "replace"), self.token.encode())

    def set_cookie(self) -> str:
        """The Set-Cookie value that carries the token after the printed URL was opened (a session cookie)."""
        return "%s=%s; Path=/; HttpOnly; SameSite=Strict" % (self.cookie, self.token)

    def refusal(self, method: str, path: str, headers: Mapping[str, str],
                query: Dict[str, List[str]]) -> Optional[str]:
        """Why this request is refused (the peer already admitted), or None."""
        host = (headers.get("Host") or "").lower()
        if self.loopback:
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if host and not is_loopback(name.strip("[]")):
                return "this page answers to 127.0.0.1 and localhost only (the request named %s)" % host[:100]
        if not self.valid(self.given(headers, query)):
            return "the page token is missing or wrong: open the URL probe printed, with its ?token="
        if path.startswith("/api/") and (headers.get("Sec-Fetch-Site") or "same-origin") not in ("same-origin", "none"):
            return "a request sent by a page of another origin is refused"
        if method == "POST":
            kind = [part.strip().lower() for part in (headers.get("Content-Type") or "").split(";")]
            if kind[0] != "application/json" or any(not part.startswith("charset=") for part in kind[1:]):
                return "send the query as JSON (Content-Type: application/json)"
            if headers.get(PAGE_HEADER) != "1":
                return "a POST needs the header %s: 1 (the page sends it)" % PAGE_HEADER
            origin = headers.get("Origin") or ""
            if not host or origin.lower() != "http://" + host:
                return "a POST needs an Origin header naming this page (http://%s); it named %r" % (host[:100], origin[:100])
        return None


def _all(headers: Any, name: str) -> List[str]:
    """Every value of a header that may come more than once (http.client's message, or a plain mapping)."""
    getter = getattr(headers, "get_all", None)
    if getter is not None:
        return list(getter(name) or [])
    value = headers.get(name)
    return [value] if value else []
