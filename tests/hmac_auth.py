"""The TCP handshake done by hand, for tests that speak raw HTTP to an agent or a host helper: the client's
half of ``probe.agent.handshake`` without the client's check of the listener's proof, so that a test can
also send what a wrong token would (and see the listener refuse it)."""

import json
import os
import socket
from typing import Dict, Tuple

from probe.agent.handshake import address_name, client_mac, server_proof


def hello(port: int, host: str = "127.0.0.1", nonce: str = "") -> Tuple[str, Dict[str, object]]:
    """(the client nonce sent, the listener's answer to ``GET /v1/hello``)."""
    cn = nonce or os.urandom(16).hex()
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(("GET /v1/hello HTTP/1.1\r\nHost: x\r\nX-Probe-Nonce: %s\r\nContent-Length: 0\r\n\r\n" % cn).encode())
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"200", head
    return cn, json.loads(body)


def authorization(port: int, token: str, method: str, path: str, body: bytes = b"", host: str = "127.0.0.1") -> str:
    """An ``Authorization`` value for one request to the listener at ``host:port``, made with ``token``
    whether or not the listener takes it (under the scope whose proof matches, else "eval")."""
    cn, answer = hello(port, host)
    sn, address = str(answer["nonce"]), str(answer["address"])
    key = token.encode("utf-8")
    proofs = answer["proofs"]
    assert isinstance(proofs, dict)
    scope = next((name for name, proof in proofs.items() if proof == server_proof(key, cn, sn, address)), "eval")
    return "Probe-HMAC scope=%s, cn=%s, sn=%s, mac=%s" % (scope, cn, sn,
                                                         client_mac(key, cn, sn, address, method, path, body))


def hello_body(cn: str, token: str, sockname: object) -> bytes:
    """The answer to a hello with nonce ``cn`` of a listener that holds ``token`` (a fake agent or helper
    of a test, standing in for one of the job's: what it answers after the hello is what the test is about)."""
    sn, address = os.urandom(16).hex(), address_name(sockname)
    return json.dumps({"nonce": sn, "address": address, "scheme": "Probe-HMAC",
                       "proofs": {"eval": server_proof(token.encode("utf-8"), cn, sn, address)}}).encode()


def answer_hello(conn: socket.socket, request: bytes, token: str) -> bool:
    """When ``request`` (its head at least) is a hello: answer it on ``conn`` for ``token`` and say True."""
    if not request.startswith(b"GET /v1/hello "):
        return False
    cn = ""
    for line in request.split(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"x-probe-nonce":
            cn = value.strip().decode("ascii", "replace")
    body = hello_body(cn, token, conn.getsockname())
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                 % len(body) + body)
    return True
