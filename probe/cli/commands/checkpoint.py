"""``probe TARGET checkpoint PATH``: save the target's models, optimizers, step and RNG states, atomically."""

import json
import os
import secrets
from typing import Any, Dict, Iterator, Optional, Tuple

import click

from probe.cli.context import CliContext, each_target, pass_cli
from probe.cli.options import Seconds
from probe.cli.output import emit, say
from probe.cli.render import visible
from probe.errors import UsageError

FILE_FORMATS = ("probe", "hf", "lightning")

STEP_WAIT_S = 2.0
"""How long the agent waits for an optimizer step before it saves alongside the loop."""


@click.command("checkpoint")
@click.argument("path")
@click.option("--model", "models", multiple=True, metavar="EXPR",
              help="The model to save, as an expression in the target's __main__, in --frame's frame, or else in "
                   "the first of the main thread's frames of the program's own code that defines it "
                   "(trainer.model where trainer is a local of main()); repeatable. A DDP / FSDP / compile "
                   "wrapper is saved as the module it wraps. Default: the models probe finds (probe.watch, "
                   "__main__, the main thread's frames, a Hugging Face / Lightning / accelerate trainer's, the "
                   "garbage collector).")
@click.option("--optimizer", "optimizers", multiple=True, metavar="EXPR",
              help="The optimizer to save, likewise (repeatable). Default: those probe finds.")
@click.option("--frame", metavar="THREAD:DEPTH",
              help="Evaluate --model/--optimizer in that frame's namespace, as eval --frame does (e.g. "
                   "MainThread:main for the function main's locals).")
@click.option("--checkpoint-timeout", type=Seconds(0.1), default=300.0, show_default=True,
              help="Seconds the save may take; past them it stops and leaves the old file in place.")
@click.option("--concurrent", is_flag=True,
              help="Write alongside the training loop instead of between two optimizer steps (no pause; a step "
                   "that runs meanwhile may show in some tensors).")
@click.option("--overwrite", is_flag=True,
              help="Replace a checkpoint already at PATH. Without it, an existing PATH is refused; with it, only "
                   "a file torch.save (or probe) wrote is replaced, never a symbolic link nor another file.")
@click.option("--json", "as_json", is_flag=True, help="The same as -F json: what was saved, as JSON.")
@click.option("-F", "--format", "fmt_given", type=click.Choice(("text", "json") + FILE_FORMATS), multiple=True,
              help="What to write: probe (default: one file, see below), hf (PATH is a directory that Hugging "
                   "Face's Trainer(...).train(resume_from_checkpoint=PATH) resumes from) or lightning (the file "
                   "Lightning's Trainer.fit(ckpt_path=PATH) resumes from); and how to print the result: text "
                   "(default) or json (exact, for scripts). Give both as -F hf -F json.")
@pass_cli
def checkpoint(cli: CliContext, path: str, models: Tuple[str, ...], optimizers: Tuple[str, ...], frame: Optional[str],
               checkpoint_timeout: float, concurrent: bool, overwrite: bool, as_json: bool,
               fmt_given: Tuple[str, ...]) -> None:
    """Save models, optimizers, LR schedulers, trainer progress and RNG states to PATH, atomically.

    PATH is in the target's file system ({rank} becomes its rank); a relative PATH is taken from this
    shell's directory for a target on this host, else from the target's. Written to a temporary file,
    fsynced, then renamed: a crash never leaves a truncated file nor loses an older one at PATH. An
    existing PATH is replaced only with --overwrite, and only if it is a checkpoint; a symbolic link at
    PATH, or one of another user on the way to it, is never followed.
    The model is saved unwrapped (keys without module.), loadable with a strict load into its class.
    Taken between two optimizer steps, on the training thread (the loop waits, and model, optimizer,
    scheduler and step count are of one step); a job that makes no step within 2 s (hung) is saved
    alongside it, its state not changing. The output says which. Needs eval enabled in the agent (it
    writes files as the target's user).

    Under DeepSpeed, the optimizer saved is ZeRO's own state_dict (this rank's partition, as DeepSpeed's
    save_checkpoint keeps it), with DeepSpeed's scheduler and engine.global_steps; engine.save_checkpoint
    itself is not called (it is collective: every rank must call it at the same step). ZeRO stage 3 and
    the hf and lightning formats are refused (exit 2).
    """
    outputs = [f for f in fmt_given if f in ("text", "json")] + (["json"] if as_json else [])
    files = [f for f in fmt_given if f in FILE_FORMATS]
    if len(set(outputs)) > 1:
        raise UsageError("two output formats were asked for: %s" % " and ".join(dict.fromkeys(outputs)),
                         hint="give one: --json, or -F json")
    if len(set(files)) > 1:
        raise UsageError("two checkpoint formats were asked for: %s" % " and ".join(dict.fromkeys(files)),
                         hint="give one of -F probe, -F hf, -F lightning")
    fmt = outputs[0] if outputs else None
    file_format = files[0] if files else "probe"
    several = len(cli.targets) > 1 or cli.is_cluster
    save_id = secrets.token_hex(8)  # one for every rank: an hf directory one of them made is theirs all
    if cli.is_cluster and cli.deadline is None:  # every rank's save may take its time limit, and the step wait
        cli.deadline = checkpoint_timeout + STEP_WAIT_S + 5.0
        if not cli.timeout_given:
            cli.timeout = cli.deadline
    for client, saved in each_target(cli, lambda c: c.checkpoint(_where(c, path), list(models) or None,
                                                                  list(optimizers) or None, checkpoint_timeout,
                                                                  concurrent, frame=frame, format=file_format,
                                                                  overwrite=overwrite, save_id=save_id)):
        if fmt == "json":
            member = cli.cluster_member(client)
            emit(json.dumps(dict(saved, rank=member.rank, host=member.host) if member is not None
                                  else dict(saved, target=client.target.label)))
            continue
        if several:
            say("== %s ==" % cli.label(client))
        for line in render_checkpoint(saved):
            say(visible(line))


def _where(client: Any, path: str) -> str:
    """A relative path means this shell's directory when the target runs on this host (a unix socket)."""
    local = getattr(client.target.address, "path", None) is not None
    return os.path.abspath(path) if local and not os.path.isabs(os.path.expanduser(path)) else path


def render_checkpoint(saved: Dict[str, Any]) -> Iterator[str]:
    """What the agent saved, for a person."""
    yield "saved %s: %.1f MB in %.2f s" % (saved.get("path"), (saved.get("bytes") or 0) / 1e6, saved.get("seconds") or 0)
    yield "  sha256      %s" % saved.get("sha256")
    if saved.get("taken"):
        yield "  taken       %s" % saved["taken"]
    for model in saved.get("models", []):
        yield "  model       %s: %d tensors, %d parameters" % (model["name"], model["tensors"], model["parameters"])
    for optimizer in saved.get("optimizers", []):
        yield "  optimizer   %s: %s, %d param groups" % (optimizer["name"], optimizer["class"],
                                                         optimizer["param_groups"])
    if not saved.get("optimizers"):
        yield "  optimizer   none found (name one with --optimizer EXPR)"
    for scheduler in saved.get("schedulers", []):
        yield "  scheduler   %s: %s" % (scheduler["name"], scheduler["class"])
    if not saved.get("schedulers") and saved.get("format") == "hf":
        yield "  scheduler   none in the job: scheduler.pt holds a constant schedule at the lr now (transformers " \
              "resumes the optimizer only beside one)"
    trainer = saved.get("trainer")
    if trainer:
        yield "  trainer     %s (%s): global step %s, epoch %s" % (trainer["name"], trainer["kind"],
                                                                    trainer.get("global_step"), trainer.get("epoch"))
    if saved.get("format") not in (None, "probe"):
        yield "  format      %s: %s" % (saved["format"], ", ".join(saved.get("files", [])))
    step = saved.get("step")
    yield "  step        %s" % ("unknown" if step is None else "%s (from %s)" % (step, saved.get("step_source")))
    yield "  rng         %s" % (", ".join(saved.get("rng", [])) or "none")
    if saved.get("dtensors"):
        yield "  dtensors    %d saved as rank %s's local shards (placements recorded)" % (saved["dtensors"],
                                                                                       saved.get("rank"))
