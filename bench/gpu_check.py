"""The checks of ``bench/gpu_check.sh``, one per run: ``gpu_check.py CHECK DEVICE WORKDIR``; and the table and
record of a whole run: ``gpu_check.py --report RESULTS.tsv DEVICE``.

A check starts its targets (``bench/targets/gpu_job.py``), drives them through the public CLI (``python -m
probe``, this tree's), and prints one line ``RESULT<TAB>status<TAB>detail`` (status ``ok``, ``FAIL``, ``needs a
GPU`` or ``not built yet``). Every target is killed and reaped when the check ends, SIGTERM included (the
shell's timeout sends it); every wait is bounded. The shell gives each check its own ``PROBE_RUNTIME_DIR``.
"""

import json
import os
import select
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
JOB = os.path.join(HERE, "targets", "gpu_job.py")
GPU_ONLY = ("blocked", "profile")
SKIPPED = ("needs a GPU", "not built yet")  # said, not failed
CHECKS = ("trace", "checkpoint", "blocked", "flight_recorder", "profile", "compile", "step_extras")
WHAT = {
    "trace": "training traced (PROBE_TORCH_TRACE=1, then trace start): python.torch_trace memory columns",
    "checkpoint": "probe PID checkpoint of device tensors, torch.load'ed back and compared",
    "blocked": "a rank blocked in a long CUDA kernel: probe list, health, backtrace --native",
    "flight_recorder": "1-rank process group (NCCL; gloo on CPU): torch.flight_recorder entries",
    "profile": "probe PID profile with CUDA activities",
    "compile": "torch.compile with the trace: Dynamo's graph breaks with and without PROBE_TORCH_TRACE=1",
    "step_extras": "PROBE_METRICS_PORT: probe_cuda_memory_* of a training job, and its cuda_memory alert",
}


LOGS = [os.environ.get("TMPDIR") or "/tmp"]
"""Where the targets' stderr goes: the check's own directory once :func:`run_check` names it."""


class Failed(Exception):
    """A check's real failure: what was expected and what came instead."""


def _scale() -> float:
    try:
        return max(0.1, float(os.environ.get("GPU_CHECK_SCALE", "1")))
    except ValueError:
        return 1.0


def env(probe: bool = True, **extra: str) -> Dict[str, str]:
    """This process's environment (the check's PROBE_RUNTIME_DIR kept, no other PROBE* variable), this tree
    first on PYTHONPATH, with ``PROBE=1`` when ``probe``."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("PROBE") or k == "PROBE_RUNTIME_DIR"}
    out["PYTHONPATH"] = REPO + os.pathsep + out.get("PYTHONPATH", "")
    out["PYTHONUNBUFFERED"] = "1"
    if probe:
        out["PROBE"] = "1"
    out.update(extra)
    return out


def cli(*args: str, timeout: float = 60.0) -> Tuple[int, str, str]:
    """``probe ARGS`` (this tree's, ``python -m probe``): exit code, stdout, stderr."""
    try:
        done = subprocess.run([sys.executable, "-m", "probe", *args], capture_output=True, text=True,
                              timeout=timeout * _scale(), env=env(probe=False), cwd=REPO)
    except subprocess.TimeoutExpired:
        raise Failed("probe %s: no answer within %.0f s" % (" ".join(args), timeout * _scale()))
    return done.returncode, done.stdout, done.stderr


def cli_ok(*args: str, timeout: float = 60.0) -> str:
    code, out, err = cli(*args, timeout=timeout)
    if code != 0:
        raise Failed("probe %s exited %d: %s" % (" ".join(args), code, (err or out).strip()[-400:]))
    return out


def query(pid: int, sql: str) -> List[Dict[str, Any]]:
    rows = json.loads(cli_ok(str(pid), "query", sql, "--json"))
    return rows if isinstance(rows, list) else rows.get("rows", [])


def evaluate(pid: int, code: str, timeout: float = 60.0) -> Any:
    """The value of the expression ``code`` in the target, passed as JSON (the eval's value is its repr)."""
    import ast

    out = cli_ok(str(pid), "eval", "import json as _j; _j.dumps(%s)" % code, "--json", timeout=timeout)
    return json.loads(ast.literal_eval(json.loads(out)["value"]))


class Target:
    """``gpu_job.py ARGS`` started with an agent, handshaken by its ``READY <pid>`` line; killed and reaped."""

    def __init__(self, args: Sequence[str], ready_s: float, **extra: str) -> None:
        # stderr to a file: torch may write more warnings than a pipe holds, and a full pipe blocks the target
        self.log = os.path.join(LOGS[0], "target-%d.err" % len(os.listdir(LOGS[0])))
        with open(self.log, "wb") as err:
            self.popen = subprocess.Popen([sys.executable, JOB, *args], env=env(True, **extra), cwd=REPO,
                                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err)
        self.pid = self.popen.pid
        self.args = args
        self.extra = extra
        self.ready_s = ready_s * _scale()
        self._ready = False

    def wait_ready(self) -> None:
        if self._ready:
            return
        deadline = time.monotonic() + self.ready_s
        pending = b""
        assert self.popen.stdout is not None
        while b"\n" not in pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Failed("gpu_job.py %s: not ready within %.0f s" % (" ".join(self.args), self.ready_s))
            ready, _, _ = select.select([self.popen.stdout], [], [], left)
            if ready:
                chunk = os.read(self.popen.stdout.fileno(), 4096)
                if not chunk:
                    self.popen.wait(10)
                    with open(self.log, "rb") as handle:
                        err = handle.read().decode("utf-8", "replace")
                    raise Failed("gpu_job.py %s exited %s: %s" % (" ".join(self.args), self.popen.returncode,
                                                                  err.strip()[-600:]))
                pending += chunk
        if pending.split()[:2] != [b"READY", str(self.pid).encode()]:
            raise Failed("gpu_job.py %s said %r" % (" ".join(self.args), pending[:200]))
        self._ready = True
        # the blocked rank's agent may answer, or probe say from outside that the GIL is held (exit 5)
        answers = [int(code) for code in self.extra.get("GPU_CHECK_HEALTH", "0").split(",")]
        wait_until(lambda: cli(str(self.pid), "health", timeout=30)[0] in answers, 30,
                   "the agent of %d answers" % self.pid)

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass
        if self.popen.stdout is not None:
            self.popen.stdout.close()


@contextmanager
def targets(*specs: Tuple[Sequence[str], float, Dict[str, str]]) -> Iterator[List[Target]]:
    """Start every target at once (their torch imports overlap), wait for each; always kill and reap them."""
    started: List[Target] = []
    try:
        for args, ready_s, extra in specs:
            started.append(Target(args, ready_s, **extra))
        for target in started:
            target.wait_ready()
        yield started
    finally:
        for target in started:
            target.close()


def wait_until(condition: Callable[[], Any], seconds: float, what: str) -> Any:
    """Poll ``condition`` (bounded: ``seconds``, scaled) until it gives a true value; that value."""
    deadline = time.monotonic() + seconds * _scale()
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise Failed("waited %.0f s for %s" % (seconds * _scale(), what))
        time.sleep(0.2)


# -- the checks: each returns its detail, or raises Failed ------------------------------------------------


TRACE_SQL = ("SELECT device, count(*) AS spans, max(allocated) AS allocated, max(max_allocated) AS max_allocated, "
             "max(cached) AS cached FROM python.torch_trace GROUP BY device")


def _trace_memory(pid: int, device: str, when: str) -> str:
    """The memory columns of the trace's spans (20 at least) are the device's: the allocator's on CUDA."""
    rows = wait_until(lambda: [r for r in query(pid, TRACE_SQL) if r["spans"] >= 20], 60, "20 traced spans")
    if len(rows) != 1:
        raise Failed("%s: spans from more than one device: %s" % (when, rows))
    row = rows[0]
    if device == "cuda":
        peak_mb = evaluate(pid, "torch.cuda.max_memory_allocated() / 1048576.0")
        if row["device"] != "cuda:0" or not row["allocated"] or row["cached"] is None:
            raise Failed("%s: memory columns not the allocator's of cuda:0 but %s" % (when, row))
        if not 0 < row["max_allocated"] <= peak_mb + 1e-6:
            raise Failed("%s: max_allocated %.3f MB vs the allocator's peak %.3f MB" % (when, row["max_allocated"],
                                                                                        peak_mb))
        return "%s: %d spans, cuda:0 allocated %.2f MB, max %.2f MB (allocator peak %.2f), cached %.1f MB" % (
            when, row["spans"], row["allocated"], row["max_allocated"], peak_mb, row["cached"])
    if row["device"] != "cpu" or not row["allocated"] or row["max_allocated"] < row["allocated"] \
            or row["cached"] is not None:
        raise Failed("%s: expected RSS readings on cpu: %s" % (when, row))
    return "%s: %d spans, cpu RSS %.0f MB, max %.0f MB, cached NULL" % (
        when, row["spans"], row["allocated"], row["max_allocated"])


def check_trace(device: str, work: str) -> str:
    """The trace armed by PROBE_TORCH_TRACE=1 (it starts as torch is imported, before the job touches CUDA),
    then started again with ``probe PID trace start`` on the running job: both read the device's memory."""
    with targets((["train", device], 40, {"PROBE_TORCH_TRACE": "1"})) as (job,):
        said, failed = [], False
        for when in ("PROBE_TORCH_TRACE=1", "trace start"):
            if when == "trace start":
                cli_ok(str(job.pid), "trace", "start")
            try:
                said.append(_trace_memory(job.pid, device, when))
            except Failed as exc:  # the other way is still worth reading
                said.append(str(exc))
                failed = True
    if failed:
        raise Failed("; ".join(said))
    return "; ".join(said)


def check_checkpoint(device: str, work: str) -> str:
    path = os.path.join(work, "ck.pt")
    with targets((["train", device, "5"], 40, {})) as (job,):
        saved = json.loads(cli_ok(str(job.pid), "checkpoint", path, "--json", timeout=120))
        if not os.path.exists(path) or saved.get("path") != path:
            raise Failed("no checkpoint at %s: %s" % (path, saved))
        compare = ("(lambda ck: [[k, str(v.device), bool(torch.equal(v, model.state_dict()[k]))] "
                   "for k, v in ck['models']['model'].items()] + "
                   "[['momentum%%d' %% i, str(s['momentum_buffer'].device), "
                   "bool(torch.equal(s['momentum_buffer'], optimizer.state_dict()['state'][i]['momentum_buffer']))] "
                   "for i, s in ck['optimizers']['optimizer']['state'].items()])(torch.load(%r))" % path)
        tensors = evaluate(job.pid, compare)
    want = "cuda:0" if device == "cuda" else "cpu"
    wrong = [t for t in tensors if t[1] != want or not t[2]]
    if len(tensors) < 12 or wrong:
        raise Failed("%d tensors loaded back; differing or not on %s: %s" % (len(tensors), want, wrong[:4]))
    return "%d tensors (6 weights, 6 momentum buffers) on %s, equal after torch.load; %d bytes" % (
        len(tensors), want, saved.get("bytes", 0))


def check_blocked(device: str, work: str) -> str:
    with targets((["blocked", device, "120"], 45, {"GPU_CHECK_HEALTH": "0,5"})) as (job,):
        code, out, err = cli("list", "--json", timeout=60)
        listed = [row for row in json.loads(out or "[]") if row.get("pid") == job.pid] if code == 0 else []
        if not listed:
            raise Failed("probe list (exit %d) does not show %d: %s" % (code, job.pid, (err or out)[-300:]))
        code, out, err = cli(str(job.pid), "health", timeout=60)
        health = " ".join((out or err).split())
        if code not in (0, 5):  # 5: the agent cannot answer (GIL held), said from outside: a state too
            raise Failed("probe %d health exited %d: %s" % (job.pid, code, health[-300:]))
        out = cli_ok(str(job.pid), "backtrace", "--native", timeout=120)
    blocks: List[List[str]] = []
    for line in out.splitlines():
        if line.startswith("Thread "):
            blocks.append([])
        if blocks and line.strip():
            blocks[-1].append(line.strip())
    main = next((block for block in blocks if block[0].endswith("main)")), [])
    lines = main[1:]
    python_frame = [line for line in lines if line.startswith("synchronize (" if device == "cuda" else "blocked (")]
    native = [line for line in lines if line.startswith("[C]") and (device != "cuda" or "cuda" in line.lower())]
    if not python_frame or not native:
        raise Failed("backtrace --native of the main thread lacks a %s frame: %s"
                     % ("torch.cuda.synchronize or CUDA native" if device == "cuda" else "python or native",
                        " | ".join(lines[:12])[:600]))
    return "probe list: agent %s, %s; health exit %d (%s); main thread in %s over %s" % (
        listed[0].get("agent"), listed[0].get("state"), code, health[:60], python_frame[0].split(" (")[0],
        " | ".join(line.split(" (")[0] for line in native[:4]))


def check_flight_recorder(device: str, work: str) -> str:
    backend = "nccl" if device == "cuda" else "gloo"
    store = os.path.join(work, "store")
    with targets((["fr", device, store, "6"], 40, {"TORCH_FR_BUFFER_SIZE": "64"})) as (job,):
        sql = "SELECT op, state, retired, collective_seq_id FROM torch.flight_recorder ORDER BY record_id"

        def recorded() -> List[Dict[str, Any]]:
            rows = [r for r in query(job.pid, sql) if r["op"] == backend + ":all_reduce"]
            return rows if len(rows) >= 6 and all(r["state"] == "completed" for r in rows) else []

        rows = wait_until(recorded, 30, "6 completed %s:all_reduce entries in torch.flight_recorder" % backend)
    states = sorted({r["state"] for r in rows})
    return "%d %s:all_reduce entries, seq %s..%s, states %s" % (
        len(rows), backend, rows[0]["collective_seq_id"], rows[-1]["collective_seq_id"], "/".join(states))


def profile_built() -> bool:
    """Whether this tree's CLI has a ``profile`` command (an unknown command's --help prints the group's)."""
    code, out, _ = cli("profile", "--help", timeout=60)
    return code == 0 and "profile" in (out.strip().splitlines() or [""])[0]


def check_profile(device: str, work: str) -> str:
    """``probe PID profile`` on a CUDA training job: its output names CUDA work. Written before the command
    existed: the options are taken from its --help (``--activities``, a duration, ``--json``)."""
    helps = cli_ok("profile", "--help")
    args = ["--json"] if "--json" in helps else []
    if "--activities" in helps:
        args += ["--activities", "cuda"]
    for option in ("--seconds", "--duration"):
        if option in helps:
            args += [option, "2"]
            break
    with targets((["train", device], 40, {})) as (job,):
        out = cli_ok(str(job.pid), "profile", *args, timeout=120)
    if not any(word in out.lower() for word in ("cuda", "kernel", "gemm")):
        raise Failed("probe PID profile %s named no CUDA work: %s" % (" ".join(args), " ".join(out.split())[:300]))
    return "probe PID profile %s: %d bytes naming CUDA work" % (" ".join(args), len(out))


def check_compile(device: str, work: str) -> str:
    # Dynamo decides the graph breaks whatever the backend; inductor's code generation for a CPU takes minutes
    # on a small box, so there aot_eager (Dynamo and AOT autograd, eager kernels) stands in unless asked.
    backend = os.environ.get("GPU_CHECK_COMPILE_BACKEND") or ("inductor" if device == "cuda" else "aot_eager")
    with targets((["compiled", device, backend], 150, {}),
                 (["compiled", device, backend], 150, {"PROBE_TORCH_TRACE": "1"})) as (plain, traced):
        counts = {}
        for name, job in (("without", plain), ("with", traced)):
            counts[name] = evaluate(job.pid, "__import__('__main__').dynamo_counts()", timeout=60)
        spans = query(traced.pid, "SELECT count(*) AS n FROM python.torch_trace")[0]["n"]
        after = evaluate(traced.pid, "__import__('__main__').dynamo_counts()", timeout=60)
    without, with_trace = counts["without"], counts["with"]
    keys = ("graph_breaks", "graphs", "forward_versions")
    if any(without[k] != with_trace[k] for k in keys) or any(after[k] != with_trace[k] for k in keys):
        raise Failed("Dynamo without the trace %s, with it %s, later %s" % (without, with_trace, after))
    if not spans:
        raise Failed("the trace recorded no span of the compiled model")
    return "%s on %s: graph breaks %d with and without the trace, graphs %d, forward compiled %d time(s); %d spans" % (
        backend, device, with_trace["graph_breaks"], with_trace["graphs"], with_trace["forward_versions"], spans)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def check_step_extras(device: str, work: str) -> str:
    """A training job alone under PROBE_PORT with PROBE_METRICS_PORT: its node helper serves the step extras
    (CUDA memory on a GPU; none on the CPU), and with PROBE_ALERT_CUDA_FRACTION set near 0 the helper's
    cuda_memory alert reaches a webhook served here."""
    import threading
    import urllib.request
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    posts: List[Dict[str, Any]] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 -- http.server's name
            posts.append(json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0))))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    metrics = _free_port()
    extra = {"PROBE_PORT": "127.0.0.1:%d" % _free_port(), "PROBE_METRICS_PORT": str(metrics),
             "PROBE_ALERT_WEBHOOK": "http://127.0.0.1:%d/hook" % server.server_address[1],
             "PROBE_ALERT_CUDA_FRACTION": "0.000001", "PROBE_ALERT_CUDA_EVERY_S": "1",
             "PROBE_HELPER_LINGER_S": "0"}  # the job's node helper leaves with its rank: the check leaves nothing

    def served() -> Dict[str, float]:
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % metrics, timeout=10) as answer:
                text = answer.read().decode("utf-8")
        except OSError:
            return {}
        found = {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith("probe_") and "{" in line}
        return found if "probe_lr" in found and (device != "cuda" or "probe_cuda_memory_reserved_bytes" in found) else {}

    try:
        with targets((["train", device], 20, extra)):
            found = wait_until(served, 15, "probe_lr (and on a GPU probe_cuda_memory_*) at /metrics")
            if device == "cuda":
                wait_until(lambda: [p for p in posts if p.get("rule") == "cuda_memory"], 10, "the cuda_memory alert")
    finally:
        server.shutdown()
        server.server_close()
    cuda = {k: v for k, v in found.items() if k.startswith("probe_cuda_")}
    if device != "cuda":
        if cuda or posts:
            raise Failed("from a job on the CPU: CUDA series %s, alerts %s" % (cuda, posts))
        return "probe_lr %g; no probe_cuda_* series (no CUDA), no alert" % found["probe_lr"]
    allocated, reserved = cuda["probe_cuda_memory_allocated_bytes"], cuda["probe_cuda_memory_reserved_bytes"]
    total = cuda["probe_cuda_memory_total_bytes"]
    if not 0 < allocated <= reserved < total:
        raise Failed("allocated %d, reserved %d, total %d" % (allocated, reserved, total))
    alert = [p for p in posts if p.get("rule") == "cuda_memory"][0]
    return "allocated %.1f MiB, reserved %.1f MiB of %.1f GiB; lr %g; alert: %s" % (
        allocated / 2 ** 20, reserved / 2 ** 20, total / 2 ** 30, found["probe_lr"], alert.get("summary", "")[:120])


def run_check(name: str, device: str, work: str) -> Tuple[str, str]:
    LOGS[0] = work
    if name == "profile":
        built = profile_built()
        if device != "cuda":
            return "needs a GPU", "probe profile: %s" % ("present" if built else "not built yet")
        if not built:
            return "not built yet", "probe profile --help shows no profile command in this tree"
    elif name in GPU_ONLY and device != "cuda":
        return "needs a GPU", "no CUDA device here"
    try:
        return "ok", CHECK_FUNCTIONS[name](device, work)
    except Failed as exc:
        return "FAIL", str(exc)


CHECK_FUNCTIONS: Dict[str, Callable[[str, str], str]] = {
    "trace": check_trace, "checkpoint": check_checkpoint, "blocked": check_blocked,
    "flight_recorder": check_flight_recorder, "profile": check_profile, "compile": check_compile,
    "step_extras": check_step_extras,
}


def report(results: str, device: str, started: float) -> int:
    """Print the run's table and write its record (bench/_common.py's); 1 when a check failed or is missing."""
    sys.path.insert(0, HERE)
    import _common
    from _common import figure, header, table

    header("GPU check (bench/gpu_check.sh): probe on a machine with one NVIDIA GPU",
           ["device: %s%s" % (device, "" if device == "cuda" else " (no CUDA device: the GPU-only checks say so)")]
           + ["  %-16s %s" % (name, WHAT[name]) for name in CHECKS])
    run = _common.RUN
    assert run is not None
    run.started, run.argv = started, ["device=%s" % device]  # the whole run's, not this report's
    rows: List[List[str]] = []
    with open(results, encoding="utf-8") as handle:
        for line in handle:
            name, status, seconds, detail = (line.rstrip("\n").split("\t") + ["", "", ""])[:4]
            rows.append([name, status, seconds, detail])
            run.rows.append({"what": name, "result": status, "seconds": float(seconds or 0), "detail": detail})
    print(table(rows, ["check", "result", "seconds", "detail"]))
    for name, status, seconds, _ in rows:
        if status not in SKIPPED:
            figure("check %s (%s)" % (name, device), value=float(seconds or 0), unit="s", goal="ok", met=status == "ok")
    failed = [row[0] for row in rows if row[1] not in ("ok",) + SKIPPED]
    missing = [name for name in CHECKS if name not in [row[0] for row in rows]]
    print("SUMMARY gpu_check device=%s: %d ok, %d need a GPU, %d not built yet, %d failed%s%s" % (
        device, sum(r[1] == "ok" for r in rows), sum(r[1] == "needs a GPU" for r in rows),
        sum(r[1] == "not built yet" for r in rows), len(failed), (": " + ", ".join(failed)) if failed else "",
        "; no result from " + ", ".join(missing) if missing else ""))
    return 1 if failed or missing else 0


def main(argv: List[str]) -> int:
    if argv[:1] == ["--report"]:
        return report(argv[1], argv[2], float(argv[3]))
    name, device, work = argv

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # the targets' finally blocks kill and reap them

    signal.signal(signal.SIGTERM, on_term)
    status, detail = run_check(name, device, work)
    print("RESULT\t%s\t%s" % (status, " ".join(detail.split())), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
