"""Sending alerts: the webhooks of ``PROBE_ALERT_WEBHOOK``, their queues, their threads and their retries.

Why apart from the rules: a rule decides whether an event is news, this module only gets a body to every
endpoint without ever slowing the helper. One thread makes each alert's fields (a stall's verdict is judged
there, off the watch), and each webhook has its own thread and bounded queue, so a hung endpoint delays no
other. A post has a short timeout and a few tries with a growing pause; a post that fails them all is said
in the helper's log, with the URL masked (a Slack URL carries its secret in the path).
"""

import json
import queue
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from probe.host import webhook

__all__ = ["Hook", "Poster", "masked", "parse_hooks", "TIMEOUT_S", "TRIES", "QUEUE_MAX"]

TIMEOUT_S = 5.0
TRIES = 3
BACKOFF_S = 1.0  # the pause before the second try; doubled before each next
QUEUE_MAX = 64  # alerts waiting to be sent; more are dropped (and said)

Fields = Callable[[], Optional[Dict[str, Any]]]


class Hook:
    """One webhook: its URL, the body it takes, and the URL as the log may show it."""

    def __init__(self, url: str, slack: bool) -> None:
        self.url = url
        self.slack = slack
        self.shown = masked(url)
        self.queue: "queue.Queue[Dict[str, Any]]" = queue.Queue(QUEUE_MAX)  # its own: a hung one delays no other


def masked(url: str) -> str:
    """``scheme://host[:port]/…``: no user, path or query, which may hold a secret."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or "?"
        port = ":%d" % parts.port if parts.port else ""
    except ValueError:
        return "(a URL that cannot be read)"
    return "%s://%s%s/…" % (parts.scheme or "?", host, port)


def parse_hooks(raw: str, form: str = "") -> Tuple[List[Hook], List[str]]:
    """The webhooks of ``PROBE_ALERT_WEBHOOK`` (commas or white space between them), and a line for each
    one refused. ``form``: ``slack`` or ``json`` for all (``PROBE_ALERT_FORMAT``), else chosen by host."""
    hooks: List[Hook] = []
    refused: List[str] = []
    for word in raw.replace(",", " ").split():
        chosen = form
        for prefix in ("slack+", "json+"):
            if word.startswith(prefix):
                chosen, word = prefix[:-1], word[len(prefix):]
        try:
            parts = urllib.parse.urlsplit(word)
            ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        except ValueError:
            ok = False
        if not ok:
            refused.append("probe: PROBE_ALERT_WEBHOOK: %s is not an http:// or https:// URL; no alerts go there"
                           % (masked(word) if "://" in word else "a word of %d characters" % len(word)))
            continue
        host = (parts.hostname or "").lower()
        hooks.append(Hook(word, chosen == "slack" if chosen in ("slack", "json") else host == "hooks.slack.com"))
    return hooks, refused


class Poster:
    """The threads between a rule and the webhooks: ``put`` never blocks; the fields are made on the
    alerts' thread (a function that returns None posts nothing: a rule's own work off the watch), and each
    webhook's thread posts them."""

    def __init__(self, hooks: Sequence[Hook], log: Callable[[str], None], slack_text: Callable[[Dict[str, Any]], str],
                 timeout: float = TIMEOUT_S, tries: int = TRIES) -> None:
        self.hooks = list(hooks)
        self.log = log
        self.slack_text = slack_text
        self.timeout = timeout
        self.tries = max(1, tries)
        self.sent = 0
        self.failed = 0
        self._queue: "queue.Queue[Tuple[str, Fields]]" = queue.Queue(QUEUE_MAX)
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def put(self, rule: str, key: str, fields: Fields) -> bool:
        """Queue ``fields`` (called on the alerts' thread) of an alert of ``rule``; whether it was queued."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="probe-alerts", daemon=True)
                self._thread.start()
        try:
            self._queue.put_nowait((rule, fields))
        except queue.Full:
            self.log("probe: alert %s (%s) dropped: %d alerts wait to be sent already" % (rule, key, QUEUE_MAX))
            return False
        return True

    def drain(self, wait: float) -> bool:
        """Wait up to ``wait`` s for the queued alerts to be sent (at the helper's exit); whether they were."""
        deadline = time.monotonic() + wait
        while not self.idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.idle()

    def idle(self) -> bool:
        return not self._queue.unfinished_tasks and not any(h.queue.unfinished_tasks for h in self.hooks)

    # -- the threads: one makes each alert's fields, one a webhook posts them -----------------------

    def _run(self) -> None:
        for hook in self.hooks:
            threading.Thread(target=self._send, args=(hook,), name="probe-alert-post", daemon=True).start()
        while True:
            rule, fields = self._queue.get()
            try:
                body = fields()
                for hook in self.hooks if body is not None else ():
                    try:
                        hook.queue.put_nowait(body)
                    except queue.Full:
                        self.log("probe: alert %s to %s dropped: %d alerts wait for it already"
                                 % (rule, hook.shown, QUEUE_MAX))
            except BaseException as exc:  # noqa: BLE001 -- the thread outlives any one alert
                self.log("probe: alert %s not sent: %s: %s" % (rule, type(exc).__name__, exc))
            finally:
                self._queue.task_done()

    def _send(self, hook: Hook) -> None:
        while True:
            body = hook.queue.get()
            try:
                self._post(hook, body)
            except BaseException as exc:  # noqa: BLE001
                self.log("probe: alert to %s not sent: %s" % (hook.shown, type(exc).__name__))
            finally:
                hook.queue.task_done()

    def _post(self, hook: Hook, fields: Dict[str, Any]) -> None:
        payload = {"text": self.slack_text(fields)} if hook.slack else dict(fields, source="probe")
        data = json.dumps(payload, default=str).encode("utf-8")
        why = ""
        for attempt in range(self.tries):
            if attempt:
                time.sleep(BACKOFF_S * (2 ** (attempt - 1)))
            try:
                request = urllib.request.Request(hook.url, data, {"Content-Type": "application/json",
                                                                  "User-Agent": "probe-alerts"})
                webhook.post(request, self.timeout)  # the whole post within the timeout, not each read
                self.sent += 1
                return
            except urllib.error.HTTPError as exc:
                why = "HTTP %d" % exc.code
                if 400 <= exc.code < 500 and exc.code not in (408, 429):
                    break  # the endpoint refuses this body: asking again changes nothing
            except (urllib.error.URLError, OSError, ValueError) as exc:
                reason = getattr(exc, "reason", exc)
                why = (type(reason).__name__ if isinstance(reason, BaseException) else "") + (
                    ": %s" % reason if str(reason) else "")
            why = why.replace(hook.url, hook.shown)
        self.failed += 1
        self.log("probe: alert %s to %s failed after %d tr%s: %s" % (
            fields.get("rule"), hook.shown, attempt + 1, "y" if attempt == 0 else "ies", why.strip(": ")[:300]))
