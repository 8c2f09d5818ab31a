"""``inject(pid)``: diagnose, find a running agent, or start one, and wait until it answers.

The whole call is bounded by ``timeout``: gdb's steps share it, and the wait for the agent's socket
takes what is left. Waiting happens from outside, with gdb detached (it exits meanwhile, and is reaped
at the end), so giving up never leaves the target stopped or traced (the one exception, a
``gil_ensure`` call that overran, is reported as such).
"""

import os
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

from probe.agent.options import AgentOptions
from probe.errors import Forbidden, InjectError, ProbeError, ProcessDead, UsageError
from probe.injector.bootstrap_line import bootstrap_code, exposure_dir
from probe.injector.diagnose import Problem, diagnose, ptrace_problems
from probe.injector.gdb import GdbAbandoned, GdbError, GdbTimeout, finish_detached
from probe.injector import queued
from probe.injector.methods import (GIL_ENSURE, PENDING, Plan, attach_and_look, can_remote_exec,
                                    inject_with_remote_exec, plan, run_plan)
from probe.injector.target import TargetInfo, expected_socket_path, read_target, running_threads
from probe.injector.threads import is_parked_safely

__all__ = ["InjectResult", "inject", "agent_answers", "default_timeout", "DEFAULT_TIMEOUT_S"]

GIL_KEPT_WAIT_S = 2.0  # how long a start queued behind a C call that keeps the GIL is waited for by default
_SLEEP_GRACE = 0.3  # how long a pending call gets to run after a time.sleep before gil_ensure is tried
DEFAULT_TIMEOUT_S = 5.0
_MAX_LOAD_SCALE = 4.0


def default_timeout() -> float:
    """The time an injection gets when none was asked for: DEFAULT_TIMEOUT_S on an idle machine, stretched
    by the load (run queue per CPU, at most 4x): gdb's start and its look at the threads are CPU work that
    waits its turn on a busy box (a DataLoader worker of a loaded 2-core machine took more than 5 s)."""
    return DEFAULT_TIMEOUT_S * _load_scale()


def _load_scale() -> float:
    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 1.0
    return min(_MAX_LOAD_SCALE, max(1.0, load))


def _seconds(value: float) -> str:
    """5 -> '5 s', 0.35 -> '0.35 s', 12.25 -> '12.2 s'."""
    text = ("%.2f" % value if value < 1 else "%.1f" % value).rstrip("0").rstrip(".")
    return text + " s"


@dataclass(frozen=True)
class InjectResult:
    """What ``inject`` did: ``method`` is ``pending_call``, ``gil_ensure``, ``remote_exec`` or ``none``."""

    pid: int
    socket_path: str
    method: str
    elapsed: float
    already_attached: bool
    token_file: Optional[str] = None
    """Where the TCP token is, when the agent was asked to listen on TCP."""


def inject(pid: int, options: Optional[AgentOptions] = None, timeout: Optional[float] = None,
           notice: Optional[Callable[[str], None]] = None) -> InjectResult:
    """Start the probe agent in process ``pid`` (or find the one running there) within ``timeout`` seconds
    (None: :func:`default_timeout`, scaled to the machine's load).

    Where a thread keeps the GIL in a C call, no agent can start before it returns: ``notice`` is told so
    at once, and without a ``timeout`` given the wait for it is ``GIL_KEPT_WAIT_S`` (scaled), not the whole
    default budget (the start stays queued and runs when the call returns).

    Raises ``InjectError`` with a ``hint`` when it cannot (``Forbidden`` for another user's process): the
    target is then running and untraced.
    """
    given = timeout
    if timeout is None:
        timeout = default_timeout()
    if timeout <= 0:
        raise UsageError("timeout must be positive, got %r" % timeout)
    started = time.monotonic()
    deadline = started + timeout
    info = _target(pid)
    socket = expected_socket_path(pid, info.uid)
    opts = options or AgentOptions()
    token_file = _token_file(opts, socket)
    if agent_answers(socket, pid):
        queued.clear(pid, socket)
        return InjectResult(pid, socket, "none", time.monotonic() - started, True, token_file)
    remote = can_remote_exec(info)
    problems = diagnose(pid, need_gdb=not remote)
    if problems:
        raise _error(problems)
    code = bootstrap_code(opts.to_json(), exposure_dir(info.uid, pid))
    socket = expected_socket_path(pid, info.uid)  # the runtime directory may be new: a private fallback
    token_file = _token_file(opts, socket)
    try:
        if remote:
            chosen = inject_with_remote_exec(info, code)
        else:
            chosen = _inject_with_gdb(info, code, socket, deadline, _budget(timeout, given))
        if chosen.gil_kept and chosen.delay:
            if given is None:
                deadline = min(deadline, time.monotonic() + GIL_KEPT_WAIT_S * _load_scale())
            if notice is not None:
                notice("process %d: %s; an agent needs the GIL to start, so its start is queued and runs when "
                       "the call returns; waiting %s for it" % (pid, chosen.delay,
                                                               _seconds(max(0.0, deadline - time.monotonic()))))
        if not _wait_for_agent(socket, pid, deadline):
            raise _not_started(info, chosen, _budget(timeout, given) if not chosen.gil_kept
                               else "the %s waited" % _seconds(time.monotonic() - started), socket)
    finally:
        finish_detached()  # gdb detached before the wait; its exit overlapped it
    queued.clear(pid, socket)
    return InjectResult(pid, socket, chosen.method, time.monotonic() - started, False, token_file)


def agent_answers(socket: str, pid: Optional[int] = None, timeout: float = 1.0) -> bool:
    """True when an agent answers ``GET /v1/health`` on ``socket`` (and says it is ``pid``)."""
    if not os.path.exists(socket):
        return False
    from probe.client.client import connect

    try:
        health = connect("unix:" + socket, timeout=timeout).health()
    except (ProbeError, OSError):
        return False
    return pid is None or health.get("pid") == pid


def _target(pid: int) -> TargetInfo:
    try:
        return read_target(pid)
    except OSError:
        problems = diagnose(pid) or [Problem("no_such_process", "cannot read process %d" % pid,
                                             "check the pid with `probe list`")]
        raise _error(problems) from None


def _budget(timeout: float, given: Optional[float]) -> str:
    """The whole time the injection had, said as the user can change it: '5 s (--timeout)', or the
    default and how the load stretched it."""
    if given is not None:
        return "%s (--timeout)" % _seconds(timeout)
    scale = timeout / DEFAULT_TIMEOUT_S
    if scale <= 1.0:
        return "%s (the default; --timeout sets it)" % _seconds(timeout)
    return ("%s (the default %s, x%.1f for this machine's load; --timeout sets it)"
            % (_seconds(timeout), _seconds(DEFAULT_TIMEOUT_S), scale))


def _inject_with_gdb(info: TargetInfo, code: str, socket: str, deadline: float, budget: str) -> Plan:
    try:
        session, threads = attach_and_look(info, deadline)
        chosen = plan(threads, info.pid)
        run_plan(session, chosen, code, deadline)
        if chosen.then_direct and not _wait_for_agent(socket, info.pid, min(deadline, time.monotonic() + _SLEEP_GRACE)):
            # A long time.sleep: the pending call waits for it to end. Look again; run on the sleeper.
            session, threads = attach_and_look(info, deadline)
            main = next((t for t in threads if t.lwp == info.pid), None)
            if main is not None and is_parked_safely(main):
                chosen = Plan(GIL_ENSURE, main)
                run_plan(session, chosen, code, deadline)
            else:
                session.detach()
        return chosen
    except GdbAbandoned as exc:
        queued.note(info.pid, socket, "%s: a thread holds the GIL in a long C call (gdb stays attached until it "
                                      "returns)" % exc)
        raise InjectError("%s: the target waits for the GIL, which a thread holds in a long C call; gdb was "
                          "left attached to finish the call and will detach by itself" % exc,
                          hint="do not kill gdb (pid %d): that would crash the target; the agent starts when "
                               "the call returns" % _gdb_pid(exc)) from None
    except GdbTimeout as exc:
        # Each of gdb's steps gets what is left of the whole budget: the step that overran is only where
        # the time ran out (with 0.1 s left, 'within 0.1 s' said nothing true of the wait).
        raise InjectError("the injection did not finish within %s: the time ran out while gdb was at %s; "
                          "gdb was stopped and process %d continues untouched%s"
                          % (budget, exc.step or "work", info.pid, _cpu_contention(info.pid)),
                          hint="try again with a longer --timeout (e.g. --timeout 30)") from None
    except GdbError as exc:
        problems = ptrace_problems(info)
        if problems:
            raise _error(problems) from None
        raise InjectError(str(exc), hint="gdb said: %s" % exc.output.strip()[-300:]) from None
    except OSError as exc:
        raise InjectError("injecting into process %d failed: %s" % (info.pid, exc),
                          hint="the target continues untouched; report this with the target's Python version")


def _cpu_contention(pid: int) -> str:
    """Why gdb may have been too slow: it competes for CPU with the target's running threads."""
    threads, running = running_threads(pid)
    cpus = os.cpu_count() or 1
    if running <= cpus:
        return ""
    return (" (the target has %d threads, %d of them running, on %d CPUs: gdb stops each thread in turn "
            "and competes with them for CPU)" % (threads, running, cpus))


def _gdb_pid(exc: GdbAbandoned) -> int:
    from probe.injector.gdb import abandoned_gdbs

    gdbs = abandoned_gdbs()
    return gdbs[-1].pid if gdbs else 0


def _wait_for_agent(socket: str, pid: int, deadline: float) -> bool:
    pause = 0.005
    while True:
        if agent_answers(socket, pid, timeout=max(min(deadline - time.monotonic(), 1.0), 0.1)):
            return True
        if time.monotonic() >= deadline or not os.path.exists("/proc/%d" % pid):
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _not_started(info: TargetInfo, chosen: Plan, budget: str, socket: str) -> InjectError:
    if not os.path.exists("/proc/%d" % info.pid):
        return InjectError("process %d exited during the injection" % info.pid,
                           hint="check its output; probe's bootstrap never raises into the target")
    if chosen.method == PENDING and chosen.delay:
        queued.note(info.pid, socket, chosen.delay if chosen.gil_kept else
                    "%s; it runs when the main thread executes Python code again" % chosen.delay)
    if chosen.method == PENDING and chosen.delay and chosen.gil_kept:
        return InjectError("the agent did not start within %s: %s; an agent needs the GIL to start, so none "
                           "can until that call returns" % (budget, chosen.delay),
                           hint="its start is queued and runs when the call returns (`probe %d health` tells); "
                                "meanwhile `probe %d backtrace` reads its stacks from outside (--native: with the C "
                                "frames)" % (info.pid, info.pid))
    if chosen.method == PENDING and chosen.delay:
        return InjectError("the agent did not start within %s: %s" % (budget, chosen.delay),
                           hint="the start is queued and runs as soon as the main thread executes Python code "
                                "again (`probe list` shows it then); or retry with a longer --timeout")
    threads, running = running_threads(info.pid)
    if running > 2 * (os.cpu_count() or 1):
        return InjectError("the agent did not answer within %s after %s: the target has %d threads, %d of them "
                           "running, on %d CPUs; the agent waits its turn for the GIL behind each of them"
                           % (budget, chosen.method, threads, running, os.cpu_count() or 1),
                           hint="it may still come up: `probe %d health` tells; or retry with a longer --timeout"
                                % info.pid)
    return InjectError("the agent did not answer within %s after %s" % (budget, chosen.method),
                       hint="look for 'probe: could not start the agent' in the target's stderr; "
                            "the target continues untouched")


def _token_file(opts: AgentOptions, socket: str) -> Optional[str]:
    if not opts.listen or opts.token:
        return None
    return opts.token_file or os.path.join(os.path.dirname(socket), os.path.basename(socket)[:-5] + ".token")


def _error(problems: List[Problem]) -> ProbeError:
    """The first problem, with the others in its hint; another user's process is refused (exit 4, as
    every command refuses it), a missing one is no process (exit 3, as for every command), the rest are
    failed injections (exit 6)."""
    first = problems[0]
    hint = first.hint
    if len(problems) > 1:
        hint += "; also: " + "; ".join("%s (%s)" % (p.message, p.hint) for p in problems[1:])
    kind = {"other_user": Forbidden, "no_such_process": ProcessDead}.get(first.code, InjectError)
    error: ProbeError = kind(first.message, hint=hint)
    error.problems = problems  # type: ignore[attr-defined]
    return error
