"""Changing a target's learning rate so that it sticks, from a script or the CLI (``probe TARGET lr``).

    from probe.client.lr import change_lr
    done = change_lr(probe.connect("4242"), 0.05)      # {"optimizer", "groups", "schedulers", "readback", ...}

Three steps through the agent's lr route (the control scope; eval enabled in the agent; an older agent
takes them as eval snippets): a check on the agent's thread
(no optimizer, a group out of range: said at once, nothing waits), the change on the training thread
right after the next optimizer step (see ``probe.tables.torch.lr`` for what it scales), and the
read-back right after the step that follows, which says whether the change held.
"""

import json
from typing import Any, Dict, Optional, Sequence

from probe.client.client import Client
from probe.client.results import EvalResult
from probe.errors import EvalError, Forbidden, NotFound, Timeout, UsageError, error_from_code

__all__ = ["change_lr", "check_every_rank", "DEFAULT_STEP_WAIT_S"]

DEFAULT_STEP_WAIT_S = 30.0
_SNIPPET_S = 20.0  # the snippet's own time: finding the optimizer and its schedulers is bounded well below
_MODULE = "probe.tables.torch.lr"


def change_lr(client: Client, value: float, groups: Optional[Sequence[int]] = None, optimizer: Optional[str] = None,
              base: bool = False, step_wait: float = DEFAULT_STEP_WAIT_S, check: bool = True) -> Dict[str, Any]:
    """Set the lr of ``groups`` (all when None) of ``optimizer`` (the only one when None) to ``value`` so
    that it sticks under the optimizer's scheduler; ``base=True`` sets the scheduler's base value instead.

    Waits at most ``step_wait`` seconds for the step to change it after, and as long again for the step
    to read it back after (``check=False``: no read-back). The answer is what the target did: the
    optimizer, its schedulers, each group's values before and after, and ``readback`` (None without
    ``check``): each group's lr after the next step and its ``verdict`` (``stuck``, ``undone``,
    ``unchanged``), ``stuck`` for all. Errors are probe errors: ``NotFound`` (no optimizer),
    ``BadRequest`` (a group out of range, groups with different rates), ``Forbidden`` (eval off), ``Timeout``
    (no optimizer step came: nothing was changed).
    """
    args = (float(value), list(groups) if groups is not None else None, optimizer, bool(base))
    _run(client, "plan", args, "agent", None)
    try:
        done = _run(client, "change", args, "step", step_wait)
    except Timeout as exc:
        raise Timeout("no optimizer step came within %g s: nothing was changed (the job may be hung, between epochs, "
                      "or evaluating)" % step_wait,
                      hint="try again while it trains, or wait longer with --start-within SECONDS") from exc
    done["readback"] = None
    if check:
        try:
            done["readback"] = _run(client, "readback", (done["token"],), "step", step_wait)
        except Timeout:
            done["readback"] = {"error": "no optimizer step came within %g s after the change, so it was not read "
                                         "back" % step_wait}
    return done


def check_every_rank(targeted: Sequence[Optional[int]], world_sizes: Sequence[Optional[int]], how_all: str) -> None:
    """Refuse (``UsageError``, exit 2) a change of lr that reaches only some ranks of a multi-rank job.

    Replicas of a data-parallel job (DDP, FSDP, DeepSpeed) average their gradients but each steps with its
    own lr: one rank changed alone keeps training, and the replicas silently drift apart. ``targeted`` are
    the ranks the change would reach (None: a target that says no rank), ``world_sizes`` what each target
    says its job has; ``how_all`` is the command that reaches every rank, for the message.
    """
    world = max((w for w in world_sizes if isinstance(w, int)), default=1)
    reached = {r for r in targeted if isinstance(r, int)}
    if world <= 1 or len(reached) >= world:
        return
    missing = sorted(set(range(world)) - reached)
    shown = ", ".join(str(r) for r in missing[:8]) + (", ..." if len(missing) > 8 else "")
    raise UsageError(
        "this would change the lr of %s of a job of %d ranks, not of rank%s %s: data-parallel replicas would then "
        "train with different rates and drift apart without any error" % (
            "rank %d" % min(reached) if len(reached) == 1 else "%d ranks" % len(reached), world,
            "" if len(missing) == 1 else "s", shown),
        hint="change every rank at its next step: %s; or, to change only these on purpose, add --this-rank-only"
             % how_all)


def _run(client: Client, what: str, args: Sequence[Any], on: str, wait: Optional[float]) -> Dict[str, Any]:
    """One step in the target: through the agent's own lr route (the control scope suffices), or as an
    eval snippet where the agent is older and has none."""
    body: Dict[str, Any] = {"what": what, "args": list(args), "on": on, "timeout": _SNIPPET_S}
    if wait is not None:
        body["wait"] = wait
    socket_wait = client._answer_wait(_SNIPPET_S, 30.0)
    if on != "agent" and not client.fixed_timeout:
        socket_wait = max(socket_wait, (wait or 60.0) + _SNIPPET_S + 5.0)
    try:
        raw = client._json("POST", "/v1/torch/lr", body, timeout=socket_wait)
        result = EvalResult(raw.get("stdout", ""), raw.get("stderr", ""), raw.get("value"), raw.get("error"),
                            bool(raw.get("timed_out")), raw.get("limits"))
    except NotFound:  # an agent older than the route
        result = _run_as_eval(client, what, args, on, wait)
    if not result.ok:
        first = (result.error or "").strip().splitlines()
        raise EvalError("the learning-rate %s failed in the target: %s" % (what, first[-1] if first else "timed out"))
    try:
        answer: Dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise EvalError("the target's answer to the learning-rate %s could not be read: %r"
                        % (what, result.stdout[:200])) from None
    error = answer.get("error")
    if isinstance(error, dict):
        raise error_from_code(str(error.get("code")), str(error.get("message")), error.get("hint") or None)
    return answer


def _run_as_eval(client: Client, what: str, args: Sequence[Any], on: str, wait: Optional[float]) -> EvalResult:
    code = "print(__import__(%r, fromlist=['answer']).answer(%s))" % (_MODULE, ", ".join(map(repr, (what,) + tuple(args))))
    try:
        return client.eval(code, timeout=_SNIPPET_S, on=on, wait=wait)
    except Forbidden as exc:  # eval switched off (the agent says so): the same refusal, in this command's words
        raise type(exc)("probe lr changes the target through eval, and the agent refuses it: %s" % exc.message,
                        hint="restart the target with eval enabled to change its learning rate") from exc
