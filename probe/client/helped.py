"""A rank on another host that is slow to answer: its node's host helper says why, from outside.

The client sends its request to the rank's agent directly. If no answer comes within ``GRACE_S``, it
asks the rank's host helper (in torchrun's launcher on that node, which shares no rank's GIL) what the
rank is doing: dead (and how), stopped, or a C call that keeps the GIL; then the stacks the helper read
from outside stand in for the agent's answer and the request is abandoned (the agent runs nothing for
a client that left). A rank that merely runs slowly is waited for, as for a local agent.
"""

import json
import select
import socket
import time
from typing import Any, Dict, NamedTuple, Optional

import probe.client.transport as transport
from probe.errors import AgentBlocked, ProbeError, ProcessDead

__all__ = ["HostHelper", "ask", "await_answer", "error_for", "GRACE_S", "CONNECT_S"]

GRACE_S = 0.5
"""How long a rank may take to answer before its helper is asked about it (every second after that)."""
ASK_TIMEOUT_S = 5.0
CONNECT_S = 1.0
"""How long a connect to a rank may take before its helper is asked why (a healthy rank's takes < 1 ms)."""


class HostHelper(NamedTuple):
    """Where a rank's host helper listens, and the token it takes."""

    address: transport.Address
    token: Optional[str]


def ask(helper: HostHelper, pid: int, timeout: float = ASK_TIMEOUT_S) -> Optional[Dict[str, Any]]:
    """The helper's view of rank process ``pid`` (``state``, ``message``, ``hint``, ``stacks``); None if it
    could not be asked."""
    try:
        answer = transport.request(helper.address, "GET", "/v1/outside/%d" % pid, None, None, timeout, token=helper.token)
        raw = json.loads(answer.body.decode("utf-8")) if answer.status == 200 else None
    except (ProbeError, ValueError, UnicodeDecodeError):
        return None
    return raw if isinstance(raw, dict) and isinstance(raw.get("state"), str) else None


def error_for(raw: Dict[str, Any], helper: HostHelper, label: str) -> Optional[ProbeError]:
    """The error that stands for the helper's answer (with the stacks it read), or None if it says the
    rank can answer."""
    from probe.client.outside import Diagnosis
    from probe.reader.wire import stacks_from_json

    state = raw["state"]
    if state not in ("dead", "stopped", "gil_held"):
        return None
    stacks = None
    if raw.get("stacks") is not None:
        try:
            stacks = stacks_from_json(raw["stacks"], "%s, read by its host helper at %s" % (label, helper.address))
        except ValueError:
            stacks = None
    message = str(raw.get("message"))[:1000]
    hint = str(raw.get("hint") or "")[:1000] or None
    exc: ProbeError = ProcessDead(message, hint=hint) if state == "dead" else AgentBlocked(message, hint)
    exc.diagnosis = Diagnosis(state, message, hint or "", stacks)  # type: ignore[attr-defined]
    return exc


def _answered(sock: socket.socket, seconds: float) -> bool:
    try:
        readable, _, _ = select.select([sock], [], [], max(0.0, seconds))
    except (OSError, ValueError):
        return True
    return bool(readable)


def await_answer(sock: socket.socket, helper: HostHelper, pid: int, label: str, timeout: float) -> Optional[ProbeError]:
    """Wait for the agent's answer on ``sock``: None once it is there (or the time is up), else the error
    that explains why it will not come."""
    deadline = time.monotonic() + timeout
    if _answered(sock, min(GRACE_S, timeout)):
        return None
    while time.monotonic() < deadline:
        raw = ask(helper, pid, min(ASK_TIMEOUT_S, max(deadline - time.monotonic(), 0.1)))
        if _answered(sock, 0):
            return None
        error = error_for(raw, helper, label) if raw is not None else None
        if error is not None:
            return error
        if _answered(sock, min(1.0, deadline - time.monotonic())):
            return None
    return None
