"""Secrets stay masked in a read-only agent (``process.env``, ``process.info``'s command line), while what
is not secret (hosts, users, file paths, CA bundles, ordinary flags) stays readable: both sides of each
rule of :mod:`probe.tables.redact`, by hand and through a real target and the real CLI."""

import json
from typing import Dict, Iterator, List, Tuple

import pytest
from procs import Proc, run_cli, running, target_env

from probe.tables import process_env
from probe.tables.redact import MASK, looks_secret, mask_argv, mask_env_value, mask_text, mask_url_userinfo

PEM = "-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEAsecretpembody\n-----END RSA PRIVATE KEY-----"

# name -> (value, the secret parts that must not show, the readable parts that must show)
ENV: Dict[str, Tuple[str, List[str], List[str]]] = {
    "DATABASE_URL": ("postgres://trainer:hunter2@db:5432/x", ["hunter2"], ["postgres://trainer:", "@db:5432/x"]),
    "MLFLOW_TRACKING_URI": ("https://user:pa55@mlflow.example", ["pa55"], ["https://user:", "@mlflow.example"]),
    "GITHUB_PAT": ("ghp_patvalue123456", ["ghp_patvalue123456"], []),
    "SLACK_WEBHOOK": ("https://hooks.slack.com/services/T0/B0/webhooksecret", ["webhooksecret"], []),
    "AWS_SECRET_ACCESS_KEY": ("awssecretvalue/abc", ["awssecretvalue"], []),
    "TLS_MATERIAL": (PEM, ["secretpembody"], ["BEGIN RSA PRIVATE KEY"]),
    "ARTIFACT_URL": ("https://store.example/a.bin?sig=sigvalue&token=tokvalue&v=2",
                     ["sigvalue", "tokvalue"], ["https://store.example/a.bin?sig=", "&v=2"]),
    "SSL_CERT_FILE": ("/etc/ssl/certs/ca-bundle.crt", [], ["/etc/ssl/certs/ca-bundle.crt"]),
    "SSL_CERT_DIR": ("/etc/ssl/certs", [], ["/etc/ssl/certs"]),
    "PIP_CERT": ("/opt/pip/cert.pem", [], ["/opt/pip/cert.pem"]),
    "NODE_EXTRA_CA_CERTS": ("/opt/node/extra-ca.pem", [], ["/opt/node/extra-ca.pem"]),
    "MY_TOKEN_FILE": ("/run/secrets/my-token", [], ["/run/secrets/my-token"]),
    "MY_TOKEN_DIR": ("notapathsecret", ["notapathsecret"], []),  # a pointer name, a value that is no path
    "TOKENIZERS_PARALLELISM": ("false", [], []),
}
ARGS = ["--db-password", "hunter2pw", "--api-key=abc123", "--token-file", "/tmp/x", "--lr", "0.1",
        "--resume", "https://ci:ghpw0rd@git.example/r.git"]
ARG_SECRETS = ["hunter2pw", "abc123", "ghpw0rd"]
ARG_READABLE = ["--db-password " + MASK, "--api-key=" + MASK, "--token-file /tmp/x", "--lr 0.1",
                "https://ci:" + MASK + "@git.example/r.git"]


def _query(proc: Proc, sql: str) -> Tuple[str, List[Dict[str, object]]]:
    result = run_cli(str(proc.pid), "query", sql, "-f", "json")
    assert result.code == 0, result.err
    return result.out, json.loads(result.out)


def _target(show: bool) -> Iterator[Proc]:
    extra = {name: value for name, (value, _, _) in ENV.items()}
    extra.update(PROBE_EVAL="0", PATH="/usr/local/bin:/usr/bin:/bin")
    if show:
        extra["PROBE_SHOW_SECRETS"] = "1"
    # idle.py ignores its arguments; they are there to be read back from process.info.
    with running("idle.py", *ARGS, env=target_env(**extra)) as proc:
        yield proc


@pytest.fixture(scope="module")
def masked_target() -> Iterator[Proc]:
    yield from _target(show=False)


@pytest.fixture(scope="module")
def shown_target() -> Iterator[Proc]:
    yield from _target(show=True)


# -- through the real CLI ------------------------------------------------------------------------------

def test_process_env_shows_no_secret_and_keeps_the_rest_readable(masked_target):
    out, rows = _query(masked_target, "SELECT * FROM process.env")
    by_name = {r["name"]: r for r in rows}
    for name, (_value, secrets, readable) in ENV.items():
        for secret in secrets:
            assert secret not in out, "%s leaked %r" % (name, secret)
        for part in readable:
            assert part in by_name[name]["value"], (name, by_name[name])
        assert by_name[name]["masked"] is bool(secrets), (name, by_name[name])
    assert "hunter2" not in out and "pa55" not in out and "BEGIN RSA PRIVATE KEY" in out
    assert by_name["PATH"] == {"name": "PATH", "value": "/usr/local/bin:/usr/bin:/bin", "masked": False}
    assert by_name["GITHUB_PAT"]["value"] == MASK and by_name["TOKENIZERS_PARALLELISM"]["value"] == "false"
    assert by_name["PROBE_EVAL"]["value"] == "0"


def test_process_info_cmdline_masks_secret_flags_and_url_passwords(masked_target):
    out, rows = _query(masked_target, "SELECT cmdline FROM process.info")
    for secret in ARG_SECRETS:
        assert secret not in out
    cmdline = rows[0]["cmdline"]
    assert "idle.py" in cmdline
    for part in ARG_READABLE:
        assert part in cmdline, (part, cmdline)


def test_show_secrets_shows_every_value(shown_target):
    out, rows = _query(shown_target, "SELECT * FROM process.env")
    by_name = {r["name"]: r for r in rows}
    for name, (value, _, _) in ENV.items():
        assert by_name[name] == {"name": name, "value": value, "masked": False}
    out, rows = _query(shown_target, "SELECT cmdline FROM process.info")
    assert rows[0]["cmdline"].endswith(" ".join(ARGS))


def test_the_read_only_agent_is_still_read_only(masked_target):
    result = run_cli(str(masked_target.pid), "eval", "print(1)")
    assert result.code == 4, (result.code, result.err)


# -- rule 1: secret-looking names, in any position ---------------------------------------------------

@pytest.mark.parametrize("name", [
    "GITHUB_PAT", "PAT", "HF_TOKEN", "GITHUB_TOKEN_RO", "DB_PASSWORD", "PGPASSWORD", "REDIS_PASSWD", "MYSQL_PWD",
    "SMTP_PASS", "DB_PW", "GPG_PASSPHRASE", "API_KEY", "OPENAI_APIKEY", "AWS_ACCESS_KEY_ID", "PRIVATE_KEY", "SIGNING_KEYS",
    "AWS_SECRET_ACCESS_KEY", "CLIENT_SECRET", "AZURE_CREDENTIALS", "MY_CREDS", "OAUTH_CLIENT", "HTTP_AUTH",
    "AUTHORIZATION", "SESSION_ID", "COOKIE_JAR_DATA", "REQUEST_SIGNATURE", "SLACK_WEBHOOK", "WEBHOOK_URL",
    "SENTRY_DSN", "apiKey", "access_token", "db.password", "--db-password", "X-Amz-Signature", "sig",
])
def test_secret_names(name):
    assert looks_secret(name)
    assert mask_env_value(name, "s3cr3t-value") == (MASK, True)


@pytest.mark.parametrize("name", [
    "PATH", "PATTERN", "SPATIAL_DIMS", "PWD", "OLDPWD", "BYPASS_PROXY", "GIT_AUTHOR_NAME", "XAUTHORITY",
    "TOKENIZERS_PARALLELISM", "KEYBOARD_LAYOUT", "SSL_KEYFILE", "PYTHON_KEYRING_BACKEND", "SSL_CERT_FILE",
    "SSL_CERT_DIR", "PIP_CERT", "NODE_EXTRA_CA_CERTS", "REQUESTS_CA_BUNDLE", "CUDA_VISIBLE_DEVICES",
    "MASTER_ADDR", "NCCL_SOCKET_IFNAME", "--lr", "--cert",
])
def test_names_that_are_not_secret(name):
    assert not looks_secret(name)
    assert mask_env_value(name, "plain-value") == ("plain-value", False)


def test_an_empty_value_is_shown_it_reveals_nothing():
    assert mask_env_value("HF_TOKEN", "") == ("", False)


# -- rule 2: names that point to a file show a path, and nothing else ---------------------------------

@pytest.mark.parametrize("name, value", [
    ("PROBE_TOKEN_FILE", "/run/probe/token"), ("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"),
    ("SECRETS_DIR", "/run/secrets"), ("PRIVATE_KEY_PATH", "./keys/id_rsa"), ("API_KEY_HOME", "../keys"),
    ("SSH_AUTH_SOCK", "/tmp/ssh-XXXX/agent.42"), ("GOOGLE_APPLICATION_CREDENTIALS", "/var/gcp/sa.json"),
    ("TOKEN_PATHS", "/a/tok:/b/tok"), ("passwordfile", "/etc/pw"),
])
def test_file_pointing_names_show_their_path(name, value):
    assert mask_env_value(name, value) == (value, False)


@pytest.mark.parametrize("name, value", [
    ("PROBE_TOKEN_FILE", "hunter2"),                    # a token pasted where a path belongs
    ("SECRETS_DIR", "s3cret"),
    ("API_KEY_PATH", "/ok/path:relative-secret"),       # one part is no path
    ("API_KEY_PATH", "/tmp/x hunter2"),                 # whitespace: not clearly a path
    ("PASSWORD_FILE", "file:///etc/pw"),                # a URL, not a path
    ("TOKEN_FILE", "https://u:p@h/x"),
    ("GOOGLE_APPLICATION_CREDENTIALS", '{"type": "service_account", "private_key": "x"}'),
    ("TOKEN_FILE_CONTENTS", "/looks/like/a/path"),      # the name ends in CONTENTS, not FILE
    ("PATH_TOKEN", "/looks/like/a/path"),
])
def test_file_pointing_names_hide_what_is_not_a_path(name, value):
    assert mask_env_value(name, value) == (MASK, True)


# -- rule 3: credentials inside any value --------------------------------------------------------------

@pytest.mark.parametrize("text, shown", [
    ("postgres://trainer:hunter2@db:5432/x", "postgres://trainer:********@db:5432/x"),
    ("https://user:pa55@mlflow.example", "https://user:********@mlflow.example"),
    ("redis://:pw@cache:6379/0", "redis://:********@cache:6379/0"),
    ("postgres://u:p@ss@db/x?email=a@b.org", "postgres://u:********@db/x?email=a@b.org"),  # unencoded @
    ("postgres://u:pa/ss@db/x", "postgres://u:********@db/x"),                              # unencoded /
    ("a=redis://:one@h1 b=redis://:two@h2", "a=redis://:********@h1 b=redis://:********@h2"),
    ("https://ghp_0123456789abcdefghijKLMN@github.com/o/r.git", "https://********@github.com/o/r.git"),
])
def test_url_passwords_are_masked(text, shown):
    assert mask_url_userinfo(text) == shown
    assert mask_env_value("SOME_URI", text) == (shown, True)


@pytest.mark.parametrize("text", [
    "https://mlflow.example:5000/#/experiments", "ssh://git@github.com/o/r.git", "https://medium.com/@someone",
    "postgres://trainer@db/x", "http://u:@h/", '{"a":"http://x","b":"u@h"}', "/etc/ssl/certs",
])
def test_urls_without_passwords_are_untouched(text):
    assert mask_url_userinfo(text) == text
    assert mask_env_value("SOME_URI", text) == (text, False)


@pytest.mark.parametrize("text, shown", [
    ("https://h/x?a=1&token=abc&api_key=zz", "https://h/x?a=1&token=********&api_key=********"),
    ("https://h/x?password=pw&user=me", "https://h/x?password=********&user=me"),
    ("host=db user=me password='a b' dbname=x", "host=db user=me password='********' dbname=x"),
    ("AccountName=acc;AccountKey=Ab+c/==;EndpointSuffix=core.windows.net",
     "AccountName=acc;AccountKey=********;EndpointSuffix=core.windows.net"),
    ('connect("https://h?token=abc")', 'connect("https://h?token=********")'),
    ('{"user": "me", "password": "p\\"w", "port": 5432, "apiKey": 1234}',
     '{"user": "me", "password": "********", "port": 5432, "apiKey": ********}'),
    ("--db-password hunter2 --lr 0.1", "--db-password ******** --lr 0.1"),
    ("-Djavax.net.ssl.keyStorePassword=changeit -Xmx4g", "-Djavax.net.ssl.keyStorePassword=******** -Xmx4g"),
])
def test_secret_parameters_inside_values_are_masked(text, shown):
    assert mask_text(text) == shown
    assert mask_env_value("SOME_SETTING", text) == (shown, True)


@pytest.mark.parametrize("text", [
    "https://h/x?a=1&page=2", "key_file=/etc/k.pem", "--token-file /run/tok --lr 0.1", "--use-auth-token --epochs 3",
    '{"user": "me", "keyring": "none"}', "dbname=x host=db",
])
def test_ordinary_parameters_are_untouched(text):
    assert mask_text(text) == text


def test_pem_private_keys_are_masked_whatever_the_name():
    shown, masked = mask_env_value("HARMLESS_NAME", PEM)
    assert masked and "secretpembody" not in shown
    assert shown == "-----BEGIN RSA PRIVATE KEY-----" + MASK + "-----END RSA PRIVATE KEY-----"
    cut = "key: -----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXk"  # no END line: masked to the end
    assert mask_text(cut) == "key: -----BEGIN OPENSSH PRIVATE KEY-----" + MASK


def test_certificates_are_public():
    cert = "-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIU\n-----END CERTIFICATE-----"
    assert mask_env_value("CA_CERT", cert) == (cert, False)


# -- rule 4: command lines -----------------------------------------------------------------------------

def test_argv_masks_values_of_secret_flags():
    args = ["python", "train.py", "--db-password", "hunter2", "--api-key=abc123", "--token=t0k", "--secret", "s",
            "-password", "gopw", "db.password=hydra", "+trainer.api_key=k2", "--url", "https://u:p4@h/x",
            "--passphrase", "--lr", "0.1"]
    assert mask_argv(args) == [
        "python", "train.py", "--db-password", MASK, "--api-key=" + MASK, "--token=" + MASK, "--secret", MASK,
        "-password", MASK, "db.password=" + MASK, "+trainer.api_key=" + MASK, "--url", "https://u:" + MASK + "@h/x",
        "--passphrase", "--lr", "0.1"]  # --passphrase had no value: --lr is an option, left readable


def test_argv_keeps_paths_and_ordinary_flags_readable():
    args = ["torchrun", "--nproc-per-node=8", "train.py", "--token-file", "/run/tok", "--key-file=/k/id_rsa",
            "--cert", "/x.pem", "--ca-cert=/ca.pem", "--lr", "0.1", "--output-dir", "/ckpt", "-p", "8080", "lr=0.1"]
    assert mask_argv(args) == args


def test_argv_path_flags_hide_what_is_not_a_path():
    assert mask_argv(["--token-file", "hunter2"]) == ["--token-file", MASK]
    assert mask_argv(["--key-path=not a path"]) == ["--key-path=" + MASK]


def test_show_secrets_switch_is_still_exported():
    assert process_env.show_secrets is False and process_env.MASK == MASK
    assert process_env.looks_secret("GITHUB_PAT") and not process_env.looks_secret("SSL_CERT_FILE")
