"""The host helper: one small server per node, in torchrun's launcher process, for the ranks it starts.

Why there: the launcher is every rank's parent, so it sees its ranks come, restart and die (``/proc``),
may read them from outside even where Yama allows ptrace only to ancestors, and shares no rank's GIL:
it answers for a rank whose agent cannot (a C call holds the GIL, the process is stopped or dead). It
lists the node's ranks, and on the master node the ranks of every node (the other nodes' helpers report
to it), so that a client that knows only ``master:PROBE_PORT`` reaches the whole job. It adds nothing
to the ranks: no collective, no registration call, no thread.
"""
