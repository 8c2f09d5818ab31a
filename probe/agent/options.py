"""How an agent is configured: explicit arguments first, then the environment, then defaults.

The same options travel from ``probe PID inject --listen ... --no-eval`` into the target as JSON, from
``PROBE_*`` variables through the start-up hook, and from ``probe.start(...)`` keyword arguments.
Stdlib only; Python 3.9+.
"""

import json
import os
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Dict, Mapping, Optional

__all__ = ["AgentOptions", "parse_hostport", "probe_port_binding", "binds_every_interface"]

_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class AgentOptions:
    """Everything an agent needs to know to start."""

    listen: Optional[str] = None
    """``host:port`` to serve on TCP as well (token required); None: unix socket only."""
    token: Optional[str] = None
    """The TCP token; None: take it from ``token_file`` or make one and write it to the token file."""
    token_file: Optional[str] = None
    """Where to read (if it exists) or write the TCP token; default: beside the unix socket."""
    read_token: Optional[str] = None
    """A token that gives the read scope on TCP (``PROBE_READ_TOKEN``); see ``probe.agent.scopes``."""
    read_token_file: Optional[str] = None
    """The file of the read token (``PROBE_READ_TOKEN_FILE``): read, or made (0600) when missing."""
    control_token: Optional[str] = None
    """A token that gives the control scope on TCP (``PROBE_CONTROL_TOKEN``)."""
    control_token_file: Optional[str] = None
    """The file of the control token (``PROBE_CONTROL_TOKEN_FILE``)."""
    unix_scope: str = "eval"
    """What the unix socket's owner may do: ``eval`` (everything), ``control`` or ``read`` (``PROBE_UNIX_SCOPE``)."""
    audit_reads: bool = False
    """Record read requests in the audit trail too (``PROBE_AUDIT_READS=1``); control and eval always are."""
    eval_enabled: bool = True
    """False makes the agent read-only: eval requests are refused."""
    show_secrets: bool = False
    """True shows the values of secret-looking environment variables in ``process.env``."""
    query_timeout: float = 10.0
    """Seconds a query may run before it is interrupted."""
    eval_timeout: float = 30.0
    """Seconds an eval may run before the request gives up (the snippet is interrupted)."""
    max_rows: int = 100_000
    """Rows a query returns at most; more are cut off and the result is flagged truncated."""
    memory_limit: str = "512MB"
    """DuckDB's memory limit inside the target."""
    max_result_bytes: int = 64 << 20
    """Bytes one query result may hold (its Arrow data); a larger result is refused, not materialised."""
    listen_fallback: bool = False
    """When ``listen``'s port is taken, serve on any free port of its host (and say so) rather than on none:
    a rank under ``PROBE_PORT``, which must not be left without TCP."""
    listen_note: Optional[str] = None
    """Why ``listen`` is not the port ``PROBE_PORT`` gives ranks (said once on stderr at start); None: it is."""

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, **overrides: Any) -> "AgentOptions":
        """Options from ``PROBE_*`` variables, with explicit ``overrides`` (not None) taking precedence."""
        env = os.environ if environ is None else environ
        values: Dict[str, Any] = {}
        listen = env.get("PROBE_LISTEN") or None
        port = env.get("PROBE_PORT")
        if port:
            listen, values["listen_fallback"], values["listen_note"] = _probe_port_listen(env)
        if listen:
            values["listen"] = listen
        if env.get("PROBE_TOKEN"):
            values["token"] = env["PROBE_TOKEN"]
        if env.get("PROBE_TOKEN_FILE"):
            values["token_file"] = env["PROBE_TOKEN_FILE"]
        elif port and "token" not in values:
            # One token per job, not per rank: every rank of the host (and its host helper) shares this file.
            from probe import _paths

            values["token_file"] = _paths.job_token_path(probe_port_binding(env)[1])
        for name in ("read_token", "read_token_file", "control_token", "control_token_file", "unix_scope"):
            if env.get("PROBE_" + name.upper()):
                values[name] = env["PROBE_" + name.upper()]
        if "PROBE_AUDIT_READS" in env:
            values["audit_reads"] = env["PROBE_AUDIT_READS"].strip().lower() not in _FALSE
        if "PROBE_EVAL" in env:
            values["eval_enabled"] = env["PROBE_EVAL"].strip().lower() not in _FALSE
        if "PROBE_SHOW_SECRETS" in env:
            values["show_secrets"] = env["PROBE_SHOW_SECRETS"].strip().lower() not in _FALSE
        if env.get("PROBE_QUERY_TIMEOUT"):
            values["query_timeout"] = float(env["PROBE_QUERY_TIMEOUT"])
        if env.get("PROBE_EVAL_TIMEOUT"):
            values["eval_timeout"] = float(env["PROBE_EVAL_TIMEOUT"])
        if env.get("PROBE_MAX_ROWS"):
            values["max_rows"] = int(env["PROBE_MAX_ROWS"])
        if env.get("PROBE_MAX_RESULT_BYTES"):
            values["max_result_bytes"] = _size(env["PROBE_MAX_RESULT_BYTES"])
        if env.get("PROBE_MEMORY_LIMIT"):
            values["memory_limit"] = env["PROBE_MEMORY_LIMIT"]
        if overrides.get("listen") is not None:  # an address asked for in so many words: that one or none
            values["listen_fallback"], values["listen_note"] = False, None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def with_overrides(self, **overrides: Any) -> "AgentOptions":
        given = {k: v for k, v in overrides.items() if v is not None}
        if "listen" in given:  # an address asked for in so many words: that one or none
            given = dict({"listen_fallback": False, "listen_note": None}, **given)
        return replace(self, **given)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "AgentOptions":
        """Options sent by the injector; unknown keys are ignored so an older agent accepts newer CLIs."""
        raw = json.loads(text) if text else {}
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})


def _probe_port_listen(env: Mapping[str, str]) -> "tuple[Optional[str], bool, Optional[str]]":
    """What ``PROBE_PORT`` makes this process listen on: (address or None, fall back on a clash, note).

    A rank whose local rank its launcher set (``probe._rank``) serves on ``PROBE_PORT + local rank``, or
    on any free port when that one is taken. A process whose rank is not known at start (a launcher such
    as ``accelerate launch``, a parent that waits for the ranks it spawned, a script that becomes rank 0
    later, a child of multiprocessing's spawn) serves on any free port: it never takes a rank's port, and
    may still be a rank. Multiprocessing's resource tracker and fork server serve no TCP at all.
    """
    from probe import _rank

    host, base = probe_port_binding(env)
    host = "[%s]" % host if ":" in host else host
    role = _rank.mp_role()
    if role == "helper":
        return None, False, None
    known = _rank.at_start(env)
    if known.local_rank is not None:
        return "%s:%d" % (host, base + known.local_rank), True, None
    if role == "child":  # a spawn child: may become a rank (mp.spawn); nothing to say for each worker
        return "%s:0" % host, False, None
    return ("%s:0" % host, False, "no local rank is known at its start (no LOCAL_RANK, SLURM_LOCALID, "
            "OMPI_COMM_WORLD_LOCAL_RANK, ...), so it takes none of the ranks' ports %d and up" % base)


def _size(text: str) -> int:
    """``"64MB"``, ``"1GiB"``, ``"1048576"`` -> bytes."""
    units = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 1 << 10, "MIB": 1 << 20,
             "GIB": 1 << 30}
    raw = text.strip().upper().replace(" ", "")
    number = raw.rstrip("KMGIB")
    unit = raw[len(number):]
    if not number.isdigit() or not number.isascii() or unit not in units:
        raise ValueError("expected a size such as 64MB or 1GiB, got %r" % text)
    return int(number) * units[unit]


def probe_port_binding(environ: Optional[Mapping[str, str]] = None) -> "tuple[str, int]":
    """Where ``PROBE_PORT`` serves (the ranks from its port on, the host helper one below): (host, port).

    ``PROBE_PORT=HOST:PORT`` binds HOST (``0.0.0.0``: every interface, which must be asked for);
    ``PROBE_LISTEN=HOST:...`` gives the host too. ``PROBE_PORT=PORT`` alone binds the address of the name
    the host helper shows for this node (``PROBE_HOST``, else the host name), so that the address shown is
    the address bound: other nodes reach it where that name is the node's address on the job's network;
    127.0.0.1 when the name does not resolve.
    """
    env = os.environ if environ is None else environ
    text = (env.get("PROBE_PORT") or "").strip()
    host, sep, port = text.rpartition(":")
    if not port.isdigit():
        raise ValueError("PROBE_PORT is PORT or HOST:PORT, got %r" % text)
    if sep:
        return host.strip("[]") or "0.0.0.0", int(port)
    if env.get("PROBE_LISTEN"):
        return parse_hostport(env["PROBE_LISTEN"])[0], int(port)
    import socket

    try:
        return socket.gethostbyname(env.get("PROBE_HOST") or socket.gethostname()), int(port)
    except OSError:
        return "127.0.0.1", int(port)


def binds_every_interface(host: str) -> bool:
    return host.strip("[]") in ("", "0.0.0.0", "::")


def parse_hostport(text: str) -> "tuple[str, int]":
    """``"0.0.0.0:9700"`` -> ("0.0.0.0", 9700); ``"[::1]:9700"`` -> ("::1", 9700); ``":9700"`` -> ("0.0.0.0", 9700)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError("expected HOST:PORT, got %r" % text)
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)
