"""Discovery: the ranks a job's host helper lists (``GET /v1/ranks``), each field checked as it comes
(a helper may be older, buggy or not ours), asked again briefly while ranks are still registering."""

import math
import os
import re
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

from probe import _paths
import probe.client.transport as transport
from probe.client.members import MAX_RANKS, Member, _with_port, compact_ranks
from probe.client.targets import parse_target
from probe.client.wording import option
from probe.errors import ConnectError, ConnectionRefused, ProbeError, UsageError

__all__ = ["Discovered", "discover", "discover_whole", "job_token", "MAX_LISTED", "WHOLE_LIST_S"]


def job_token(port: int) -> Optional[str]:
    """The job's token file on this host (the master, when the client runs there), when it is ours alone."""
    from probe.client.local_token import read_own_secret

    return read_own_secret(_paths.job_token_path(port))


class Discovered(NamedTuple):
    """What a host helper's ``GET /v1/ranks`` gave: the members that can be used, the job's token file
    (where the helper named one), and lines that say which members were left out, and why."""

    members: List[Member]
    token_file: Optional[str]
    left_out: List[str]


def discover(target: str, token: Optional[str], timeout: float = 5.0) -> Discovered:
    """The ranks the host helper next to ``target`` (``host:PROBE_PORT``; the helper is on port - 1) knows.

    The answer is checked field by field, as the helper checks a node's report: a helper may be older,
    buggy or not ours. A member with a field that is not what a helper sends is left out (``left_out``
    says which and why); an answer with no usable member, or not of a member list's shape, is refused
    with an error naming the helper."""

    parsed = parse_target(target)
    if not isinstance(parsed.address, transport.TcpAddress):
        raise UsageError("discovery needs the master's HOST:PORT (PROBE_PORT), not %s" % target,
                         hint="or list the targets: %s" % option("-t HOST:PORT several times, or --hosts FILE",
                                                                  "connect_all([\"HOST:PORT\", ...])"))
    host, port = parsed.address.host, parsed.address.port
    given_helper = os.environ.get("PROBE_HELPER_PORT")
    if given_helper and not (given_helper.isascii() and given_helper.isdigit() and 0 < int(given_helper) < 65536):
        raise UsageError("PROBE_HELPER_PORT=%s is not a port" % _shown(given_helper),
                         hint="unset it (the helper listens one below PROBE_PORT), or give a number from 1 to 65535")
    helper = transport.TcpAddress(host, int(given_helper or port - 1))

    def wrong_port() -> None:
        """Raise a usage error naming the job, where PORT is known here to be a rank's or a helper's port."""
        found = None if given_helper else _port_of_a_local_job(host, port)
        if found is not None:
            what, job = found
            raise UsageError("%s is %s of the job with PROBE_PORT=%d on this host, not the job's address"
                             % (target, what, job), hint=option("probe %s ranks", "connect_all(\"%s\")")
                             % _with_port(host, job))

    def unusable(why: str) -> ConnectError:
        return ConnectError("the host helper at %s sent %s" % (helper, why),
                            hint="is it a host helper of this probe's version? Upgrade probe where the job's launcher "
                                 "runs, or list the targets (%s)" % option("-t several times, or --hosts",
                                                                          "connect_all([\"HOST:PORT\", ...])"))

    try:
        answer = transport.request(helper, "GET", "/v1/ranks", None, None, timeout, token=token)
    except ConnectError as exc:
        wrong_port()
        missing = ConnectError("no host helper at %s to list the job's ranks (%s)" % (helper, exc.message),
                               hint="a job just started: its ranks start the helper within seconds, retry; otherwise "
                                    "start the job with PROBE=1 PROBE_PORT=%d (under any launcher); or list the targets "
                                    "(%s)" % (port, option("-t several times, or --hosts",
                                                           "connect_all([\"HOST:PORT\", ...])")))
        missing.job_address = (host, port)  # type: ignore[attr-defined]  # the CLI looks for a record of a death there
        # nothing listens there (no helper), not a helper that failed to answer: the CLI may then ask the one agent
        missing.nothing_listens = isinstance(exc, ConnectionRefused)  # type: ignore[attr-defined]
        raise missing from None
    raw = _json(answer.body)
    if answer.status >= 400:
        from probe.errors import error_from_code

        wrong_port()
        if answer.status == 404:  # an agent answers there (a rank's port), not a host helper
            raise UsageError("%s is a rank's agent, not a job's host helper: %s is not the job's PROBE_PORT"
                             % (helper, target), hint="give the job's PROBE_PORT: rank 0's port (the helper listens "
                                                      "one below it); or ask this rank alone: %s"
                                                      % (option("probe %s ...", "connect(\"%s\")") % target))
        error = raw.get("error") if isinstance(raw, dict) else None
        code = error.get("code") if isinstance(error, dict) else None
        if not isinstance(code, str):
            raise unusable("HTTP %d without an error of probe's form" % answer.status)
        message, hint = error.get("message"), error.get("hint")  # type: ignore[union-attr]
        raise error_from_code(code if len(code) < 40 else "internal",
                              "host helper at %s: %s" % (helper, message[:300] if isinstance(message, str) else
                                                         "HTTP %d" % answer.status),
                              hint[:300] if isinstance(hint, str) else None)
    if raw is _NOT_JSON:
        raise unusable("an answer that is not JSON")
    if not isinstance(raw, dict) or not isinstance(raw.get("members"), list):
        raise unusable("no member list")
    listed = raw["members"]
    if len(listed) > MAX_LISTED:
        raise unusable("%d members, more than the %d a host helper lists" % (len(listed), MAX_LISTED))
    own = raw.get("host")
    if own is not None and not _is_host(own):
        raise unusable("its own host as %s, not a host name or address" % _shown(own))
    token_file = raw.get("token_file")
    if not (isinstance(token_file, str) and 0 < len(token_file) <= 4096 and token_file.isprintable()):
        token_file = None  # only ever shown: one that is no path is not
    members: List[Member] = []
    problems: List[str] = []
    seen = set()
    for i, item in enumerate(listed):
        try:
            member = _member(item, host, own, helper)
            if member.rank in seen:
                raise _Unusable("rank %d again" % member.rank)
        except _Unusable as exc:
            problems.append("member %d: %s" % (i, exc))
            continue
        seen.add(member.rank)
        members.append(member)
    if problems and not members:
        raise unusable("no member that can be used (%s)" % _summary(problems))
    left_out = []
    if problems:
        left_out.append("the host helper at %s listed %d member%s that cannot be used, left out: %s" % (
            helper, len(problems), "" if len(problems) == 1 else "s", _summary(problems)))
    return Discovered(members, token_file, left_out)


MAX_LISTED = 1 << 18  # members in one helper's answer: the master's keeps 131072 of other nodes at most
_MAX_INT = (1 << 31) - 1
_MAX_PID = 1 << 22  # the kernel's PID_MAX_LIMIT
_HOST = re.compile(r"[A-Za-z0-9._:%\[\]-]{1,253}")  # a host name or address (IPv6 with or without [])
_STATE = re.compile(r"[a-z_]{1,20}")  # running, silent, ...: a word, so that a newer helper's is shown too
_NOT_JSON = object()


class _Unusable(Exception):
    """A member of a helper's answer that cannot be used, and why."""


def _json(body: bytes) -> Any:
    import json

    try:
        return json.loads(bytes(body).decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested too deeply
        return _NOT_JSON


def _shown(value: Any) -> str:
    """A value from a helper, short and printable enough to quote in an error (repr escapes controls)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() >= 64:
        return "an integer of %d bits" % value.bit_length()
    text = repr(value if not isinstance(value, (list, dict)) or len(value) < 8 else type(value)())
    text = text if text.isascii() else ascii(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _summary(problems: List[str], shown: int = 5) -> str:
    more = len(problems) - shown
    return "; ".join(problems[:shown]) + ("; and %d more" % more if more > 0 else "")


def _is_host(value: Any) -> bool:
    if type(value) is str and value in _HOSTS_SEEN:  # a node's ranks share their host: matched once
        return True
    good = isinstance(value, str) and _HOST.fullmatch(value) is not None
    if good:
        if len(_HOSTS_SEEN) >= 65536:
            _HOSTS_SEEN.clear()
        _HOSTS_SEEN.add(value)
    return good


_HOSTS_SEEN: Set[str] = set()


def _is_host_port(value: Any) -> bool:
    """``HOST:PORT`` (the host may be an IPv6 address, bracketed or not), port 1-65535."""
    if not isinstance(value, str):
        return False
    host, sep, port = value.rpartition(":")
    return bool(sep) and _is_host(host) and port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536


def _int(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _field(raw: Dict[str, Any], key: str, low: int, high: int, needed: bool = False) -> Optional[int]:
    """``raw[key]``, an integer from ``low`` to ``high``; None where absent (or null) and not ``needed``."""
    value = raw.get(key)
    if type(value) is int and low <= value <= high:  # the common case first: 7 fields a rank, 16k ranks
        return value
    if value is None and not needed:
        return None
    number = _int(value)
    if number is None or not low <= number <= high:
        raise _Unusable("%s is %s, not an integer from %d to %d" % (key, _shown(value), low, high))
    return number


def _member(raw: Any, typed_host: str, helper_host: Optional[str], helper: transport.TcpAddress) -> Member:
    """One member of a helper's answer, every field checked (see :func:`discover`); ``_Unusable`` if not."""
    if not isinstance(raw, dict):
        raise _Unusable("%s, not an object" % _shown(raw))
    rank = _field(raw, "rank", 0, _MAX_INT, needed=True)
    port = _field(raw, "port", 1, 65535, needed=True)
    host = raw.get("host")
    if not _is_host(host):
        raise _Unusable("host is %s, not a host name or address" % _shown(host))
    world_size = _field(raw, "world_size", 1, _MAX_INT)
    if world_size is not None and rank >= world_size:  # type: ignore[operator]
        raise _Unusable("rank %d is not below its world size %d" % (rank, world_size))
    pid = _field(raw, "pid", 1, _MAX_PID)
    local_rank, node = _field(raw, "local_rank", 0, _MAX_INT), _field(raw, "node", 0, _MAX_INT)
    restarts = _field(raw, "restarts", 0, _MAX_INT)
    state = raw.get("state")
    if state is not None and not (isinstance(state, str) and _STATE.fullmatch(state)):
        raise _Unusable("state is %s, not a word such as running" % _shown(state))
    age = raw.get("heartbeat_age")
    if age is not None and not (isinstance(age, (int, float)) and not isinstance(age, bool) and math.isfinite(age)
                                and 0 <= age < 1e9):
        raise _Unusable("heartbeat_age is %s, not null or seconds" % _shown(age))
    node_helper = raw.get("helper")
    if node_helper is not None and not _is_host_port(node_helper):
        raise _Unusable("helper is %s, not HOST:PORT" % _shown(node_helper))
    same_node = host == helper_host
    reach = typed_host if same_node else host  # the master's ranks: at the address the user gave
    if same_node:
        node_helper = "%s:%d" % ("[%s]" % helper.host if ":" in helper.host else helper.host, helper.port)
    note = raw.get("note")
    return Member(rank, host, _with_port(reach.strip("[]"), port), port, pid, state, local_rank,  # type: ignore[arg-type]
                  node, world_size, restarts, age, node_helper or None, note[:300] if isinstance(note, str) else None)


def _port_of_a_local_job(host: str, port: int) -> Optional[Tuple[str, int]]:
    """``("rank 1's port", 9700)`` or ``("the host helper's port", 9700)`` where ``host:port`` is on this
    host and belongs to a job of this host without being its PROBE_PORT; else None. Known from the job
    token files this host's helpers keep, and the member list of the helper beside each (asked with that
    token): only for a mistyped address, never on the way to an answer."""
    import socket

    try:
        address = socket.gethostbyname(host)
        if not address.startswith("127.") and address != socket.gethostbyname(socket.gethostname()):
            return None
        names = os.listdir(_paths.runtime_dir())
    except OSError:
        return None
    for job in sorted(int(m.group(1)) for m in (re.fullmatch(r"job-(\d+)\.token", n) for n in names) if m):
        if job == port or not job - 1 <= port < job + 4096:
            continue
        token = job_token(job)
        try:
            answer = transport.request(transport.TcpAddress("127.0.0.1", job - 1), "GET", "/v1/ranks", None,
                                       None, 2.0, token=token)
        except ProbeError:
            continue
        raw = _json(answer.body)
        if answer.status != 200 or not isinstance(raw, dict) or not isinstance(raw.get("members"), list):
            continue
        if port == job - 1:
            return "the host helper's port", job
        own = raw.get("host")
        for member in raw["members"]:
            if isinstance(member, dict) and member.get("port") == port and member.get("host") == own:
                rank = _int(member.get("rank"))
                return ("rank %d's port" % rank if rank is not None else "a rank's port"), job
    return None


WHOLE_LIST_S = 1.5
"""How long a listing that lacks ranks of the job's world size is asked for again: a rank registers with
its node's helper a moment after it learns its rank (under Lightning's ddp, only from
``init_process_group``), so a command run just then would otherwise ask fewer ranks and say nothing."""


def discover_whole(target: str, secret: Optional[str], timeout: float) -> Discovered:
    """The helper's listing, asked again every 0.1 s for up to ``WHOLE_LIST_S`` while it lists no rank or
    fewer ranks than the world size its members report; the ranks still missing then are said in
    ``left_out`` (the command exits 7: its answer is partial)."""
    import time

    give_up = time.monotonic() + min(WHOLE_LIST_S, timeout)
    while True:
        found = discover(target, secret, timeout)
        missing = _unlisted(found.members)
        if (found.members and not missing) or time.monotonic() >= give_up:
            break
        time.sleep(0.1)
    if found.members and missing:
        size = max(m.world_size or 0 for m in found.members)
        line = ("rank%s %s of the job's %d %s not listed by its helpers (not registered yet: starting, or on a "
                "node whose helper is not known); the answer covers the listed ranks only"
                % ("s" if len(missing) > 1 else "", compact_ranks(missing), size, "are" if len(missing) > 1 else "is"))
        found = found._replace(left_out=list(found.left_out) + [line])
    return found


def _unlisted(members: Sequence[Member]) -> List[int]:
    """The ranks below the largest world size the members report that no member is (capped: a world size
    is the members' word, not trusted to size a list)."""
    sizes = [m.world_size for m in members if isinstance(m.world_size, int) and 0 < m.world_size <= MAX_RANKS]
    if not sizes:
        return []
    listed = {m.rank for m in members}
    return [r for r in range(max(sizes)) if r not in listed]
