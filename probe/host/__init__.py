"""The host helper: one small server per node and job, for the job's ranks on that node.

Why it exists: a rank whose GIL a C call holds, that is stopped, or that died cannot answer for itself;
a process that shares no rank's GIL can (it reads the rank from outside). It lists the node's ranks, and
on the master node the ranks of every node (the other nodes' helpers report to it), so that a client that
knows only ``master:PROBE_PORT`` reaches the whole job.

Where it runs: under any launcher, a process of its own (``probe.host.node``) that the node's first rank
starts and every rank registers with over its unix socket (``probe.agent.registration``); under
torchrun, threads of torchrun's launcher (``probe.host.helper.start_in_launcher``), which also sees the
ranks among its children. Ranks learn nothing from it and wait for nothing: registering is a daemon
thread's one small request each time the rank's identity changes.
"""
