"""Alerts from the node helper's watch to webhooks (issue 36 item 2): a stall recorded, with its verdict; a
rank's death, with its signal; a NaN or Inf the stall's verdict found; a rank's RSS that keeps rising; a
straggler that persists.

Why here: the watch already knows when progress stopped and when a rank died, and the record it writes
already holds what ``diagnose`` reads. Nobody gets that verdict unless someone types the command; a
webhook (Slack, or any endpoint that takes JSON) brings it to the person on call.

``PROBE_ALERT_WEBHOOK``: one or more URLs, separated by commas or white space. Each is ``http://`` or
``https://``; any other is refused at start, with a line in the helper's log (``node-PORT.log``). A URL on
Slack's hooks host (``hooks.slack.com``) is sent Slack's incoming-webhook body (``{"text": ...}``); any
other the generic body, one JSON object with every field. ``slack+https://...`` or ``json+https://...``
chooses for one URL, ``PROBE_ALERT_FORMAT=slack|json`` for all of them.

This module is the front the watch calls, and where each rule's events are counted: each rule fires once
for one event (its key: the record, the process, the straggler's episode) and then rests for
``PROBE_ALERT_COOLDOWN`` seconds (600). The parts: the sending (queues, threads, retries, masked URLs) is
``probe.host.alert_post``; the bodies ``probe.host.alert_body``; the rules the look runs itself
``probe.host.alert_rules``; the persistent straggler ``probe.host.alert_straggler``. Nothing may slow the
watch: the watch hands an event over (a few dict operations) and the alerts' thread does the rest.
"""

import atexit
import threading
import time
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from probe.host import alert_body, alert_loss, alert_memory, alert_rules, alert_straggler
from probe.host.alert_post import Hook, Poster, masked, parse_hooks, TIMEOUT_S, TRIES
from probe.host.alert_rules import number


__all__ = ["Alerts", "Hook", "parse_hooks", "masked", "COOLDOWN_S"]

COOLDOWN_S = 600.0
KEYS_KEPT = 1024  # event keys remembered, so that none fires twice
EXIT_WAIT_S = 5.0  # how long the helper's exit waits for the alerts still queued


class Alerts:
    """The alerts of one watch: rules' cooldowns, events already sent, the rules' state, and the poster."""

    def __init__(self, hooks: Sequence[Hook], log: Callable[[str], None], cooldown: float = COOLDOWN_S,
                 timeout: float = TIMEOUT_S, tries: int = TRIES) -> None:
        self.hooks = list(hooks)
        self.log = log
        self.cooldown = cooldown
        self.poster = Poster(self.hooks, log, alert_body.slack_text, timeout, tries)
        self._fired: Dict[str, float] = {}  # rule -> when it last fired
        self._keys: Dict[Tuple[str, str], None] = {}  # (rule, event key) already fired, oldest first
        self._lock = threading.Lock()
        self.rss = alert_rules.RssRise()
        self.straggler = alert_straggler.Straggler()
        if self.hooks:
            atexit.register(self.drain, EXIT_WAIT_S)  # before the watch's own exit hook: runs after it

    @property
    def sent(self) -> int:
        return self.poster.sent

    @property
    def failed(self) -> int:
        return self.poster.failed

    @classmethod
    def from_env(cls, log: Callable[[str], None]) -> "Alerts":
        """From ``PROBE_ALERT_*``; with no webhook, one that does nothing. Never raises."""
        try:
            import os

            form = os.environ.get("PROBE_ALERT_FORMAT", "").strip().lower()
            hooks, refused = parse_hooks(os.environ.get("PROBE_ALERT_WEBHOOK", ""), form)
            for line in refused:
                log(line)
            alerts = cls(hooks, log, number("PROBE_ALERT_COOLDOWN", COOLDOWN_S),
                         number("PROBE_ALERT_TIMEOUT_S", TIMEOUT_S) or TIMEOUT_S)
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
        where = alert_body.where(watch, directory)
        if died:
            self.fire("death", directory, lambda: alert_body.death_fields(where, list(died)))
        else:
            self.fire("stall", directory, lambda: alert_body.stall_fields(self.fire, where, directory, reason))

    def look(self, watch: Any, live: Sequence[Any]) -> None:
        """Each look of the watch: each rule's look, microseconds where it has nothing to do (the RSS
        every ``PROBE_ALERT_RSS_EVERY_S``, CUDA memory every ``PROBE_ALERT_CUDA_EVERY_S``, the straggler at each
        new sample of the stack history, the logged loss at each new read of the framework's values)."""
        if not self.hooks:
            return
        now = time.monotonic()
        self.rss.look(self, watch, live, now)
        self.straggler.look(self, watch, live, now)
        alert_memory.look(self, watch, live)  # CUDA reserved near the device's total
        alert_loss.look(self, watch, live, alert_body.where)  # the logged loss's spike and NaN

    def died(self, watch: Any, member: Any, how: Optional[str]) -> None:
        """A rank of a recorded stall died since (the watchdog, the launcher's SIGTERM)."""
        from probe.host import deaths

        if not self.hooks or deaths.consequence_of_another(how or ""):
            return  # the launcher's SIGTERM, a collective's error: the stall's own end, not news
        where = alert_body.where(watch, watch.recorded.directory if watch.recorded else None)
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
        return self.poster.put(rule, key, fields)

    def drain(self, wait: float) -> bool:
        """Wait up to ``wait`` s for the queued alerts to be sent (at the helper's exit); whether they were."""
        return self.poster.drain(wait)
