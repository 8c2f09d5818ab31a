"""The SQL worker: a process of its own that runs the locked-down engine under a hard memory ceiling.

DuckDB's ``memory_limit`` leaves out the values its functions build, and one call builds its whole value
before anything can interrupt it: ``replace(repeat('a', 40000), 'a', repeat('b', 40000))`` makes 1.6 GB
in one call (a target went to 3.6 GB and was OOM-killed in a 2 GB cgroup). No list of such functions is
ever complete, and nothing inside one process can bound an allocation of its own threads without
bounding every other thread's too. So the engine runs here, in a process whose address space the kernel
limits (``RLIMIT_AS``: its size once DuckDB is ready, plus the budget): an allocation past it fails where
it is made, DuckDB turns the failure into its out-of-memory error, and at worst this process dies, never
the target or the client that started it (``probe.engine.isolated``).

The channel is the process's stdin and stdout, moved off fds 0 and 1 so that nothing printed can mix
with it; each message is a 4-byte length, a JSON header, and ``size`` bytes of payload (Arrow IPC).
Parent -> worker: ``{"op": "query", ...}`` with the tables it has already, or ``{"table": name}`` with
one the worker asked for (``{"need": name}``) while its query runs. Worker -> parent: ``{"ready"}``
once, ``{"need"}``, and one answer per query: ``{"ok": true, truncated, elapsed_ms}`` with the result,
or ``{"ok": false, code, message, hint}``. When the parent goes, stdin ends and so does the worker.
"""

import json
import os
import signal
import struct
import sys
from typing import Any, Dict, Optional, Tuple

__all__ = ["main", "receive", "send", "ipc_bytes", "from_ipc"]

_HEADER = struct.Struct(">I")
_OUT_OF_MEMORY = "the query needed more memory"  # how the engine's words, and the worker's, begin
MAX_HEADER = 1 << 20


def send(fd: int, header: Dict[str, Any], payload: bytes = b"") -> None:
    """One message, written whole (blocking: the worker's side, where nothing else waits)."""
    head = json.dumps(dict(header, size=len(payload))).encode("utf-8")
    data = memoryview(_HEADER.pack(len(head)) + head + payload)
    while data:
        data = data[os.write(fd, data):]


def _read_exact(fd: int, size: int) -> Optional[bytes]:
    parts, got = [], 0
    while got < size:
        chunk = os.read(fd, min(size - got, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def receive(fd: int) -> Optional[Tuple[Dict[str, Any], bytes]]:
    """The next message, or None once the other side has gone."""
    raw = _read_exact(fd, _HEADER.size)
    if raw is None:
        return None
    (length,) = _HEADER.unpack(raw)
    if length > MAX_HEADER:
        return None
    head = _read_exact(fd, length)
    if head is None:
        return None
    header = json.loads(head.decode("utf-8"))
    payload = _read_exact(fd, int(header.get("size") or 0)) if header.get("size") else b""
    if payload is None:
        return None
    return header, payload


def ipc_bytes(table: Any) -> bytes:
    """An Arrow table as one IPC stream."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def from_ipc(payload: bytes) -> Any:
    import pyarrow as pa

    return pa.ipc.open_stream(pa.py_buffer(payload)).read_all()


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmSize")


class _Worker:
    def __init__(self, inp: int, out: int, config: Dict[str, Any]) -> None:
        self.inp, self.out, self.config = inp, out, config
        self.given: Dict[str, Any] = {}  # the tables that came with the query in progress
        self.engine = self._new_engine()

    def _new_engine(self) -> Any:
        from probe.engine.sandbox import Engine

        c = self.config
        return Engine(self._source, max_rows=c["max_rows"], timeout=c["timeout"], memory_limit=c["memory_limit"],
                      max_result_bytes=c["max_result_bytes"], memory_budget=c.get("guard_budget"))

    def _source(self, name: str) -> Any:
        if name in self.given:
            return self.given[name]
        send(self.out, {"need": name})
        message = receive(self.inp)
        if message is None:
            os._exit(0)  # the parent has gone
        header, payload = message
        if header.get("table") != name or header.get("missing"):
            return None
        return from_ipc(payload)

    def serve(self) -> None:
        while True:
            message = receive(self.inp)
            if message is None:
                return
            header, payload = message
            if header.get("op") == "query":
                self._answer(header, payload)

    def _answer(self, header: Dict[str, Any], payload: bytes) -> None:
        from probe.errors import InternalError, ProbeError, TooLarge

        try:
            self.given = {}
            offset = 0
            for name, size in header.get("tables") or []:
                self.given[name] = from_ipc(payload[offset:offset + size])
                offset += size
            del payload
            if self.given and not self.engine.adopt(self.given):
                self.engine.close()  # views of other columns: a fresh database (~25 ms)
                self.engine = self._new_engine()
                self.engine.adopt(self.given)
            result = self.engine.query(header["sql"], max_rows=header.get("max_rows"),
                                       timeout=header.get("timeout"), max_bytes=header.get("max_bytes"))
            body = ipc_bytes(result.table)
            answer: Dict[str, Any] = {"ok": True, "truncated": result.truncated, "elapsed_ms": result.elapsed_ms}
            result = None
        except ProbeError as exc:
            if isinstance(exc, TooLarge) and exc.message.startswith(_OUT_OF_MEMORY):  # the guard, or DuckDB's limit
                exc = TooLarge(self._too_much(), hint=exc.hint)
            answer, body = dict(exc.to_envelope()["error"], ok=False), b""  # type: ignore[arg-type]
        except MemoryError:
            answer, body = dict(TooLarge(self._too_much()).to_envelope()["error"], ok=False), b""  # type: ignore
        except Exception as exc:
            answer, body = dict(InternalError("the SQL worker failed: %s" % exc).to_envelope()["error"],
                                ok=False), b""  # type: ignore[arg-type]
        finally:
            self.given = {}
        send(self.out, answer, body)

    def _too_much(self) -> str:
        return ("the query needed more memory than SQL may take (DuckDB's limit %s; its worker process may grow "
                "at most %.0f MB); it was stopped" % (self.config["memory_limit"], self.config["max_memory"] / 1e6))


def _ignore_interrupts() -> None:
    """The parent's Ctrl-C, or its process group's, is not ours to take (the parent stops a query)."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except (ValueError, OSError):
        pass


def main(config_json: str) -> None:
    """Run as ``python -c`` by ``probe.engine.isolated`` (with the parent's ``sys.path``)."""
    config = json.loads(config_json)
    inp, out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    _ignore_interrupts()
    try:
        import resource

        worker = _Worker(inp, out, config)
        worker.engine.query("SELECT 42 AS warm")  # its threads and first allocations: part of the baseline
        ceiling = _vm_size() + int(config["max_memory"])
        resource.setrlimit(resource.RLIMIT_AS, (ceiling, ceiling))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a worker that dies leaves no core of its gigabyte
    except Exception as exc:
        send(out, {"ready": False, "message": "%s: %s" % (type(exc).__name__, exc)})
        return
    send(out, {"ready": True, "pid": os.getpid(), "ceiling": ceiling})
    worker.serve()


if __name__ == "__main__":
    main(sys.argv[1])
