"""TLS on the TCP listeners (issue 22): certificates made here with the openssl CLI, a real agent under
PROBE_PORT serving TLS, the client's --cacert/--cert/--key, a wrong CA, a plain client on a TLS port and a
TLS client on a plain one, mutual TLS, and a 2-rank job's --all-ranks backtrace through its node helper."""

import json
import os
import shutil
import socket
import subprocess
import time

import pytest

from procs import run_cli, running, scaled, target_env
from test_node_helper import _until, ranks_of

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl command to make certificates")


def _openssl(*args: str, cwd: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(directory: str, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", name + ".key", "-out", name + ".pem",
             "-days", "2", "-subj", "/CN=probe test " + name, cwd=directory)


def _signed(directory: str, name: str, ca: str, san: str = "") -> None:
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", name + ".key", "-out", name + ".csr",
             "-subj", "/CN=" + name, cwd=directory)
    ext = os.path.join(directory, name + ".ext")
    with open(ext, "w") as handle:
        handle.write("subjectAltName=%s\n" % san if san else "basicConstraints=CA:FALSE\n")
    _openssl("x509", "-req", "-in", name + ".csr", "-CA", ca + ".pem", "-CAkey", ca + ".key", "-CAcreateserial",
             "-out", name + ".pem", "-days", "2", "-extfile", ext, cwd=directory)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """ca (signs the server and the client), other_ca (signs nothing we use), server (for 127.0.0.1 and
    localhost), client (signed by ca), stranger (a client certificate signed by other_ca)."""
    directory = str(tmp_path_factory.mktemp("certs"))
    _ca(directory, "ca")
    _ca(directory, "other_ca")
    _signed(directory, "server", "ca", "IP:127.0.0.1,DNS:localhost")
    _signed(directory, "client", "ca")
    _signed(directory, "stranger", "other_ca")
    return {name: os.path.join(directory, name + ".pem") for name in ("ca", "other_ca", "server", "client", "stranger")}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _target(certs, tmp_path, mutual: bool = False):
    port = _free_port()
    token = tmp_path / "token"
    token.write_text("tls-test-token\n")
    token.chmod(0o600)
    tls = dict(PROBE_TLS_CERT=certs["server"], PROBE_TLS_KEY=certs["server"][:-4] + ".key")
    if mutual:
        tls["PROBE_TLS_CLIENT_CA"] = certs["ca"]
    env = target_env(PROBE_LISTEN="127.0.0.1:%d" % port, PROBE_TOKEN_FILE=str(token), **tls)
    return running("idle.py", env=env), "127.0.0.1:%d" % port, str(token)


def _cli(*args: str):
    return run_cli(*args, timeout=scaled(60))


def test_a_tls_agent_answers_with_the_right_ca_and_refuses_a_wrong_one_or_plain_http(certs, tmp_path):
    proc, address, token = _target(certs, tmp_path)
    with proc:
        ok = _cli(address, "--token-file", token, "--cacert", certs["ca"], "query", "SELECT 41 + 1 AS x", "-f", "csv")
        assert ok.code == 0, ok.err
        assert ok.out.split() == ["x", "42"]
        env_ok = run_cli(address, "query", "SELECT 1 AS y", "-f", "csv", timeout=scaled(60),
                         env=target_env(probe=False, PROBE_CACERT=certs["ca"], PROBE_TOKEN_FILE=token))
        assert env_ok.code == 0 and env_ok.out.split() == ["y", "1"], env_ok.err

        wrong = _cli(address, "--token-file", token, "--cacert", certs["other_ca"], "query", "SELECT 1")
        assert wrong.code == 3, (wrong.code, wrong.err)  # as every other connect error
        assert "certificate of the agent at %s is not trusted" % address in wrong.err, wrong.err
        assert "Traceback" not in wrong.err

        plain = _cli(address, "--token-file", token, "query", "SELECT 1")
        assert plain.code == 3, (plain.code, plain.err)
        assert "the agent at %s speaks TLS: give --cacert" % address in plain.err, plain.err

        # and the agent still serves after all that, while clients hold handshakes half done: the handshake
        # runs on each connection's worker, never on the accept thread
        host, port = address.split(":")
        stalled = [socket.create_connection((host, int(port)), timeout=scaled(10)) for _ in range(3)]
        try:
            for sock in stalled:
                sock.sendall(b"\x16\x03\x01\x00")  # the start of a ClientHello, and no more
            start = time.monotonic()
            again = _cli(address, "--token-file", token, "--cacert", certs["ca"], "backtrace")
            assert again.code == 0, again.err
            assert "MainThread" in again.out
            assert time.monotonic() - start < scaled(8)
        finally:
            for sock in stalled:
                sock.close()


def test_a_tls_client_on_a_plain_port_is_told_so(certs, tmp_path):
    port = _free_port()
    token = tmp_path / "token"
    token.write_text("tls-test-token\n")
    token.chmod(0o600)
    with running("idle.py", env=target_env(PROBE_LISTEN="127.0.0.1:%d" % port, PROBE_TOKEN_FILE=str(token))):
        out = _cli("127.0.0.1:%d" % port, "--token-file", str(token), "--cacert", certs["ca"], "query", "SELECT 1")
        assert out.code == 3, (out.code, out.err)
        assert "speaks plain TCP, not TLS" in out.err and "--cacert" in out.err, out.err


def test_mutual_tls_wants_a_client_certificate_signed_by_its_ca(certs, tmp_path):
    proc, address, token = _target(certs, tmp_path, mutual=True)
    base = (address, "--token-file", token, "--cacert", certs["ca"])
    with proc:
        ok = _cli(*base, "--cert", certs["client"], "--key", certs["client"][:-4] + ".key", "query", "SELECT 7 AS z",
                  "-f", "csv")
        assert ok.code == 0, ok.err
        assert ok.out.split() == ["z", "7"]

        without = _cli(*base, "query", "SELECT 1")
        assert without.code == 3, (without.code, without.err)
        assert "client certificate" in without.err and "--cert" in without.err, without.err

        # the audit trail names the client's certificate beside its address
        ran = _cli(*base, "--cert", certs["client"], "--key", certs["client"][:-4] + ".key", "eval", "6 * 7")
        assert ran.code == 0 and ran.out.strip() == "42", ran.err
        trail = _cli(*base, "--cert", certs["client"], "--key", certs["client"][:-4] + ".key", "query",
                     "SELECT peer FROM probe.audit WHERE command = 'eval'", "-f", "csv")
        assert trail.code == 0, trail.err
        assert "127.0.0.1:" in trail.out and "(CN=client)" in trail.out, trail.out

        stranger = _cli(*base, "--cert", certs["stranger"], "--key", certs["stranger"][:-4] + ".key", "query", "SELECT 1")
        assert stranger.code == 3, (stranger.code, stranger.err)
        assert "refused the client certificate" in stranger.err, stranger.err


def test_all_ranks_backtrace_through_the_node_helper_over_tls(certs, tmp_path):
    tls = dict(PROBE_TLS_CERT=certs["server"], PROBE_TLS_KEY=certs["server"][:-4] + ".key", PROBE_CACERT=certs["ca"])
    with ranks_of(tmp_path, 2, GIL_RANK="none", **tls) as job:
        master = "127.0.0.1:%d" % job["port"]
        env = job["env"]

        def listed() -> bool:
            out = run_cli(master, "--cacert", certs["ca"], "ranks", "-f", "json", env=env)
            return out.code == 0 and len(json.loads(out.out)) == 2

        _until(listed, 30, "2 ranks listed over TLS")
        for via in ("helpers", "direct"):
            out = run_cli(master, "--cacert", certs["ca"], "--all-ranks", "--via", via, "backtrace", env=env,
                          timeout=scaled(90))
            assert out.code == 0, (via, out.code, out.err)
            assert "rank" in out.out and "0-1" in out.out, (via, out.out)
        plain = run_cli(master, "--all-ranks", "backtrace", env=env, timeout=scaled(90))
        assert plain.code != 0
        assert "speaks TLS: give --cacert" in plain.err, plain.err
