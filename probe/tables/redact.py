"""What is a secret: the one place that decides what ``process.env`` and ``process.info`` hide.

Runs inside the target process, so it is stdlib ``re`` only, precompiled, and cheap. The rules, in order:

1. **Secret-looking names.** A name (an environment variable, a ``--flag``, a ``key=`` in a value, a
   JSON key) looks secret when it contains, in any position and in any case:
   ``SECRET``, ``PASSW`` (PASSWORD, PASSWD), ``PASSPHRASE``, ``TOKEN`` (not TOKENIZER/TOKENISER),
   ``CREDENTIAL``, ``PRIVATE``, ``SESSION``, ``COOKIE``, ``SIGNATURE``, ``WEBHOOK``, ``AUTH`` (not
   AUTHOR/AUTHORITY; AUTHORIZATION is secret), ``KEY``/``KEYS`` ending a word (API_KEY, APIKEY,
   ACCESS_KEY_ID; not KEYBOARD, KEYFILE, KEYRING); or, as a whole word (between non-letters),
   ``PAT`` (GITHUB_PAT; not PATH, PATTERN), ``PASS``, ``PW``, ``PWD`` (the shell's own ``PWD`` variable is
   the working directory and is not secret), ``CREDS``, ``DSN``, ``SIG``.
   ``CERT`` is not a secret word: certificates and CA bundles are public (SSL_CERT_FILE, PIP_CERT).
   Its value is replaced whole by ``********``, except:

2. **Names that point to a file.** When a secret-looking name ends in FILE, FILENAME, FILES, DIR, DIRS,
   DIRECTORY, PATH, PATHS, HOME, SOCK or SOCKET (PROBE_TOKEN_FILE, --key-file, SSH_AUTH_SOCK), or is
   ``GOOGLE_APPLICATION_CREDENTIALS`` (a key file's path by definition), its value is shown **only if
   it is path-like**: every ``os.pathsep``-separated part starts with ``/``, ``~/``, ``./`` or ``../``,
   and the value has no whitespace and no ``://``. Anything else under such a name (a token pasted
   into PROBE_TOKEN_FILE, a relative name, a URL) is masked whole, like rule 1.

3. **Credentials inside any value, whatever its name** (and inside every command-line argument):

   * URL user-info ``scheme://user:password@host`` keeps scheme, user, host and path, the password
     becomes ``********``; a user name alone (``https://TOKEN@github.com``) is masked only when it
     looks like a token: 20 or more letters, digits, ``_`` or ``-``.
   * ``name=value`` where the name looks secret (rule 1, with rule 2's exception), wherever it
     stands: URL query parameters (``?token=``, ``&password=``, ``api_key=``), libpq and connection
     strings (``password=x``, ``AccountKey=x;``), ``--flag=value``. The value ends at whitespace,
     ``&`` or ``;`` (or its closing quote, when quoted).
   * JSON-style ``"name": value`` with a secret-looking name (VCAP_SERVICES, SM_TRAINING_ENV), for
     string and scalar values; nested objects are looked into instead.
   * ``--flag value`` written in one string, with a secret-looking flag, as in rule 4.
   * PEM private keys (``-----BEGIN ... PRIVATE KEY-----`` to its END line, or to the end of the
     text when it has none): the body becomes ``********``, the BEGIN and END lines stay.

4. **Command lines** (a list of arguments): a flag with one or two dashes whose name looks secret
   (``--db-password``, ``--api-key``, ``-token``, ``--secret``) hides its value, given after ``=``
   or as the next argument, unless that next argument is itself a long option (``--x``), then the
   flag had no value. Rule 2 applies to flags (``--token-file /path`` stays readable), and
   ``--cert``/``--ca-cert`` are not secret at all. ``name=value`` arguments (Hydra overrides such as
   ``db.password=x``) follow rule 3; every argument has its URL credentials masked. Single-letter
   flags (``-p``) are left alone: nothing says what they mean.

An empty value is shown: it tells that a variable is set to nothing and reveals no secret. What these
rules cannot see (a password in a ``user:pass@host`` without a scheme, a secret under an innocent
name) stays visible; PROBE_EVAL=0 makes the agent read-only, not secret-free.
"""

import os
import re
import threading
from typing import Dict, List, Tuple

__all__ = ["MASK", "looks_secret", "points_to_file", "is_path", "mask_env_value", "mask_text", "mask_argv",
           "mask_url_userinfo", "mask_local", "reading"]

MASK = "********"

reading = threading.local()
"""``reading.shows_secrets``: True while the agent answers a request of the eval scope on this thread
(which could read every value anyway; or any request where PROBE_SHOW_SECRETS=1), so that
``python.locals`` shows the values of secret-looking locals; any other request (read, control: a read
token, ``probe mcp``, the page) sees them masked by :func:`mask_local`, as a snapshot writes them. Unset
(not a request) is masked."""


def mask_local(name: str, value: str) -> str:
    """A local variable's short repr as it may be shown below the eval scope (and written in a snapshot):
    rules 1 and 2 by its name (``password`` -> ``********``, the name stays), rule 3 inside any value."""
    return mask_env_value(name, value)[0]

_SECRET_NAME = re.compile(
    r"SECRET|PASSW|PASSPHRASE|TOKEN(?!I[ZS])|CREDENTIAL|PRIVATE|SESSION|COOKIE|SIGNATURE|WEBHOOK"
    r"|AUTH(?!OR(?!I[ZS]))|KEYS?(?![A-Z])"
    r"|(?<![A-Z])(?:PAT|PASS|PW|PWD|CREDS|DSN|SIG)(?![A-Z])",
    re.IGNORECASE)
_NOT_SECRET_NAMES = frozenset(["PWD"])  # the shell's working directory
_FILE_SUFFIX = re.compile(r"(?:FILE|FILENAME|FILES|DIR|DIRS|DIRECTORY|PATH|PATHS|HOME|SOCK|SOCKET)\Z", re.IGNORECASE)
_FILE_NAMES = frozenset(["GOOGLE_APPLICATION_CREDENTIALS"])
_PATH_PART = re.compile(r"(?:~|\.\.?)?/\S*")

# scheme://user[:password]@host: the password may hold unencoded @ or / (people write them so); it ends
# at the @ after which the host runs to the end of the authority without another @. It never spans another
# "://", and a scheme starts only where no scheme character stands before it: the search stays linear.
_URL_USERINFO = re.compile(r"(?<![A-Za-z0-9+.\-])([A-Za-z][A-Za-z0-9+.\-]*://)([^\s:/?#@\"]*)(?::((?:(?!://)[^\s\"])*?))?@"
                           r"(?=[^\s\"@/?#]*(?:[/?#\s\"]|\Z))")
_TOKEN_LIKE_USER = re.compile(r"[A-Za-z0-9_\-]{20,}")
# name=value, the name starting where no name character stands before it.
_ASSIGN = re.compile(r"(?<![\w.+~\-])([+~]?-{0,2}[A-Za-z_][\w.\-]*)=('[^']*'|\"[^\"]*\"|[^\s&;]*)")
_CLOSERS = re.compile(r"[\"'][)\]},]*\Z")
_JSON_PAIR = re.compile(r"([\"'])([\w.+~\-]+)\1(\s*:\s*)(\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'|[^\s,}\]{\[]+)")
_FLAG_SPACE = re.compile(r"(?<!\S)(-{1,2}[A-Za-z][\w.\-]*)(\s+)('[^']*'|\"[^\"]*\"|(?!--[A-Za-z])\S+)")
_PEM = re.compile(r"(-----BEGIN [A-Z0-9 ]*PRIVATE KEY[A-Z ]*-----)(.*?)(-----END [A-Z0-9 ]*PRIVATE KEY[A-Z ]*-----|\Z)",
                  re.DOTALL)
_FLAG = re.compile(r"(-{1,2}[A-Za-z][\w.\-]+)(?:=(.*))?\Z", re.DOTALL)  # two characters or more: not -p
_ARG_ASSIGN = re.compile(r"([+~]*[A-Za-z_][\w.\-]*)=(.*)\Z", re.DOTALL)
_LONG_OPTION = re.compile(r"--[A-Za-z]")


_LOOKED: Dict[str, bool] = {}  # name -> looks_secret: python.locals asks of the same few names again and again
_MAX_LOOKED = 4096


def looks_secret(name: str) -> bool:
    """True when ``name`` (a variable, flag or key; leading ``-+~`` ignored) names a secret (rule 1)."""
    found = _LOOKED.get(name)
    if found is None:
        bare = name.lstrip("-+~")
        found = bare not in _NOT_SECRET_NAMES and bool(_SECRET_NAME.search(bare))
        if len(_LOOKED) < _MAX_LOOKED:
            _LOOKED[name] = found
    return found


def points_to_file(name: str) -> bool:
    """True when ``name`` says its value is a path (rule 2), so the path may be shown."""
    name = name.lstrip("-+~")
    return name in _FILE_NAMES or bool(_FILE_SUFFIX.search(name))


def is_path(value: str) -> bool:
    """True when ``value`` is clearly one or more file paths, nothing else (rule 2)."""
    if "://" in value:
        return False
    parts = [part for part in value.split(os.pathsep) if part]
    return bool(parts) and all(_PATH_PART.fullmatch(part) for part in parts)


def _hides(name: str, value: str) -> bool:
    """True when ``value``, given under ``name``, must be hidden whole (rules 1 and 2)."""
    return value != "" and looks_secret(name) and not (points_to_file(name) and is_path(value))


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def _masked_like(value: str) -> str:
    """``MASK`` in the quotes ``value`` had."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[0] + MASK + value[0]
    return MASK


def _userinfo(match: "re.Match[str]") -> str:
    scheme, user, password = match.groups()
    if password is not None:
        return "%s%s:%s@" % (scheme, user, MASK if password else "")
    return "%s%s@" % (scheme, MASK if _TOKEN_LIKE_USER.fullmatch(user) else user)


def mask_url_userinfo(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@host`` replaced (rule 3)."""
    if "://" not in text or "@" not in text:
        return text
    return _URL_USERINFO.sub(_userinfo, text)


def _assign(match: "re.Match[str]") -> str:
    name, value = match.group(1), match.group(2)
    if not _hides(name, _unquote(value)):
        return match.group(0)
    if value[:1] not in ("'", '"'):  # unquoted, inside quotes ("...?token=abc"): the closing quote stays
        tail = _CLOSERS.search(value)
        if tail and tail.start() > 0:
            return "%s=%s%s" % (name, MASK, tail.group(0))
    return "%s=%s" % (name, _masked_like(value))


def _json_pair(match: "re.Match[str]") -> str:
    quote, name, sep, value = match.groups()
    if not _hides(name, _unquote(value)):
        return match.group(0)
    return "%s%s%s%s%s" % (quote, name, quote, sep, _masked_like(value))


def _flag_space(match: "re.Match[str]") -> str:
    flag, space, value = match.groups()
    return flag + space + _masked_like(value) if _hides(flag, _unquote(value)) else match.group(0)


def _pem(match: "re.Match[str]") -> str:
    return match.group(1) + MASK + match.group(3)


def mask_text(text: str) -> str:
    """``text`` with the credentials of rule 3 masked, whatever the name it is stored under."""
    if "-----BEGIN" in text:
        text = _PEM.sub(_pem, text)
    text = mask_url_userinfo(text)
    if "=" in text:
        text = _ASSIGN.sub(_assign, text)
    if ":" in text and ("'" in text or '"' in text):
        text = _JSON_PAIR.sub(_json_pair, text)
    if text.startswith("-") or " -" in text or "\t-" in text or "\n-" in text:
        text = _FLAG_SPACE.sub(_flag_space, text)
    return text


def mask_env_value(name: str, value: str) -> Tuple[str, bool]:
    """The value of environment variable ``name`` as it may be shown, and whether anything was masked."""
    if _hides(name, value):
        return MASK, True
    shown = mask_text(value)
    return shown, shown != value


def mask_argv(args: List[str]) -> List[str]:
    """A command line's arguments with the values of secret flags and every credential masked (rule 4)."""
    out: List[str] = []
    pending = ""  # a secret-looking flag given without ``=``: its value is the next argument
    for arg in args:
        if pending:
            flag, pending = pending, ""
            if not _LONG_OPTION.match(arg):
                out.append(MASK if _hides(flag, arg) else mask_text(arg))
                continue
        match = _FLAG.match(arg) or _ARG_ASSIGN.match(arg)
        if match is None:
            out.append(mask_text(arg))
            continue
        name, value = match.group(1), match.group(2)
        if value is None:  # a flag alone
            if looks_secret(name):
                pending = name
            out.append(arg)
        elif _hides(name, value):
            out.append(name + "=" + MASK)
        else:
            out.append(name + "=" + mask_text(value))
    return out
