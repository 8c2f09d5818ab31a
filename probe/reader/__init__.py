"""The reader: a process's stacks read from outside it, when its agent cannot answer (a C call holds
the GIL, the process is stopped), for native frames, and after death (a crash record, a core file).

It runs in the client's process, never in the target, and gives the rows of ``python.backtrace``, so
every output format and SQL work on what it reads. ``python -m probe.reader`` runs it alone (JSON out),
so it can run on a rank's own host. Modules: ``stacks`` (the data), ``live`` (a live process: py-spy,
else pystack), ``pystack_source`` (core files), ``crash`` (records left by agents of dead processes),
``proc`` (what /proc tells).

Nothing is imported here: ``probe.reader.proc`` is on the path of every local request and must stay light.
"""
