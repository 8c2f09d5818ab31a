"""The agent's routes that act on the target: eval and its interrupt, completion, the debugger, the
learning rate, checkpoints, the torch trace and profile (control or eval scope: ``probe.agent.scopes``). Each takes
the request and returns a response; ``probe.agent.routes`` dispatches to them.
"""

import math
from typing import Any, Dict, Optional

from probe.agent.budget import work_slot
from probe.agent.http import Request, Response
from probe.agent.limits import within
from probe.agent.route_common import ServingAgent, optional_seconds, request_ceilings
from probe.agent.switch import fast_switching
from probe.errors import BadRequest, EvalDisabled

__all__ = ["evaluate", "torch_lr", "interrupt_eval", "complete", "debug_start", "debug_stop", "torch_checkpoint",
           "torch_trace", "torch_profile"]


def evaluate(agent: ServingAgent, request: Request) -> Response:
    _require_eval(agent)
    body = request.json()
    code = body.get("code")
    if not isinstance(code, str):
        raise BadRequest("give the snippet as {\"code\": \"...\"}")
    ceilings = request_ceilings()
    timeout = within(optional_seconds(body, "timeout"), agent.options.eval_timeout, ceilings.eval_timeout,
                     "--eval-timeout", "PROBE_EVAL_TIMEOUT_CEILING")
    from probe.agent.evaluator import run_snippet
    from probe.agent.frames import parse_frame
    from probe.agent.placement import PLACES

    place = body.get("on", "agent")
    if place not in PLACES:
        raise BadRequest("\"on\" is one of %s" % ", ".join(PLACES))
    frame = parse_frame(body["frame"]) if body.get("frame") is not None else None
    wait = min(optional_seconds(body, "wait") or (10.0 if place == "main" else 60.0), _MAX_WAIT)
    outcome = run_snippet(code, timeout, place, frame, _job_id(body), wait, ceilings.eval_output)
    _note_outcome(request, outcome)
    answer = outcome.to_json_dict()
    answer["limits"] = {"timeout_s": timeout, "timeout_ceiling_s": max(ceilings.eval_timeout, agent.options.eval_timeout),
                        "max_output": ceilings.eval_output, "stdout_dropped": outcome.stdout_dropped,
                        "stderr_dropped": outcome.stderr_dropped}
    return Response.json(answer)


_MAX_WAIT = 600.0  # seconds a snippet may wait for the main thread or a step


def _note_outcome(request: Request, outcome: Any) -> None:
    """What came of a snippet, for the audit trail: ok, error, or interrupted (Ctrl-C, its time limit)."""
    error = outcome.error or ""
    if outcome.timed_out or error.startswith(("EvalInterrupted", "KeyboardInterrupt")):
        request.__dict__["outcome"] = ("interrupted", error.strip().splitlines()[-1] if error.strip() else "time limit")
    elif error:
        request.__dict__["outcome"] = ("error", error.strip().splitlines()[-1])


def torch_lr(agent: ServingAgent, request: Request) -> Response:
    """One step of ``probe T lr`` (``probe.client.lr``): ``{"what": "plan"|"change"|"readback", "args": [...],
    "on": "agent"|"step", "wait": S}``. The agent writes the snippet itself from checked values, so that a
    learning-rate change needs the control scope, not eval's."""
    if not agent.options.eval_enabled:
        raise EvalDisabled("probe lr changes the target through eval, and the agent refuses it: eval is switched off "
                           "in this agent (it was started with --no-eval or PROBE_EVAL=0)",
                           hint="restart the target with eval enabled to change its learning rate")
    body = request.json()
    what, args, place = body.get("what"), body.get("args"), body.get("on", "agent")
    if what not in ("plan", "change", "readback") or not isinstance(args, list) or place not in ("agent", "step"):
        raise BadRequest("give {\"what\": \"plan\"|\"change\"|\"readback\", \"args\": [...], \"on\": \"agent\"|\"step\"}")
    if what == "readback":
        if len(args) != 1 or isinstance(args[0], bool) or not isinstance(args[0], int):
            raise BadRequest("readback takes one whole number, the change's token")
    else:
        value, groups, optimizer, base = (list(args) + [None, None, False])[:4] if len(args) <= 4 else (None,) * 4
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise BadRequest("the learning rate must be a finite number")
        if groups is not None and not (isinstance(groups, list) and all(
                isinstance(g, int) and not isinstance(g, bool) and 0 <= g < 1 << 20 for g in groups)):
            raise BadRequest("groups must be a list of group numbers")
        if optimizer is not None and not (isinstance(optimizer, str) and len(optimizer) <= 200):
            raise BadRequest("optimizer must be a name")
        if not isinstance(base, bool):
            raise BadRequest("base must be true or false")
        args = [float(value), groups, optimizer, base]
    code = "print(__import__('probe.tables.torch.lr', fromlist=['answer']).answer(%s))" % ", ".join(
        repr(a) for a in [what] + args)
    from probe.agent.evaluator import run_snippet

    wait = min(optional_seconds(body, "wait") or 60.0, _MAX_WAIT)
    timeout = min(optional_seconds(body, "timeout") or 20.0, 120.0)
    outcome = run_snippet(code, timeout, place, None, _job_id(body), wait, request_ceilings().eval_output)
    _note_outcome(request, outcome)
    if outcome.error is None and '"error": {' in (outcome.stdout or ""):
        request.__dict__["outcome"] = ("error", outcome.stdout.strip().splitlines()[-1][:300])
    return Response.json(outcome.to_json_dict())


def _require_eval(agent: ServingAgent) -> None:
    if not agent.options.eval_enabled:
        raise EvalDisabled("eval is switched off in this agent (it was started with --no-eval or PROBE_EVAL=0)",
                           hint="use SQL queries, or restart the agent with eval enabled")


def _job_id(body: Dict[str, Any]) -> Optional[str]:
    value = body.get("id")
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= 64:
        raise BadRequest("id must be a string of 1 to 64 characters")
    return value


def interrupt_eval(agent: ServingAgent, request: Request) -> Response:
    """Interrupt the snippet sent with ``{"id": ...}`` (the REPL's Ctrl-C)."""
    _require_eval(agent)
    job_id = _job_id(request.json())
    if job_id is None:
        raise BadRequest("give the snippet's id as {\"id\": \"...\"}")
    from probe.agent.placement import interrupt_and_settle

    return Response.json(dict(interrupt_and_settle(job_id), id=job_id))


def complete(agent: ServingAgent, request: Request) -> Response:
    """Completions of a name or dotted attribute in ``__main__`` (or a frame), bounded in time."""
    _require_eval(agent)
    body = request.json()
    text = body.get("text")
    if not isinstance(text, str) or len(text) > 1000:
        raise BadRequest("give the text to complete as {\"text\": \"model.la\"}")
    import sys

    from probe.agent.completion import complete_bounded
    from probe.agent.frames import Scope, frame_scope, parse_frame

    frame = parse_frame(body["frame"]) if body.get("frame") is not None else None
    matches = complete_bounded(text, lambda: frame_scope(frame) if frame else Scope(sys.modules["__main__"].__dict__))
    return Response.json({"matches": matches or [], "timed_out": matches is None})


def debug_start(agent: ServingAgent, request: Request) -> Response:
    _require_eval(agent)
    body = request.json()
    host, port = body.get("host", "127.0.0.1"), body.get("port", 5678)
    if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise BadRequest("give {\"host\": \"127.0.0.1\", \"port\": 5678}")
    import_dir = body.get("import_dir")
    import probe.agent.debugger as debugger

    window = body.get("window_s", debugger.DEFAULT_WINDOW_S)
    if isinstance(window, bool) or not isinstance(window, (int, float)):
        raise BadRequest("window_s must be a number of seconds")
    return Response.json(debugger.start(host, port, bool(body.get("insecure")),
                                        import_dir if isinstance(import_dir, str) else None, float(window)))


def debug_stop(agent: ServingAgent, request: Request) -> Response:
    _require_eval(agent)
    import probe.agent.debugger as debugger

    return Response.json(debugger.stop())


def torch_checkpoint(agent: ServingAgent, request: Request) -> Response:
    """Save models, optimizers, step and RNG states to a file, atomically (see probe.tables.torch.checkpoint)."""
    if not agent.options.eval_enabled:
        raise EvalDisabled("checkpoint is switched off with eval in this agent: it writes files as the target's "
                           "user, and --model/--optimizer run code (it was started with --no-eval or PROBE_EVAL=0)",
                           hint="restart the agent with eval enabled to save checkpoints through probe")
    body = request.json()
    from probe.tables.torch.checkpoint import DEFAULT_TIMEOUT_S, save

    path = body.get("path")
    names: Dict[str, Any] = {key: body.get(key) for key in ("models", "optimizers")}
    for key, value in names.items():
        if value is not None and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
            raise BadRequest("%s must be a list of expressions (strings)" % key)
    if not isinstance(path, str) or not path:
        raise BadRequest("give the checkpoint's path as {\"path\": \"/ckpt/x.pt\"}")
    timeout = min(optional_seconds(body, "timeout") or DEFAULT_TIMEOUT_S, 24 * 3600.0)
    concurrent = body.get("concurrent", False)
    if not isinstance(concurrent, bool):
        raise BadRequest("concurrent must be true or false")
    fmt = body.get("format", "probe")
    if not isinstance(fmt, str):
        raise BadRequest("format must be a string (probe, hf or lightning)")
    overwrite = body.get("overwrite", False)
    if not isinstance(overwrite, bool):
        raise BadRequest("overwrite must be true or false")
    save_id = body.get("save_id", "")
    if not isinstance(save_id, str) or len(save_id) > 64 or not all(c.isalnum() and c.isascii() for c in save_id):
        raise BadRequest("save_id must be up to 64 letters and digits")
    from probe.agent.frames import frame_scope, parse_frame
    from probe.agent.placement import run_between_steps

    scope = frame_scope(parse_frame(body["frame"])) if body.get("frame") is not None else None
    return Response.json(save(path, names["models"], names["optimizers"], timeout,
                              None if concurrent else run_between_steps, scope=scope, fmt=fmt, overwrite=overwrite,
                              save_id=save_id))


def torch_trace(agent: ServingAgent, request: Request) -> Response:
    """Start, stop, describe or export the torch trace (see probe.tables.torch.trace.control)."""
    from probe.tables.torch.trace import control

    body = request.json()
    with work_slot(agent.options.query_timeout), fast_switching():
        return Response.json(control(body, agent.options.eval_enabled, agent.options.max_result_bytes))


def torch_profile(agent: ServingAgent, request: Request) -> Response:
    """Start, follow, fetch or cancel a torch.profiler capture of N steps (see probe.tables.torch.profile)."""
    from probe.tables.torch.profile import control

    body = request.json()
    with work_slot(agent.options.query_timeout), fast_switching():
        return Response.json(control(body, agent.options.eval_enabled, agent.options.max_result_bytes))
