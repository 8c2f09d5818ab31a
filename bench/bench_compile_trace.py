"""The torch trace on a torch.compile'd model: step time, trace off vs on, compiled and eager.

    python bench/bench_compile_trace.py [--rounds 9] [--pairs 5] [--backend inductor]
    python bench/bench_compile_trace.py --blocks [--rounds 9] [--steps 8] [--quick] [--before DIR --runs 4]

Step by step (the default): in one process (CPU, one intra-op thread, glibc malloc keeping its memory as
in bench_trace.py), an MLP (8 x Linear(512) + ReLU, batch 64) trained with SGD eager and as
``torch.compile(model, backend=BACKEND)`` (a copy of its own), and a small transformer of the user's own
(2 encoder layers, d_model 128, batch 8 x 32) compiled the same way, and bench_trace.py's MLP (8 x
Linear(1024), batch 64) compiled; each compiled and warmed up first (``--model`` picks by label).
For each, as bench_trace.py's section 1: steps alternate one by one between the trace on and off (all
its hooks in and out between steps: ``bench_trace.TraceToggle``; twice: with every span read, their build
counted, and with nobody reading, the cut of their records counted), and in the
same rounds empty global hooks (torch's part), the floor of a recording hook (each appends one clock
reading: ``bench_trace.HookSet``), a planted cost (a busy-wait of 0.3 % of the untraced step) and the
method's zero alternate the same way; every step timed in CPU time of the
training thread; each on step against the off steps on either side; median, IQR and a bootstrap 95 %
interval of the median. Dynamo's counters (graph breaks, graphs, compiled versions of the model's
forward) before the first round and after the last: the trace must leave them as they were.

``--blocks``: the earlier measurement, the MLP only: in rounds whose order alternates, for each model: a
block of ``--steps`` untraced steps, a block with the trace on (forward spans), a block with the trace
on and the NaN/Inf check, each followed by an untraced block, the trace started and stopped around each
block as ``probe T trace start/stop`` on a live job does; a block's figure is its median step; a
setting's overhead is (its block / the mean of the untraced blocks on either side) - 1, median over
rounds with its IQR; beside it, the time probe's own code took inside the hooks per step
(``Tracer.hook_ns``).
``--before DIR`` (a tree of an earlier commit: ``git archive REV | tar -x -C DIR``) runs the
measurement in child processes, ``--runs`` of them with this tree's probe and as many with DIR's,
alternating, and reports both side by side.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

from _common import REPO, Summary, clean_env, header, table
from bench_trace import MALLOC_ENV

SETTINGS = ("trace on", "trace on + anomalies")


def _model(torch: Any, width: int = 512) -> Any:
    """A model class of the user's own (Dynamo compiles its ``forward`` as a frame; a bare ``Sequential``
    would be compiled through a wrapper of torch's)."""

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layers: List[Any] = []
            for _ in range(8):
                layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
            self.layers = torch.nn.Sequential(*layers)

        def forward(self, x: Any) -> Any:
            return self.layers(x)

    return MLP()


def _trainer(torch: Any, model: Any, params: Any, width: int = 512) -> Callable[[], None]:
    x, y = torch.randn(64, width), torch.randn(64, width)
    loss_fn = torch.nn.MSELoss()
    optimizer = torch.optim.SGD(params, lr=1e-4)

    def step() -> None:
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return step


def _wide(torch: Any, backend: str) -> Tuple[Any, Callable[[], None]]:
    """bench_trace.py's MLP (8 x Linear(1024) + ReLU, batch 64, ~40 ms a step here), compiled."""
    net = _model(torch, 1024)
    return net, _trainer(torch, torch.compile(net, backend=backend), net.parameters(), 1024)


def _median_step(step: Callable[[], None], steps: int) -> float:
    """The median step's CPU time on this thread (torch runs a CPU step on the calling thread with one
    intra-op thread): time the other workers of a shared machine take from us does not count in it."""
    times = []
    for _ in range(steps):
        start = time.thread_time()
        step()
        times.append(time.thread_time() - start)
    return statistics.median(times)


def _dynamo_counts(net: Any) -> Dict[str, int]:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    return {"graph_breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"],
            "forward_versions": len(_debug_get_cache_entry_list(type(net).forward.__code__))}


def measure(backend: str, rounds: int, steps: int) -> Dict[str, Any]:
    """Everything of one process: step times, overheads per (model, setting), compile time, counters."""
    import torch

    from probe.tables.torch import trace
    from probe.tables.torch.trace_options import TraceOptions

    torch.set_num_threads(1)
    torch.manual_seed(0)
    options = {"trace on": TraceOptions(), "trace on + anomalies": TraceOptions(anomalies=True)}
    eager_net, compiled_net = _model(torch), _model(torch)
    compiled = torch.compile(compiled_net, backend=backend)
    steps_of = {"eager": _trainer(torch, eager_net, eager_net.parameters()),
                "compiled": _trainer(torch, compiled, compiled_net.parameters())}
    start = time.perf_counter()
    steps_of["compiled"]()
    compile_s = time.perf_counter() - start
    for step in steps_of.values():
        for _ in range(3):
            step()
    counts_before = _dynamo_counts(compiled_net)
    base: Dict[str, List[float]] = {kind: [] for kind in steps_of}
    ratios: Dict[Tuple[str, str], List[float]] = {(k, s): [] for k in steps_of for s in SETTINGS}
    traced: Dict[Tuple[str, str], List[float]] = {(k, s): [] for k in steps_of for s in SETTINGS}
    hooks: Dict[Tuple[str, str], List[float]] = {(k, s): [] for k in steps_of for s in SETTINGS}
    for r in range(rounds):
        kinds = list(steps_of) if r % 2 == 0 else list(steps_of)[::-1]
        for kind in kinds:
            step = steps_of[kind]
            before = _median_step(step, steps)
            base[kind].append(before)
            for setting in (SETTINGS if r % 2 == 0 else SETTINGS[::-1]):
                trace.start(options[setting])
                step()  # the first step after start names the modules
                tracer = trace.current()
                hook_ns, seen = tracer.hook_time_ns(), tracer.steps_seen
                took = _median_step(step, steps)
                hooks[(kind, setting)].append((tracer.hook_time_ns() - hook_ns) / max(tracer.steps_seen - seen, 1) / 1e3)
                trace.stop()
                step()  # the optimizer's hooks leave at this forward
                after = _median_step(step, steps)
                base[kind].append(after)
                traced[(kind, setting)].append(took)
                ratios[(kind, setting)].append(took / ((before + after) / 2) - 1.0)
                before = after
    return {"compile_s": compile_s, "counts_before": counts_before, "counts_after": _dynamo_counts(compiled_net),
            "base": base, "traced": {"%s|%s" % k: v for k, v in traced.items()},
            "ratios": {"%s|%s" % k: v for k, v in ratios.items()},
            "hook_us": {"%s|%s" % k: v for k, v in hooks.items()}, "torch": torch.__version__}


class _Encoder:
    """A small transformer of the user's own: 2 encoder layers, d_model 128, 4 heads, batch 8 x 32 tokens."""

    @staticmethod
    def make(torch: Any) -> Any:
        class Encoder(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                layer = torch.nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True)
                self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
                self.head = torch.nn.Linear(128, 128)

            def forward(self, x: Any) -> Any:
                return self.head(self.encoder(x))

        return Encoder()


def _encoder_trainer(torch: Any, model: Any, params: Any) -> Callable[[], None]:
    x, y = torch.randn(8, 32, 128), torch.randn(8, 32, 128)
    loss_fn = torch.nn.MSELoss()
    optimizer = torch.optim.SGD(params, lr=1e-4)

    def step() -> None:
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return step


def measure_steps(backend: str, rounds: int, pairs: int, only: str = "") -> List[List[str]]:
    """Step by step, as bench_trace.py's section 1: steps alternate between the trace on and off
    (``TraceToggle``), and in the same rounds a planted cost (0.3 % of the untraced step, a
    busy-wait) and the method's zero alternate the same way; each on step against the off steps on either
    side, in CPU time of the training thread. For the eager MLP, the compiled MLP and a compiled small
    transformer (``only``: those whose label holds it); Dynamo's counters before and after."""
    import torch
    from bench_trace import PLANTED, HookSet, TraceToggle, _spin, alternating, bootstrap_ci

    from probe.tables.torch import trace
    from probe.tables.torch.trace_options import TraceOptions

    torch.set_num_threads(1)
    torch.manual_seed(0)
    eager_net, compiled_net, encoder_net = _model(torch), _model(torch), _Encoder.make(torch)
    runs = {"MLP eager": lambda: (eager_net, _trainer(torch, eager_net, eager_net.parameters())),
            "MLP compiled": lambda: (compiled_net, _trainer(torch, torch.compile(compiled_net, backend=backend),
                                                            compiled_net.parameters())),
            "transformer 2 x d128 compiled": lambda: (encoder_net, _encoder_trainer(
                torch, torch.compile(encoder_net, backend=backend), encoder_net.parameters())),
            "MLP 8 x Linear(1024) compiled (bench_trace's MLP)": lambda: _wide(torch, backend)}
    rows = []
    for label, make in runs.items():
        if only not in label:
            continue
        net, step = make()
        started = time.perf_counter()
        step()
        first_s = time.perf_counter() - started
        for _ in range(3):
            step()
        counts = _dynamo_counts(net) if "compiled" in label else None
        times = []
        for _ in range(5):
            t0 = time.thread_time_ns()
            step()
            times.append(time.thread_time_ns() - t0)
        untraced_ns = statistics.median(times)
        state = [False]

        def flip(state: List[bool] = state) -> None:
            state[0] = not state[0]

        def begin(state: List[bool] = state) -> None:
            state[0] = True

        def planted(step: Callable[[], None] = step, state: List[bool] = state,
                    ns: int = int(untraced_ns * PLANTED)) -> None:
            step()
            if state[0]:
                _spin(ns)

        toggle, unread = TraceToggle(trace, TraceOptions()), TraceToggle(trace, TraceOptions(), read=False)
        hook_us: Dict[str, float] = {}

        def trace_out(name: str, toggle: TraceToggle, hook_us: Dict[str, float] = hook_us) -> int:
            later = toggle.leave()
            hook_us[name] = hook_us.get(name, 0.0) + toggle.hook_us
            return later

        empty, floor = HookSet(torch, floor=False), HookSet(torch, floor=True)
        read, left = "trace, every step", "trace, every step, nobody reads (records cut, not built)"
        settings = {read: (step, toggle.enter, lambda toggle=toggle, read=read: trace_out(read, toggle), toggle.is_on,
                           toggle.switch),
                    left: (step, unread.enter, lambda unread=unread, left=left: trace_out(left, unread), unread.is_on,
                           unread.switch),
                    "empty global hooks (torch's part)": (step, empty.enter, empty.leave, empty.is_on, empty.switch),
                    "the floor: a clock reading appended": (step, floor.enter, floor.leave, floor.is_on,
                                                            floor.switch),
                    "planted %.2f %%" % (PLANTED * 100): (planted, begin, lambda: None,
                                                         lambda state=state: state[0], flip),
                    "untraced (the method's zero)": (step, begin, lambda: None, lambda state=state: state[0], flip)}
        off: Dict[str, List[int]] = {}
        ratios = alternating(settings, rounds, pairs, off)
        after = _dynamo_counts(net) if "compiled" in label else None
        note = "first step %.1f s" % first_s
        if counts is not None:
            note += "; Dynamo %s -> %s" % (_short(counts), _short(after))
        rows.append([label, "untraced step, CPU", "%.2f ms" % (untraced_ns / 1e6), "", "", "", note])
        for name, values in ratios.items():
            summary = Summary.of(values)
            low, high = bootstrap_ci(values, block=4)
            extra = ""
            if name in hook_us:
                extra = "%.0f us in hooks a traced step" % (hook_us[name] / (rounds * pairs))
            elif name.startswith("planted"):
                share = int(untraced_ns * PLANTED) / statistics.median(off[name])
                extra = "planted %.2f %% of the off steps' median: %s" % (share * 100, "seen" if 0 < low <= share <= high
                                                                           else "NOT SEEN")
            rows.append([label, name, "%+.2f %%" % (summary.median * 100), "%+.2f..%+.2f %%" % (summary.q1 * 100,
                                                                                               summary.q3 * 100),
                         "%+.2f..%+.2f %%" % (low * 100, high * 100), str(summary.n), extra])
    return rows


def _run_child(tree: str, backend: str, rounds: int, steps: int) -> Dict[str, Any]:
    code = ("import json, sys; sys.path[:0] = [%r, %r]; import bench_compile_trace as b; "
            "print('RESULT ' + json.dumps(b.measure(%r, %d, %d)))"
            % (os.path.join(REPO, "bench"), tree, backend, rounds, steps))
    done = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True,
                          timeout=900, cwd=tree)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError("measurement with %s failed: %s" % (tree, done.stderr[-3000:]))
    return json.loads(lines[-1][len("RESULT "):])


def _rows(label: str, results: List[Dict[str, Any]]) -> List[List[str]]:
    rows = []
    compile_s = Summary.of([r["compile_s"] for r in results])
    counts = [(r["counts_before"], r["counts_after"]) for r in results]
    for kind in ("eager", "compiled"):
        base = Summary.of([v for r in results for v in r["base"][kind]])
        note = ("first step (compile) %.1f s" % compile_s.median) if kind == "compiled" else ""
        rows.append([label, kind, "untraced", "%.2f ms [%.2f-%.2f]" % (base.median * 1e3, base.q1 * 1e3, base.q3 * 1e3),
                     "-", "-", "-", note])
        for setting in SETTINGS:
            key = "%s|%s" % (kind, setting)
            took = Summary.of([v for r in results for v in r["traced"][key]])
            s = Summary.of([v for r in results for v in r["ratios"][key]])
            hook = Summary.of([v for r in results for v in r["hook_us"][key]])
            rows.append([label, kind, setting, "%.2f ms [%.2f-%.2f]" % (took.median * 1e3, took.q1 * 1e3, took.q3 * 1e3),
                         "%+.1f %%" % (s.median * 100), "%+.1f..%+.1f %% (min-max %+.1f..%+.1f)"
                         % (s.q1 * 100, s.q3 * 100, s.low * 100, s.high * 100), "%.0f us" % hook.median, ""])
    before, after = counts[0]
    same = all(b == a for b, a in counts)
    rows.append([label, "compiled", "Dynamo counters, before -> after the rounds", "", "", "", "",
                 "%s -> %s%s" % (_short(before), _short(after), "" if same else " (differ)")])
    return rows


def _short(counts: Dict[str, int]) -> str:
    return "breaks %d, graphs %d, forward versions %d" % (counts["graph_breaks"], counts["graphs"],
                                                          counts["forward_versions"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 4 steps")
    parser.add_argument("--before", default="", help="a tree of an earlier commit, measured beside this one")
    parser.add_argument("--runs", type=int, default=2, help="child processes per tree with --before")
    parser.add_argument("--model", default="", help="step by step: only the models whose label holds this "
                        "(\"MLP\", \"compiled\", \"transformer\")")
    parser.add_argument("--pairs", type=int, default=5, help="step by step: on/off pairs per round and setting")
    parser.add_argument("--blocks", action="store_true", help="the block measurement (trace and anomalies, "
                        "started and stopped around blocks) instead of step by step")
    args = parser.parse_args()
    if not args.blocks and any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable] + sys.argv, dict(os.environ, **MALLOC_ENV))
    if args.quick:
        args.rounds, args.steps = 3, 4
    header("torch trace on a compiled model: step time, trace off vs on, compiled (%s) and eager" % args.backend,
           ["%d interleaved rounds, %s, 1 intra-op thread; load average %.1f at start"
            % (args.rounds, "%d steps per block" % args.steps if args.blocks else "%d pairs a round, step by step"
               % args.pairs, os.getloadavg()[0])])
    if not args.blocks:
        sys.path.insert(0, REPO)
        print(table(measure_steps(args.backend, args.rounds, args.pairs, args.model),
                    ["model", "setting", "overhead median", "IQR of pairs", "95 % CI of median", "pairs", "note"]))
        print("load average %.2f at the end" % os.getloadavg()[0])
        return
    columns = ["probe", "model", "setting", "median step CPU [IQR]", "overhead median", "overhead IQR",
               "in hooks / step", "note"]
    if not args.before:
        sys.path.insert(0, REPO)
        print(table(_rows("this tree", [measure(args.backend, args.rounds, args.steps)]), columns))
        return
    results: Dict[str, List[Dict[str, Any]]] = {"this tree": [], "before": []}
    for r in range(args.runs):
        order = [("this tree", REPO), ("before", args.before)]
        for label, tree in (order if r % 2 == 0 else order[::-1]):
            results[label].append(_run_child(tree, args.backend, args.rounds, args.steps))
    print(table(_rows("this tree", results["this tree"]) + _rows("before", results["before"]), columns))


if __name__ == "__main__":
    main()
