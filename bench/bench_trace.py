"""The torch trace's cost on a training step, the hook's worst case, and the agent with a full buffer.

    python bench/bench_trace.py [--rounds 15] [--steps 8] [--quick] [--only SECTION] [--before DIR]

1. Overhead (in this process, CPU, one intra-op thread so the 2 shared cores stay comparable): a
   training step (forward, loss, backward, SGD step) of an MLP (8 x Linear(1024), batch 64) and of a
   small transformer (6 encoder layers, d_model 256, 4 heads, batch 16 x 32 tokens), untraced and under
   each trace setting, interleaved in rounds (the order alternating), ``--steps`` steps per block, each
   step timed; a block's typical step is its median step (under ``--every N``, 2N steps: (the median
   sampled step + (N - 1) x the median skipped step) / N), and the overhead is the median over rounds of
   (traced block / the untraced blocks on either side of it) - 1, with its IQR. DESIGN: <= 2 % every step, <= 0.5 % with
   ``--every 10``.
2. Worst case per hook call: 200 x Linear(16, 16), forward only (no_grad), batch 4: (traced - untraced)
   / 201 module calls; also torch's own cost of having any global hook (two empty ones).
3. The agent (a real target, ``tests/targets/train_trace.py`` with ``PROBE_TORCH_TRACE=1`` and backward
   spans): VmRSS before the trace starts and once the default buffer (10000 spans) is full; then the
   slow-module query of DESIGN.md, ``elapsed_ms`` as served inside the agent (DESIGN-like target 20 ms).

``--before DIR`` (a tree of an earlier commit: ``git archive REV | tar -x -C DIR``) measures that tree
beside this one: section 2 alternates child processes of each tree, section 3 runs a target of each
and alternates the queries between them.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List

from _common import REPO, Summary, clean_env, header, table, verdict

SLOW_SQL = ("SELECT module, stage, COUNT(*) AS count, AVG(duration) AS avg_time, SUM(duration) AS total_time "
            "FROM python.torch_trace WHERE step > (SELECT MAX(step) - 5 FROM python.torch_trace) "
            "GROUP BY module, stage ORDER BY total_time DESC LIMIT 10")


def models(torch: Any) -> Dict[str, Callable[[], Callable[[], None]]]:
    nn = torch.nn

    def mlp() -> Callable[[], None]:
        layers: List[Any] = []
        for _ in range(8):
            layers += [nn.Linear(1024, 1024), nn.ReLU()]
        model = nn.Sequential(*layers)
        return _trainer(torch, model, torch.randn(64, 1024), torch.randn(64, 1024), nn.MSELoss())

    def transformer() -> Callable[[], None]:
        layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.1, batch_first=True)
        model = nn.Sequential(nn.TransformerEncoder(layer, 6, enable_nested_tensor=False), nn.Linear(256, 256))
        return _trainer(torch, model, torch.randn(16, 32, 256), torch.randn(16, 32, 256), nn.MSELoss())

    return {"MLP 8 x Linear(1024), batch 64": mlp, "transformer 6 x d256, 16 x 32 tokens": transformer}


def _trainer(torch: Any, model: Any, x: Any, y: Any, loss_fn: Any) -> Callable[[], None]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return step


def block(step: Callable[[], None], steps: int) -> float:
    """Mean seconds per step over ``steps`` steps (a mean, so a sampled step among skipped ones counts)."""
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def step_times(step: Callable[[], None], steps: int) -> List[float]:
    """Each step's seconds: their median shrugs off the bursts of a shared machine that a block mean takes in."""
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        out.append(time.perf_counter() - start)
    return out


def sampled_step_times(step: Callable[[], None], steps: int, tracer: Any) -> "tuple[List[float], List[float]]":
    """Under ``--every N``: the seconds of the steps the trace sampled, and of those it skipped."""
    sampled: List[float] = []
    skipped: List[float] = []
    for _ in range(steps):
        into = sampled if tracer.sampled else skipped
        start = time.perf_counter()
        step()
        into.append(time.perf_counter() - start)
    return sampled, skipped


def overhead(torch: Any, rounds: int, steps: int) -> List[List[str]]:
    from probe.tables.torch import trace
    from probe.tables.torch.trace_options import TraceOptions

    settings = {
        "forward, every step": TraceOptions(),
        "forward, --every 10": TraceOptions(every=10),
        "forward + backward": TraceOptions(backward=True),
        "forward + anomalies": TraceOptions(anomalies=True),
    }
    out = []
    for label, make in models(torch).items():
        step = make()
        for _ in range(3):
            step()
        ratios: Dict[str, List[float]] = {name: [] for name in settings}
        base_times: List[float] = []
        for r in range(rounds):
            names = list(settings) if r % 2 == 0 else list(settings)[::-1]
            base = [step_times(step, steps)]
            for name in names:
                every = settings[name].every
                trace.start(settings[name])
                step()  # the first step after start names the modules
                if every > 1:  # one step in `every` pays the hooks; the others only what switching them costs
                    sampled, skipped = sampled_step_times(step, 2 * every, trace._tracer)
                    took = (statistics.median(sampled) + (every - 1) * statistics.median(skipped)) / every
                else:
                    took = statistics.median(step_times(step, steps))
                trace.stop()
                step()  # the optimizer's hooks leave at this forward
                base.append(step_times(step, steps))
                untraced = (statistics.median(base[-2]) + statistics.median(base[-1])) / 2
                ratios[name].append(took / untraced - 1.0)
            base_times.extend(statistics.median(times) for times in base)
        out.append([label, "untraced", "%.2f ms" % (statistics.median(base_times) * 1000), "-", "-"])
        for name, values in ratios.items():
            s = Summary.of(values)
            out.append([label, name, "", "%+.2f %%" % (s.median * 100), "%+.2f..%+.2f %%" % (s.q1 * 100, s.q3 * 100)])
    return out


def worst_case(torch: Any, rounds: int) -> List[List[str]]:
    from probe.tables.torch import trace
    from probe.tables.torch.trace_options import TraceOptions

    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(200)])
    x = torch.randn(4, 16)
    hooks = sys.modules["torch.nn.modules.module"]

    def forward() -> None:
        with torch.no_grad():
            model(x)

    def empty_hooks() -> float:
        a = hooks.register_module_forward_pre_hook(lambda m, i: None)
        b = hooks.register_module_forward_hook(lambda m, i, o: None)
        try:
            return block(forward, 20)
        finally:
            a.remove()
            b.remove()

    def traced(options: Any) -> Callable[[], float]:
        def run() -> float:
            trace.start(options)
            try:
                return block(forward, 20)
            finally:
                trace.stop()
                forward()
        return run

    runners = {"untraced": lambda: block(forward, 20), "two empty global hooks": empty_hooks,
               "traced (forward)": traced(TraceOptions()), "traced + anomalies": traced(TraceOptions(anomalies=True)),
               "traced, module filtered out": traced(TraceOptions(modules="nothing*"))}
    results: Dict[str, List[float]] = {name: [] for name in runners}
    for r in range(rounds):
        for name in (list(runners) if r % 2 == 0 else list(runners)[::-1]):
            results[name].append(runners[name]())
    base = statistics.median(results["untraced"])
    rows = []
    for name, values in results.items():
        s = Summary.of(values)
        per_call = (s.median - base) / 201 * 1e6
        rows.append([name, "%.2f ms" % (s.median * 1000), "-" if name == "untraced" else "%.2f us" % per_call])
    return rows


def _trace_target(repo: str) -> Any:
    """``tests/targets/train_trace.py`` of the tree at ``repo``, run with that tree's probe, tracing from the
    start with backward spans; returns (process, client) once its agent answers."""
    import probe

    env = clean_env(probe=True)
    env.update({"PROBE_TORCH_TRACE": "1", "PROBE_TORCH_TRACE_BACKWARD": "1", "PYTHONPATH": repo})
    script = os.path.join(repo, "tests", "targets", "train_trace.py")
    popen = subprocess.Popen([sys.executable, script, "normal"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    try:
        line = popen.stdout.readline() if popen.stdout else ""
        if not line.startswith("READY"):
            raise RuntimeError("target did not get ready: %r" % line)
        client = probe.connect(str(popen.pid))
        deadline = time.monotonic() + 30
        while True:
            try:
                client.health()
                break
            except probe.errors.ProbeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    except BaseException:
        popen.kill()
        popen.wait(10)
        raise
    return popen, client


def _wait_full(client: Any) -> Dict[str, Any]:
    deadline = time.monotonic() + 180
    while True:
        status = client.trace_status()
        if status["rows"] >= status["size"]:
            return status
        if time.monotonic() > deadline:
            raise RuntimeError("buffer not full after 180 s: %r" % status)
        time.sleep(0.5)


def _served_ms(client: Any) -> float:
    from probe.client import transport

    body = json.dumps({"sql": SLOW_SQL}).encode()
    answer = transport.request(client.target.address, "POST", "/v1/query", body, {})
    return float(json.loads(answer.body)["elapsed_ms"])


def agent_figures(runs: int, before: str = "") -> List[List[str]]:
    """Section 3. With ``before`` (a tree of an earlier commit), a second target runs that tree's probe
    beside this one, both buffers full, and the queries alternate between the two (A B B A ...), the
    target not queried stopped (SIGSTOP) meanwhile."""
    sys.path.insert(0, REPO)
    trees = [("this tree", REPO)] + ([("before (%s)" % os.path.basename(before.rstrip("/")), before)]
                                     if before else [])
    started: List[Any] = []
    try:
        for _, repo in trees:
            started.append(_trace_target(repo))
        popen, client = started[0]
        start_rss = _rss_mb(popen.pid)
        statuses = [_wait_full(c) for _, c in started]
        status = statuses[0]
        full_rss = _rss_mb(popen.pid)
        for _, c in started:
            c.query_rows("SELECT 1")  # DuckDB and pyarrow in the agent
            _served_ms(c)
        inside: List[List[float]] = [[] for _ in started]
        for r in range(runs):
            order = list(range(len(started))) if r % 2 == 0 else list(range(len(started)))[::-1]
            for i in order:
                # Only the target queried trains meanwhile (the other is stopped): the machine is as busy
                # as with one target, as without --before.
                for j, (other, _) in enumerate(started):
                    os.kill(other.pid, signal.SIGCONT if j == i else signal.SIGSTOP)
                time.sleep(0.3)
                inside[i].append(_served_ms(started[i][1]))
        for other, _ in started:
            os.kill(other.pid, signal.SIGCONT)
        query_rss = _rss_mb(popen.pid)
        ring_mb = status["size"] * (8 * 8 + 7 * 8 + 8) / 1e6
        rows = [
            ["spans held / buffer size", "%d / %d" % (status["rows"], status["size"]), ""],
            ["ring arrays (preallocated at start)", "%.2f MB" % ring_mb, ""],
            ["target VmRSS, trace started -> buffer full", "%.1f -> %.1f MB" % (start_rss, full_rss),
             "+%.1f MB (includes the training's own growth)" % (full_rss - start_rss)],
            ["target VmRSS after the queries (DuckDB + pyarrow loaded)", "%.1f MB" % query_rss, ""],
        ]
        for (label, _), values in zip(trees, inside):
            s = Summary.of(values)
            rows.append(["slow-module query on the full buffer, served in the agent, %s (n=%d)" % (label, s.n),
                         "median %.2f ms, IQR %.2f-%.2f, min-max %.2f-%.2f" % (s.median, s.q1, s.q3, s.low, s.high),
                         "<= 20 ms: %s" % verdict(s.median <= 20.0)])
        if before:
            ratios = Summary.of([a / b for a, b in zip(inside[0], inside[1])])
            rows.append(["this tree / before, per pair", "median %.2fx, IQR %.2f-%.2fx" % (ratios.median, ratios.q1,
                                                                                           ratios.q3), ""])
        rows.append(["trace status overhead estimate (time inside hooks)", "%.3f %%" % status["overhead_percent"],
                     "%s us per step" % status["hook_us_per_step"]])
        return rows
    finally:
        for popen, _ in started:
            popen.kill()
            popen.wait(10)


def worst_case_in(repo: str, rounds: int) -> List[List[str]]:
    """Section 2 run by the tree at ``repo`` (its own bench and probe), in a child process."""
    code = ("import json, sys; sys.path[:0] = [%r, %r]; import torch, bench_trace; torch.set_num_threads(1); "
            "print(json.dumps(bench_trace.worst_case(torch, %d)))" % (os.path.join(repo, "bench"), repo, rounds))
    done = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True,
                          timeout=600, cwd=repo)
    if done.returncode != 0:
        raise RuntimeError("worst case in %s failed: %s" % (repo, done.stderr[-2000:]))
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare_worst_case(before: str, rounds: int, runs: int) -> List[List[str]]:
    """Per-hook cost, this tree against ``before``: ``runs`` child runs each, alternating."""
    per_call: Dict[str, Dict[str, List[float]]] = {"this tree": {}, "before": {}}
    for r in range(runs):
        order = [("this tree", REPO), ("before", before)]
        for label, repo in (order if r % 2 == 0 else order[::-1]):
            for name, _, cost in worst_case_in(repo, rounds):
                if cost != "-":
                    per_call[label].setdefault(name, []).append(float(cost.split()[0]))
    rows = []
    for name in per_call["this tree"]:
        a, b = Summary.of(per_call["this tree"][name]), Summary.of(per_call["before"][name])
        rows.append([name, "%.2f us [%.2f-%.2f]" % (a.median, a.q1, a.q3), "%.2f us [%.2f-%.2f]" % (b.median, b.q1, b.q3)])
    return rows


def _rss_mb(pid: int) -> float:
    with open("/proc/%d/status" % pid) as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="5 rounds of 4 steps")
    parser.add_argument("--only", choices=("overhead", "worst", "agent"), help="run one section")
    parser.add_argument("--queries", type=int, default=20, help="slow-module queries per target (section 3)")
    parser.add_argument("--before", default="", help="a tree of an earlier commit (git archive REV | tar -x -C "
                        "DIR): sections 2 and 3 measure it beside this one")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 5, 4
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    header("torch trace: overhead on a training step, worst case per hook, agent with a full buffer",
           ["%d interleaved rounds, %d steps per block; torch %s, 1 intra-op thread" % (args.rounds, args.steps,
                                                                                     torch.__version__)])
    if args.only in (None, "overhead"):
        print(table(overhead(torch, args.rounds, args.steps), ["model", "setting", "step time", "overhead median",
                                                               "IQR"]))
        print()
    if args.only in (None, "worst"):
        if args.before:
            print(table(compare_worst_case(args.before, args.rounds, 4),
                        ["200 x Linear(16,16) forward, per module call", "this tree", "before"]))
        else:
            print(table(worst_case(torch, args.rounds), ["200 x Linear(16,16) forward", "median", "per module call"]))
        print()
    if args.only in (None, "agent"):
        print(table(agent_figures(args.queries, args.before), ["agent, default buffer", "figure", "note"]))


if __name__ == "__main__":
    main()
