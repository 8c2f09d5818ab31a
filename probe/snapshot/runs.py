"""Which run of a job a record is of, and which directories are one recording.

A snapshot id names one recording of one run of a job. The job's name (``store.job_id``: the Slurm job,
torchelastic's run id, else ``port<PROBE_PORT>``) is shared by every run on the same port, so the watch
writes into each node's meta what tells runs apart (:func:`run_of`): the run every node of it shares where
the launcher gives one (Slurm's job and step, torchelastic's run id), and this node's launch (the
launcher's pid and start time; under a launcher probe does not run in, the ranks' own).

Two directories of one job, begun within ``store.GROUP_WINDOW_S`` of each other, are one recording only
where each was written by the watch of a different node (one node writes one directory a recording), both
are complete (their meta says whose they are), and the runs they name, where both name one, are the same.
A snapshot taken by hand records every rank at once: it is a recording of its own. Stdlib only.
"""

from typing import Any, Dict, Iterable, List, Optional

__all__ = ["one_recording", "run_of", "launch_of"]


def _meta(metas: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    return metas[0] if metas else None


def one_recording(a: List[Dict[str, Any]], b: List[Dict[str, Any]]) -> bool:
    """Whether two directories, by their metas, can be two nodes' parts of one recording."""
    first, second = _meta(a), _meta(b)
    if first is None or second is None:
        return False  # still being written (or its node died first): its own until it says whose it is
    if first.get("by") != "watch" or second.get("by") != "watch":
        return False
    if (first.get("host"), first.get("node")) == (second.get("host"), second.get("node")):
        return False  # the same node: two recordings of it
    run_a, run_b = first.get("run"), second.get("run")
    return not (run_a and run_b and run_a != run_b)


def run_of(environs: Iterable[Dict[bytes, bytes]]) -> Optional[str]:
    """The run every node of the job shares, from the ranks' environments: ``slurm JOB.STEP``,
    ``torchelastic RUN_ID``; None where the launcher gives none (torchrun's default static rendezvous:
    run id "none"; accelerate, Lightning, mp.spawn, mpirun)."""
    for env in environs:
        job = env.get(b"SLURM_JOB_ID", b"").decode("ascii", "replace").strip()
        if job:
            step = env.get(b"SLURM_STEP_ID", b"").decode("ascii", "replace").strip()
            return "slurm %s%s" % (job, "." + step if step else "")
        run = env.get(b"TORCHELASTIC_RUN_ID", b"").decode("ascii", "replace").strip()
        if run and run != "none":
            return "torchelastic %s" % run
    return None


def launch_of(launcher_pid: Optional[int], rank_pids: Iterable[int]) -> Optional[str]:
    """This node's launch: ``PID@TICKS`` of the launcher (torchrun's, where the helper runs in it), else of
    the lowest pid among the ranks (a re-run has new processes); None where none can be read."""
    from probe import _paths

    for pid in ([launcher_pid] if launcher_pid else []) + sorted(rank_pids):
        try:
            return "%d@%d" % (pid, _paths.process_start_ticks(str(pid)))
        except (OSError, ValueError, IndexError):
            continue
    return None
