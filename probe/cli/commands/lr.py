"""``probe TARGET lr VALUE``: change the learning rate so that it sticks under the LR scheduler."""

import json
from typing import Any, Dict, Iterator, Optional, Tuple

import click

from probe.cli.context import CliContext, each_target, pass_cli
from probe.cli.options import TEXT, Seconds, output_format
from probe.cli.output import emit, say
from probe.client.lr import DEFAULT_STEP_WAIT_S, change_lr, check_every_rank
from probe.errors import ProbeError


@click.command("lr")
@click.argument("value", type=float)
@click.option("--group", "groups", type=click.IntRange(min=0), multiple=True, metavar="N",
              help="Change param group N only (repeatable). Default: every group, which must share one lr.")
@click.option("--optimizer", metavar="NAME",
              help="The optimizer to change, by its name in torch.optimizers. Default: the only one found.")
@click.option("--base", is_flag=True,
              help="VALUE is the scheduler's base lr (its peak, for a warmup-then-decay schedule); the lr follows "
                   "the schedule from that base at its next step. Default: VALUE is the lr from now on.")
@click.option("--start-within", "step_wait", type=Seconds(0.1, 600), default=DEFAULT_STEP_WAIT_S,
              show_default=True, help="Seconds to wait for the optimizer step to change it after (and again for "
                                      "the one to read it back after).")
@click.option("--no-check", is_flag=True, help="Do not wait for the next step to read the change back.")
@click.option("--this-rank-only", is_flag=True,
              help="Change the ranks targeted even where they are only some of a multi-rank job (refused by "
                   "default: the replicas would drift apart).")
@output_format(*TEXT, json_help="what was changed and read back")
@pass_cli
def lr(cli: CliContext, value: float, groups: Tuple[int, ...], optimizer: Optional[str], base: bool,
       step_wait: float, no_check: bool, this_rank_only: bool, fmt: Optional[str]) -> None:
    """Set the learning rate to VALUE so that it sticks, and prove it after the next step.

    A scheduler such as LambdaLR (Hugging Face's Trainer makes one) sets each step's lr from its own
    base values, so a group's lr set alone is undone at its next step. This scales, for each group,
    everything the schedule is made from by one factor: the group's lr and initial_lr, and the
    scheduler's base_lrs (and its last lr; OneCycleLR's max_lr and min_lr, CyclicLR's max_lrs). By
    default the factor is VALUE / lr: the lr is VALUE now and the schedule goes on from there in
    proportion (a decay keeps decaying from VALUE). With --base it is VALUE / base_lr: the base
    becomes VALUE. Floors (eta_min, min_lrs) stay. DeepSpeed's schedulers (WarmupLR, WarmupDecayLR,
    WarmupCosineLR, OneCycle, LRRangeTest) have everything they compute lr from scaled (max_lrs,
    min_lrs, delta_lrs; org_lrs; min_lr). Without a scheduler, lr and initial_lr are set.

    The change is made on the training thread right after the next optimizer step (as eval
    --between-steps), and read back right after the step that follows: the output gives each group's
    lr before, after, and after that step, and says whether it stuck (exit 1 where it was undone: the
    program sets lr itself). Needs eval enabled in the agent. Across ranks, each rank changes at its
    own next step. A change that reaches only some ranks of a multi-rank job is refused (exit 2) unless
    --this-rank-only: use --all-ranks.
    """
    if not this_rank_only:
        _refuse_some_ranks(cli)
    several = len(cli.targets) > 1 or cli.is_cluster
    if cli.is_cluster and cli.deadline is None:
        cli.deadline = 2 * step_wait + 60.0
        if not cli.timeout_given:
            cli.timeout = cli.deadline
    for client, done in each_target(cli, lambda c: change_lr(c, value, list(groups) or None, optimizer, base,
                                                             step_wait, not no_check)):
        readback = done.get("readback") or {}
        if readback and (readback.get("error") or not readback.get("stuck")):
            cli.exit_code = cli.exit_code or (5 if readback.get("error") else 1)
        if fmt == "json":
            member = cli.cluster_member(client)
            where = {"rank": member.rank, "host": member.host} if member is not None else {"target": client.target.label}
            emit(json.dumps(dict(done, **where)))
            continue
        if several:
            say("== %s ==" % cli.label(client))
        for line in render_lr(done):
            say(line, err=line.startswith("probe:"))


def _refuse_some_ranks(cli: CliContext) -> None:
    """Exit 2 where the targets are only some ranks of a job (each target's health says its rank and world)."""
    if cli.is_cluster:
        cluster = cli.cluster()
        targeted = [m.rank for m in cluster.members]
        worlds = [m.world_size for m in cluster.members]
        if cluster.left_out:  # ranks the helpers listed but cannot reach: they would keep the old lr
            worlds.append(len(set(targeted)) + 1)
    else:
        targeted, worlds = [], []
        for client in cli.clients():
            try:
                health = client.health(fallback=False)
            except ProbeError:
                continue  # the change itself will say why this target cannot answer
            targeted.append(health.get("rank"))
            worlds.append(health.get("world_size"))
    first = cli.targets[0] if cli.targets else "TARGET"
    check_every_rank(targeted, worlds, "probe %s --all-ranks lr VALUE" % first)


def render_lr(done: Dict[str, Any]) -> Iterator[str]:
    """What the target changed and read back, for a person."""
    yield "optimizer  %s (%s)" % (done.get("optimizer"), done.get("class"))
    schedulers = done.get("schedulers") or []
    for scheduler in schedulers:
        yield "scheduler  %s (%s): %s" % (scheduler["name"], scheduler["class"], scheduler["note"])
    if not schedulers:
        yield "scheduler  none found: lr and initial_lr are set"
    steps = _steps(done.get("step"), (schedulers[0] if schedulers else {}).get("step"))
    how = ("its base lr set to %g, the schedule's own factor kept" % done["value"] if done.get("mode") == "base"
           else "lr set to %g%s" % (done["value"], ", the schedule scaled to go on from it" if schedulers else ""))
    yield "changed    right after an optimizer step%s: %s" % (steps, how)
    for row in done.get("groups", []):
        before, after = row.get("before") or {}, row.get("after") or {}
        parts = ["%s %s -> %s" % (key, _num(before.get(key)), _num(after.get(key)))
                 for key in ("lr", "base_lr", "initial_lr") if before.get(key) is not None or after.get(key) is not None]
        yield "  group %d  %s" % (row["group"], "   ".join(parts))
    readback = done.get("readback")
    if readback is None:
        return
    if readback.get("error"):
        yield "probe: %s" % readback["error"]
        return
    yield "read back  right after the next one%s:" % _steps(readback.get("step"), readback.get("scheduler_step"))
    for row in readback.get("groups", []):
        yield "  group %d  lr %s%s: %s" % (row["group"], _num(row.get("lr")),
                                          "" if row.get("base_lr") is None else ", base_lr %s" % _num(row["base_lr"]),
                                          _VERDICT.get(row.get("verdict"), row.get("verdict")))
    if not readback.get("stuck"):
        yield ("probe: the change did not stick: something set lr back that probe did not change (the program's own "
               "schedule, or a scheduler probe did not find)")


_VERDICT = {"stuck": "it stuck", "undone": "UNDONE (set back)", "unchanged": "unchanged (it was that already)",
            "unknown": "not readable (a CUDA tensor?)"}


def _steps(step: Any, scheduler_step: Any) -> str:
    known = [what % n for what, n in (("optimizer step %s", step), ("scheduler step %s", scheduler_step))
             if n is not None]
    return " (%s)" % ", ".join(known) if known else ""


def _num(value: Any) -> str:
    return "-" if value is None else "%.6g" % value

