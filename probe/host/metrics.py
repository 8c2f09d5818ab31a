"""Prometheus metrics of a node's ranks (issue 36): ``PROBE_METRICS_PORT=N`` makes the node helper serve
``http://NODE:N/metrics`` in Prometheus's text format, through ``prometheus_client``.

Why here: the helper already knows its node's ranks and reads each one's step counter from its progress
file (``progress-<pid>.bin``) without the rank's GIL; a scrape adds a few small reads of files in the runtime
directory and ``/proc`` and nothing else. No request goes to any rank's agent: a rank whose GIL a C call
holds, or that is stopped, is scraped like any other. A custom collector reads the state at each scrape,
so nothing runs between scrapes.

The same file carries the rank's step extras, refreshed at a step at most once a second
(``probe.tables.torch.step_extras``): the learning rate its optimizer holds, CUDA memory allocated, reserved
and the device's total, the default process group's collective sequence number, and the time its training
thread waited for the DataLoader; served by ``probe.host.metrics_extras``, each only where known.

The one thing here that asks a rank: what its framework logged (loss, learning rate, grad norm, their step),
read by ``probe.host.framework``'s reader from each answering rank's agent at most every ``PROBE_METRICS_EVERY``
seconds (default 15; ``0``: never), on a background thread, never in a scrape; a scrape asks for a read when one
is due, and serves the last values and each read's time (``probe_framework_read_seconds``). A silent rank
(agent not run for 2 s) is shown ``gil_held`` once a background read from outside (ptrace, at most every
``HELD_EVERY_S`` a silent rank, never in a scrape) found a C call keeping its GIL.
"""

import errno
import os
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

from probe._stderr import say as _say
from probe.host import framework

__all__ = ["start", "NodeCollector", "STATES", "VERDICTS", "metrics_port"]

STATES = ("running", "silent", "gil_held", "stopped", "starting", "exited", "dead")  # a rank's (probe_rank_state)
VERDICTS = ("stepping", "starting", "suspect", "stalled", "dead")  # the node's, by code 0-4 (probe_verdict)
_RANK_LABELS = ("job", "node", "host", "rank", "local_rank")
_NODE_LABELS = ("job", "node", "host")
RETRY_S = 2.0  # the metrics port taken at start: tried again this often
RETRY_FOR_S = 300.0  # for this long (a helper of the job before lingers PROBE_HELPER_LINGER_S, 30 s)
HELD_EVERY_S = 30.0  # a silent rank is read from outside at most this often, to tell gil_held
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def metrics_port(environ: Optional[Dict[str, str]] = None) -> Optional[int]:
    """``PROBE_METRICS_PORT`` as a port number (1-65535); None where unset or not one."""
    raw = (environ if environ is not None else os.environ).get("PROBE_METRICS_PORT", "").strip()
    return int(raw) if raw.isdigit() and 0 < int(raw) < 65536 else None


def _labels(member: Any, job: str, node: str, host: str) -> List[str]:
    """A rank's label values, in ``_RANK_LABELS``' order."""
    return [job, str(member.node if member.node is not None else node), host, str(member.rank),
            "" if member.local_rank is None else str(member.local_rank)]


def _rss(pid: int) -> Optional[int]:
    try:
        with open("/proc/%d/statm" % pid, "rb") as handle:
            return int(handle.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def _meminfo() -> Dict[str, int]:
    """MemTotal and MemAvailable of this node, in bytes."""
    out: Dict[str, int] = {}
    try:
        with open("/proc/meminfo", "rb") as handle:
            for line in handle:
                name, _, rest = line.partition(b":")
                if name in (b"MemTotal", b"MemAvailable"):
                    out[name.decode("ascii")] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


class _Holders:
    """Which silent ranks keep their GIL in a C call. Telling takes a read from outside (ptrace, as
    ``diagnose`` does: ``probe.client.outside.diagnose_now``), so a scrape never does it: it hands the silent
    ranks to one background thread, which reads each at most every ``HELD_EVERY_S``, and shows the last
    finding. A rank that is not silent costs nothing here."""

    def __init__(self) -> None:
        self.found: Dict[int, Tuple[float, bool]] = {}  # pid -> (when read, keeps its GIL)
        self.busy = False
        self._lock = threading.Lock()

    def held(self, pid: int) -> bool:
        return self.found.get(pid, (0.0, False))[1]

    def ask(self, silent: List[int]) -> None:
        """Called by a scrape with the ranks silent now: forget the others, read the stale ones in the
        background (one read at a time; never waits)."""
        now = time.monotonic()
        for pid in [p for p in list(self.found) if p not in silent]:
            self.found.pop(pid, None)
        due = [p for p in silent if now - self.found.get(p, (-HELD_EVERY_S, False))[0] >= HELD_EVERY_S]
        if not due:
            return
        with self._lock:
            if self.busy:
                return
            self.busy = True
        try:
            threading.Thread(target=self._read, args=(due,), name="probe-metrics-held", daemon=True).start()
        except RuntimeError:
            self.busy = False

    def _read(self, pids: List[int]) -> None:
        from probe import _paths
        from probe.client.outside import diagnose_now

        try:
            for pid in pids:
                try:
                    self.found[pid] = (time.monotonic(), diagnose_now(pid, _paths.socket_path(pid)).state == "gil_held")
                except Exception:  # noqa: BLE001 -- shown as silent
                    self.found[pid] = (time.monotonic(), False)
        finally:
            self.busy = False


def verdict_code(watch: Any, states: List[str], stepped: bool) -> Optional[int]:
    """The node's verdict as the stall watch holds it (``VERDICTS``' index); None without a watch. Read off
    the watch's fields, without its lock: a scrape never waits on a look or a record being written.
    ``states``: the ranks' (``STATES``); ``stepped``: a rank's progress file, read by this scrape, counts a step
    (the watch looks once a second)."""
    if watch is None:
        return None
    if "dead" in states:
        return 4
    if watch.stalled_since is not None:
        return 3  # recorded, no progress since
    if watch.baseline is not None:
        return 2  # no step for half of hang_after: the watch is asking the Flight Recorders
    if not stepped and not any(r.steps for r in list(watch.ranks.values())):
        return 1
    return 0


class NodeCollector:
    """The collector ``prometheus_client`` calls at each scrape: this node's ranks, as they are now."""

    def __init__(self, helper: Any) -> None:
        self.helper = helper
        self._jobs: Dict[Tuple[int, ...], str] = {}  # the ranks' pids -> the job's id (read from /proc once)
        self._ticks: Dict[int, int] = {}  # pid -> start ticks: a progress file of an earlier process is not its
        self.holders = _Holders()
        self.framework = framework.reader_of(helper)  # shared with the loss-spike alert: probe.host.framework
        self._ended: Dict[int, str] = {}  # pid -> "dead" (a crash record: a signal, an exception) or "exited"

    def describe(self) -> List[Any]:
        return []  # nothing read at registration

    def job(self, members: List[Any]) -> str:
        """The job's id as the snapshots name it (``probe.snapshot.store.job_id``): Slurm's job id,
        torchelastic's run id, else ``port<PROBE_PORT>``."""
        pids = tuple(sorted(m.pid for m in members))
        if pids not in self._jobs:
            from probe.host.members import process_environ
            from probe.snapshot import store

            keys = (b"SLURM_JOB_ID", b"TORCHELASTIC_RUN_ID")
            env = next((e for e in (process_environ(p, keys) for p in pids) if e), {})
            slurm = env.get(b"SLURM_JOB_ID", b"").decode("ascii", "replace") or os.environ.get("SLURM_JOB_ID")
            run = env.get(b"TORCHELASTIC_RUN_ID", b"").decode("ascii", "replace") or os.environ.get("TORCHELASTIC_RUN_ID")
            if len(self._jobs) > 64:
                self._jobs.clear()
            self._jobs[pids] = store.job_id(slurm or None, run or None, self.helper.base_port)
        return self._jobs[pids]

    def _framework_families(self, members: List[Any], job: str, node: str, host: str) -> Iterator[Any]:
        """What the framework reader holds of the ranks running now; asks it for a newer read when due."""
        running = [m for m in members if m.state == "running"]
        self.framework.ask([m.pid for m in running])
        yield from framework.families(self.framework, [(m.pid, _labels(m, job, node, host)) for m in running],
                                      _RANK_LABELS)

    def _ended_how(self, pid: int) -> str:
        """``dead`` where the rank left a crash record (a signal, an uncaught exception, SIGKILL: the record
        begun at its start stays), ``exited`` where it ended cleanly or by Ctrl-C, as the watch tells them;
        decided once a process."""
        if pid not in self._ended:
            from probe.reader import crash

            found = crash.dead_record(pid)
            ticks = self._ticks.get(pid)
            died = (found is not None and not (ticks and found.start_ticks and found.start_ticks != ticks)
                    and not found.cause.startswith("uncaught exception: KeyboardInterrupt"))
            self._ended[pid] = "dead" if died else "exited"
        return self._ended[pid]

    def _progress(self, pid: int) -> Any:
        from probe import _paths
        from probe.tables.torch.steps import read_progress

        found = read_progress(_paths.progress_path(pid))
        if found is None or found.pid != pid:
            return None
        if pid not in self._ticks:
            try:
                self._ticks[pid] = _paths.process_start_ticks(str(pid))
            except (OSError, ValueError, IndexError):
                return None
        if found.start_ticks and found.start_ticks != self._ticks[pid]:
            return None  # a file left by an earlier process with this pid
        return found

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from probe import _paths
        from probe.host.members import node_host
        from probe.host.metrics_extras import ExtrasFamilies
        from probe.tables.torch.step_extras import read_extras

        helper = self.helper
        members = helper.members.scan()
        if not members:  # a program run alone under PROBE_PORT: rank 0 of one, as the watch takes it
            solo = helper.members.solo()
            members = [solo] if solo is not None else []
        watch = getattr(helper, "watch", None)
        job = self.job(members)
        host = node_host()
        node_key = helper.members.node_key()
        node = str(node_key if node_key is not None else 0)
        now = time.monotonic()

        steps = CounterMetricFamily("probe_steps", "Optimizer steps the rank made (its step counter).",
                                    labels=_RANK_LABELS)
        age = GaugeMetricFamily("probe_last_step_age_seconds", "Seconds since the rank's last optimizer step ended.",
                                labels=_RANK_LABELS)
        took = GaugeMetricFamily("probe_step_time_seconds", "How long the rank's last optimizer step took "
                                 "(end of the step before to end of this one).", labels=_RANK_LABELS)
        state = GaugeMetricFamily("probe_rank_state", "1 for the rank's state now, 0 for the others: running; "
                                  "silent (its agent has not run for 2 s); gil_held (a C call keeps its GIL); "
                                  "stopped; starting; exited (cleanly); dead (killed or crashed).",
                                  labels=_RANK_LABELS + ("state",))
        rss = GaugeMetricFamily("probe_rank_rss_bytes", "The rank's resident memory, from /proc.", labels=_RANK_LABELS)
        beat = GaugeMetricFamily("probe_rank_heartbeat_age_seconds", "Seconds since the rank's agent last ran.",
                                 labels=_RANK_LABELS)
        restarts = GaugeMetricFamily("probe_rank_restarts", "Restarts of the rank (torchelastic's count).",
                                     labels=_RANK_LABELS)
        extras = ExtrasFamilies(_RANK_LABELS)
        seen: set = set()
        states: List[str] = []
        stepped = False
        for member in members:
            seen.add(member.pid)
            now_state = member.state
            if now_state == "silent" and self.holders.held(member.pid):
                now_state = "gil_held"
            elif now_state == "dead":
                now_state = self._ended_how(member.pid)
            states.append(now_state)
            labels = _labels(member, job, node, host)
            for word in STATES:
                state.add_metric(labels + [word], 1.0 if now_state == word else 0.0)
            restarts.add_metric(labels, float(member.restarts))
            if member.heartbeat_age is not None:
                beat.add_metric(labels, float(member.heartbeat_age))
            if member.state == "dead":
                continue
            memory = _rss(member.pid)
            if memory is not None:
                rss.add_metric(labels, float(memory))
            found = self._progress(member.pid)
            if found is None:
                continue
            steps.add_metric(labels, float(found.steps))
            stepped = stepped or found.steps > 0
            if found.steps:
                age.add_metric(labels, max(0.0, now - found.last))
            if found.step_time > 0:
                took.add_metric(labels, found.step_time)
            extras.add(read_extras(_paths.progress_path(member.pid)), labels, now)
        self.holders.ask([m.pid for m in members if m.state == "silent"])
        for known in (self._ticks, self._ended):
            for pid in [p for p in known if p not in seen]:
                del known[pid]
        yield from (steps, age, took, state, rss, beat, restarts)
        yield from extras.families()
        yield from self._framework_families(members, job, node, host)

        labels = [job, node, host]
        ranks = GaugeMetricFamily("probe_ranks", "Ranks of this node the helper knows (dead ones included).",
                                  labels=_NODE_LABELS)
        ranks.add_metric(labels, float(len(members)))
        yield ranks
        info = _meminfo()
        for key, name in (("MemTotal", "probe_node_memory_total_bytes"),
                          ("MemAvailable", "probe_node_memory_available_bytes")):
            if key in info:
                family = GaugeMetricFamily(name, "This node's %s, from /proc/meminfo." % key, labels=_NODE_LABELS)
                family.add_metric(labels, float(info[key]))
                yield family
        if watch is None:
            return
        records = CounterMetricFamily("probe_records", "Snapshots the node's stall watch wrote (stalls and deaths).",
                                      labels=_NODE_LABELS)
        records.add_metric(labels, float(watch.records))
        code = GaugeMetricFamily("probe_verdict", "The node's verdict, from its stall watch: 0 stepping, 1 starting "
                                 "(no step yet), 2 suspect (no step for half of hang_after), 3 stalled (recorded), "
                                 "4 a rank dead.", labels=_NODE_LABELS)
        code.add_metric(labels, float(verdict_code(watch, states, stepped)))
        hang = GaugeMetricFamily("probe_hang_after_seconds", "Seconds without a step that make a stall, as the "
                                 "watch reckons it now.", labels=_NODE_LABELS)
        hang.add_metric(labels, float(watch.hang_after(list(watch.ranks.values()))))
        yield from (records, code, hang)


def start(helper: Any, host: str) -> Optional[Any]:
    """Serve the node's metrics where ``PROBE_METRICS_PORT`` says, on the helper's address; the server, or None
    (unset, ``prometheus_client`` missing, the port taken: said once). Never raises."""
    port = metrics_port()
    if port is None:
        if os.environ.get("PROBE_METRICS_PORT", "").strip():
            _say("probe: PROBE_METRICS_PORT=%r is not a port; no metrics" % os.environ["PROBE_METRICS_PORT"][:40])
        return None
    try:
        from prometheus_client import CollectorRegistry
    except ImportError:
        _say("probe: PROBE_METRICS_PORT is set but prometheus_client is not installed (pip install "
             "'rankprobe[metrics]'); no metrics")
        return None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(helper))
    bind = host.strip("[]")
    from probe.host.metrics_http import serve  # bounded, /metrics only: any local user may reach this port

    try:
        server = serve(bind, port, registry)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            _say("probe: no metrics on %s:%d: %s" % (host, port, exc.strerror or exc))
            return None
        from probe.agent.port_holder import taken_note  # another user's process there would be scraped instead

        _say("probe: no metrics on %s:%d yet: %s; tried again every %.0f s for %.0f s"
             % (host, port, taken_note(port), RETRY_S, RETRY_FOR_S))
        try:
            threading.Thread(target=_retry, args=(serve, port, bind, registry, host),
                             name="probe-metrics-bind", daemon=True).start()
        except RuntimeError:
            pass
        return None
    except Exception as exc:  # noqa: BLE001 -- the helper serves on without metrics
        _say("probe: no metrics on %s:%d: %s" % (host, port, exc))
        return None
    _say("probe: the host helper serves metrics at http://%s:%d/metrics" % (host, port))
    return server


def _retry(serve: Any, port: int, bind: str, registry: Any, host: str) -> None:
    """Bind the metrics port once it is free (``RETRY_S`` apart, for ``RETRY_FOR_S``); said when it is."""
    deadline = time.monotonic() + RETRY_FOR_S
    while time.monotonic() < deadline:
        time.sleep(RETRY_S)
        try:
            serve(bind, port, registry)
        except OSError:
            continue
        except Exception as exc:  # noqa: BLE001
            _say("probe: no metrics on %s:%d: %s" % (host, port, exc))
            return
        _say("probe: the host helper serves metrics at http://%s:%d/metrics now" % (host, port))
        return
    _say("probe: no metrics on %s:%d: the port stayed taken" % (host, port))
