"""Alerts from the node helper's watch to webhooks (issue 36 item 2): a stall recorded, with its verdict; a
rank's death, with its signal; a NaN or Inf the stall's verdict found; a rank's RSS that keeps rising.

Why here: the watch already knows when progress stopped and when a rank died, and the record it writes
already holds what ``diagnose`` reads. Nobody gets that verdict unless someone types the command; a
webhook (Slack, or any endpoint that takes JSON) brings it to the person on call.

``PROBE_ALERT_WEBHOOK``: one or more URLs, separated by commas or white space. Each is ``http://`` or
``https://``; any other is refused at start, with a line in the helper's log (``node-PORT.log``). A URL on
Slack's hooks host (``hooks.slack.com``) is sent Slack's incoming-webhook body (``{"text": ...}``); any
other the generic body, one JSON object with every field. ``slack+https://...`` or ``json+https://...``
chooses for one URL, ``PROBE_ALERT_FORMAT=slack|json`` for all of them.

Nothing here may slow the watch: the watch hands an event over (a few dict operations), and a daemon
thread does the rest (judging a stall's record, the posts), one bounded queue in between. A post has a
short timeout (``PROBE_ALERT_TIMEOUT_S``, 5) and a few tries with a growing pause; a post that fails them
all is said in the log. A URL may carry a secret (Slack's does, in its path): the log shows its scheme and
host alone. Each rule fires once for one event (its key: the record, the process) and then rests for
``PROBE_ALERT_COOLDOWN`` seconds (600).
"""

import atexit
import collections
import json
import os
import queue
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from probe.host import webhook

__all__ = ["Alerts", "Hook", "parse_hooks", "masked", "COOLDOWN_S"]

COOLDOWN_S = 600.0
TIMEOUT_S = 5.0
TRIES = 3
BACKOFF_S = 1.0  # the pause before the second try; doubled before each next
QUEUE_MAX = 64  # alerts waiting to be sent; more are dropped (and said)
KEYS_KEPT = 1024  # event keys remembered, so that none fires twice
EXIT_WAIT_S = 5.0  # how long the helper's exit waits for the alerts still queued
VERDICT_LINES = 3
RSS_EVERY_S = 60.0  # how often each rank's RSS is read from /proc (PROBE_ALERT_RSS_EVERY_S)
RSS_SAMPLES = 10  # readings in a row that each rose or held (PROBE_ALERT_RSS_SAMPLES)
RSS_RISE = 0.2  # and rose by this fraction of the first (PROBE_ALERT_RSS_RISE)
RSS_MIN_MB = 256.0  # and by at least this much (PROBE_ALERT_RSS_MIN_MB)


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


def _number(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, "") or default)
    except ValueError:
        return default
    return value if value >= 0 and value == value and value != float("inf") else default


class Alerts:
    """The alerts of one watch: rules' cooldowns, events already sent, and the thread that posts."""

    def __init__(self, hooks: Sequence[Hook], log: Callable[[str], None], cooldown: float = COOLDOWN_S,
                 timeout: float = TIMEOUT_S, tries: int = TRIES) -> None:
        self.hooks = list(hooks)
        self.log = log
        self.cooldown = cooldown
        self.timeout = timeout
        self.tries = max(1, tries)
        self.sent = 0
        self.failed = 0
        self._fired: Dict[str, float] = {}  # rule -> when it last fired
        self._keys: Dict[Tuple[str, str], None] = {}  # (rule, event key) already fired, oldest first
        self._queue: "queue.Queue[Any]" = queue.Queue(QUEUE_MAX)
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._rss: Dict[int, "collections.deque[Tuple[float, int]]"] = {}  # pid -> its last readings (when, bytes)
        self._rss_next = 0.0
        self._rss_alerts = 0
        if self.hooks:
            atexit.register(self.drain, EXIT_WAIT_S)  # before the watch's own exit hook: runs after it

    @classmethod
    def from_env(cls, log: Callable[[str], None]) -> "Alerts":
        """From ``PROBE_ALERT_*``; with no webhook, one that does nothing. Never raises."""
        try:
            form = os.environ.get("PROBE_ALERT_FORMAT", "").strip().lower()
            hooks, refused = parse_hooks(os.environ.get("PROBE_ALERT_WEBHOOK", ""), form)
            for line in refused:
                log(line)
            alerts = cls(hooks, log, _number("PROBE_ALERT_COOLDOWN", COOLDOWN_S),
                         _number("PROBE_ALERT_TIMEOUT_S", TIMEOUT_S) or TIMEOUT_S)
            if hooks:
                log("probe: alerts go to %s" % ", ".join(h.shown for h in hooks))
            return alerts
        except Exception as exc:  # noqa: BLE001 -- no alerts rather than no watch
            log("probe: no alerts: %s: %s" % (type(exc).__name__, exc))
            return cls([], log)

    # -- what the watch calls (cheap: the work is done on the thread) ------------------------------

    def recorded(self, watch: Any, directory: Optional[str], reason: str, members: Sequence[Any],
                 died: Optional[Sequence[Any]]) -> None:
        """A record written by the watch: a stall (judged on the thread) or ranks' deaths."""
        if not self.hooks or not directory:
            return
        where = _where(watch, directory)
        if died:
            self.fire("death", directory, lambda: _death_fields(where, list(died)))
        else:
            self.fire("stall", directory, lambda: _stall_fields(self, where, directory, reason))

    def look(self, watch: Any, live: Sequence[Any]) -> None:
        """Each look of the watch: every ``RSS_EVERY_S``, each live rank's RSS (one read of /proc/PID/statm,
        no word to the rank); a rank whose RSS rose or held at ``RSS_SAMPLES`` readings in a row, by
        ``RSS_RISE`` of the first and ``RSS_MIN_MB`` at least, is an alert (then a new window begins). From a
        rank's first step on: before it, a start-up's imports and loading rise as steadily."""
        now = time.monotonic()
        if not self.hooks or now < self._rss_next:
            return
        every = _number("PROBE_ALERT_RSS_EVERY_S", RSS_EVERY_S) or RSS_EVERY_S
        self._rss_next = now + every
        count = max(2, int(_number("PROBE_ALERT_RSS_SAMPLES", RSS_SAMPLES)))
        for pid in [p for p in self._rss if p not in {r.pid for r in live}]:
            del self._rss[pid]
        for rank in live:
            rss = _rss_bytes(rank.pid) if rank.steps else None  # a start-up's imports and loading rise too
            if rss is None:
                continue
            kept = self._rss.setdefault(rank.pid, collections.deque(maxlen=count))
            if kept and rss < kept[-1][1]:
                kept.clear()  # it fell: no steady rise
            kept.append((now, rss))
            since, first = kept[0]
            rise = rss - first
            if len(kept) < count or rise < max(_number("PROBE_ALERT_RSS_MIN_MB", RSS_MIN_MB) * 2 ** 20,
                                               _number("PROBE_ALERT_RSS_RISE", RSS_RISE) * first):
                continue
            kept.clear()
            self._rss_alerts += 1
            text = ("rank %d's RSS rose or held at %d readings in a row, from %.0f MiB to %.0f MiB (+%.0f %%) in %.0f s"
                    % (rank.rank, count, first / 2 ** 20, rss / 2 ** 20, 100.0 * rise / max(first, 1), now - since))
            fields = dict(_where(watch, None), rule="memory", summary=text, culprits=[rank.rank], pid=rank.pid,
                          rss_bytes=rss, rss_from_bytes=first)
            self.fire("memory", "rss %d %d" % (rank.pid, self._rss_alerts), lambda made=fields: made)

    def died(self, watch: Any, member: Any, how: Optional[str]) -> None:
        """A rank of a recorded stall died since (the watchdog, the launcher's SIGTERM)."""
        from probe.host import deaths

        if not self.hooks or deaths.consequence_of_another(how or ""):
            return  # the launcher's SIGTERM, a collective's error: the stall's own end, not news
        where = _where(watch, watch.recorded.directory if watch.recorded else None)
        text = "rank %d (process %d) died after the stall was recorded: %s" % (member.rank, member.pid,
                                                                                how or "how is not known")
        self.fire("death", "pid %d" % member.pid,
                  lambda: dict(where, rule="death", summary=text, ranks=[member.rank], pid=member.pid, how=how))

    def fire(self, rule: str, key: str, fields: Callable[[], Dict[str, Any]]) -> bool:
        """Queue an alert of ``rule`` for the event ``key``: not where that event fired already or the rule
        is resting; ``fields`` is called on the thread. Whether it was queued."""
        now = time.monotonic()
        with self._lock:
            if (rule, key) in self._keys:
                return False
            self._keys[(rule, key)] = None
            if len(self._keys) > KEYS_KEPT:
                self._keys.pop(next(iter(self._keys)))
            last = self._fired.get(rule)
            if last is not None and now - last < self.cooldown:
                self.log("probe: alert %s (%s) not sent: the rule fired %.0f s ago (PROBE_ALERT_COOLDOWN %.0f s)"
                         % (rule, key, now - last, self.cooldown))
                return False
            self._fired[rule] = now
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
        while not self._idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._idle()

    def _idle(self) -> bool:
        return not self._queue.unfinished_tasks and not any(h.queue.unfinished_tasks for h in self.hooks)

    # -- the threads: one makes each alert's fields, one a webhook posts them -----------------------

    def _run(self) -> None:
        for hook in self.hooks:
            threading.Thread(target=self._send, args=(hook,), name="probe-alert-post", daemon=True).start()
        while True:
            rule, fields = self._queue.get()
            try:
                body = fields()
                for hook in self.hooks:
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
        payload = {"text": _slack_text(fields)} if hook.slack else dict(fields, source="probe")
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


# -- the alerts' fields ------------------------------------------------------------------------------------


def _where(watch: Any, directory: Optional[str]) -> Dict[str, Any]:
    """What every alert of this node says: host, job, the helper's port, the record."""
    from probe.host.members import node_host

    out: Dict[str, Any] = {"host": node_host() or socket.gethostname(), "probe_port": watch.helper.base_port,
                           "node": watch.helper.members.node_key(), "time": time.time()}
    if directory:
        out.update(snapshot=directory, snapshot_id=os.path.basename(directory),
                   job=re.sub(r"-\d{8}T\d{6}Z(-\d+)?$", "", os.path.basename(directory)),
                   command="probe snapshot:%s diagnose" % directory)
    return out


def _death_fields(where: Dict[str, Any], died: Sequence[Any]) -> Dict[str, Any]:
    """The deaths' alert, in the words known now (the launcher may have said the signal since the record)."""
    from probe.host import deaths, exits

    reason = deaths.reason(died)
    first = min(died, key=lambda d: (deaths.consequence_of_another(exits.death_words(d[2], d[3])), d[0], d[1]))
    return dict(where, rule="death", summary="%s (recorded in %s)" % (reason, where["snapshot_id"]), reason=reason,
                ranks=sorted({d[1] for d in died}), culprits=[first[1]], how=exits.death_words(first[2], first[3]))


def _stall_fields(alerts: Alerts, where: Dict[str, Any], directory: str, reason: str) -> Dict[str, Any]:
    """The stall's alert: the verdict of its record (judged here, on the alerts' thread), who, where."""
    out = dict(where, rule="stall", reason=reason)
    try:
        from probe.snapshot.target import Snapshot
        from probe.client.cluster import compact_ranks

        def command(ranks: Optional[Sequence[int]], rest: str) -> str:
            return "probe snapshot:%s%s %s" % (directory, " --ranks %s" % compact_ranks(ranks) if ranks else "", rest)

        report = Snapshot(directory).judge(command)
        verdicts = [v for v in report.verdicts if v.kind != "healthy"] or report.verdicts
        first = verdicts[0]
        out.update(status=report.status, verdict=first.kind,
                   verdict_lines=[v.summary for v in verdicts[:VERDICT_LINES]],
                   culprits=first.culprits, victims=first.victims, where=first.where, where_text=_place(first.where))
        numeric = [v for v in report.verdicts if v.kind == "numerical"]
        if numeric:  # found in the record: its own alert too
            alerts.fire("nan", directory, lambda: dict(where, rule="nan", summary=numeric[0].summary,
                                                       culprits=numeric[0].culprits, where=numeric[0].where))
    except Exception as exc:  # noqa: BLE001 -- the alert goes without its verdict
        out["verdict_error"] = "%s: %s" % (type(exc).__name__, getattr(exc, "message", exc))
    who = " (culprit: rank %s)" % ",".join(map(str, out["culprits"])) if out.get("culprits") else ""
    out["summary"] = "stall recorded in %s%s: %s" % (where["snapshot_id"], who, reason)
    return out


def _rss_bytes(pid: int) -> Optional[int]:
    """A process's resident memory, from /proc/PID/statm (its second field, in pages)."""
    try:
        with open("/proc/%d/statm" % pid, "rb") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _place(where: Any) -> str:
    """``func (file:line) called from ...``, as ``diagnose`` says it."""
    from probe.diagnose.verdict import where_text

    if not isinstance(where, dict):
        return ""
    try:
        return where_text(where) if where.get("func") else str(where.get("module") or "")
    except (KeyError, TypeError, ValueError):
        return ""


def _slack_text(fields: Dict[str, Any]) -> str:
    """The alert as the lines of one Slack message."""
    lines = ["*probe: %s* on %s (job %s, PROBE_PORT %s)" % (fields.get("rule"), fields.get("host"),
                                                         fields.get("job", "?"), fields.get("probe_port"))]
    lines.append(str(fields.get("summary") or fields.get("reason") or ""))
    lines.extend("> %s" % line for line in fields.get("verdict_lines") or [])
    if fields.get("culprits"):
        place = fields.get("where_text") or _place(fields.get("where"))
        lines.append("culprit: rank %s%s" % (",".join(map(str, fields["culprits"])), " in " + place if place else ""))
    if fields.get("command"):
        lines.append("snapshot %s: `%s`" % (fields.get("snapshot_id"), fields["command"]))
    return "\n".join(line for line in lines if line)
