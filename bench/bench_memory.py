"""The agent's memory: RSS of a target with ``PROBE=1`` minus the same target without it.

    python bench/bench_memory.py [--runs 7] [--threads 65] [--settle 0.5]

Each run starts bench/targets/threads.py three times, without ``PROBE=1``, with it, and with it and
``PROBE_SQL_IN_AGENT=1`` (the order rotating each run), waits for ``READY <pid>`` (and, with the agent,
its socket), lets it settle, and reads ``VmRSS`` from /proc/PID/status. Each agent's target is then asked
one query of the simplest shape (one table, columns, ORDER BY, LIMIT: answered in Python, without DuckDB
and pyarrow), a second one, a GROUP BY and a join, and its RSS read again after each. By default the
agent leaves a query it cannot answer in Python to the client, which runs it over the rows the agent
sends; with ``PROBE_SQL_IN_AGENT=1`` DuckDB and pyarrow load into the target. Medians and min-max over
runs. DESIGN: agent memory before its first query <= 10 MB; issue 24: <= 40 MB after any query.
"""

import argparse
import time
from typing import Dict, List

import _common
from _common import Summary, Target, figure, header, table, verdict

SQL = "SELECT func, file, lineno, depth FROM python.backtrace ORDER BY depth LIMIT 10"
TARGET_MB = 10.0
QUERY_MB = 40.0
DUCKDB_SQL = "SELECT is_main, count(*) AS n FROM python.threads GROUP BY ALL"
JOIN_SQL = ("SELECT t.thread_name, count(*) AS frames FROM python.threads t JOIN python.backtrace b "
            "ON t.thread_id = b.thread_id GROUP BY ALL ORDER BY frames DESC LIMIT 5")
STEPS = (("after 1st query", SQL), ("after 2nd query", SQL), ("after a GROUP BY", DUCKDB_SQL),
         ("after a join", JOIN_SQL))
MODES = {"off": "without PROBE", "default": "PROBE=1", "in-agent": "PROBE=1 PROBE_SQL_IN_AGENT=1"}


def rss_of(threads: int, mode: str, settle: float) -> Dict[str, float]:
    """RSS (MB) of one fresh target after READY; with the agent, also after each query of STEPS."""
    import probe as probe_lib

    args = ("--threads", str(threads), "--main", "block")
    plain = _common.clean_env
    if mode == "in-agent":  # the Target takes the environment clean_env gives it
        _common.clean_env = lambda probe=False: dict(plain(probe), PROBE_SQL_IN_AGENT="1")
    try:
        target = Target("threads.py", *args, probe=mode != "off")
    finally:
        _common.clean_env = plain
    with target:
        time.sleep(settle)
        out = {"ready": target.rss_kb() / 1024.0}
        if mode != "off":
            client = probe_lib.connect(str(target.pid))
            for label, sql in STEPS:
                client.query_rows(sql)
                time.sleep(settle)
                out[label] = target.rss_kb() / 1024.0
        return out


def measure(threads: int, runs: int, settle: float) -> Dict[str, List[float]]:
    results: Dict[str, List[float]] = {MODES["off"]: []}
    for mode in ("default", "in-agent"):
        for label in ["before 1st query"] + [label for label, _ in STEPS]:
            results["%s, %s" % (MODES[mode], label)] = []
    modes = list(MODES)
    for i in range(runs):
        for mode in modes[i % 3:] + modes[:i % 3]:
            got = rss_of(threads, mode, settle)
            if mode == "off":
                results[MODES["off"]].append(got["ready"])
                continue
            for label, value in got.items():
                results["%s, %s" % (MODES[mode], "before 1st query" if label == "ready" else label)].append(value)
    return results


def report(results: Dict[str, List[float]]) -> None:
    base = results[MODES["off"]]

    def growth(name: str) -> Summary:
        return Summary.of([v - b for v, b in zip(results[name], base)])

    rows = []
    for name, values in results.items():
        s = Summary.of(values)
        d = growth(name)
        rows.append([name, str(s.n), "%.1f" % s.median, "%.1f-%.1f" % (s.low, s.high),
                     "-" if name == MODES["off"] else "%.1f" % d.median,
                     "-" if name == MODES["off"] else "%.1f-%.1f" % (d.low, d.high)])
    for name in results:
        if name != MODES["off"]:
            growth_mb = [v - b for v, b in zip(results[name], base)]
            goal = (TARGET_MB if name.endswith("before 1st query") else None if name.startswith(MODES["in-agent"])
                    else QUERY_MB)
            figure("agent RSS, %s (minus the target without it)" % name, growth_mb, unit="MB", scale=1.0,
                   peer=MODES["off"], peer_values=base, ratio=Summary.of(results[name]).median / Summary.of(base).median,
                   goal=None if goal is None else "<= %.0f MB" % goal,
                   met=None if goal is None else Summary.of(growth_mb).median <= goal)
    print(table(rows, ["what", "n", "RSS median MB", "RSS min-max", "minus no-PROBE, median MB", "min-max"]))
    before = growth("PROBE=1, before 1st query").median
    after = {label: growth("PROBE=1, %s" % label).median for label, _ in STEPS}
    worst = max(after.values())
    in_agent = growth("%s, after a GROUP BY" % MODES["in-agent"]).median
    print("DESIGN agent memory before its first query <= %.0f MB: %s (median %.1f MB); issue 24, after any query "
          "<= %.0f MB: %s (the largest median, %s: %.1f MB); with PROBE_SQL_IN_AGENT=1, after a GROUP BY "
          "(DuckDB and pyarrow loaded): %.1f MB, reported"
          % (TARGET_MB, verdict(before <= TARGET_MB), before, QUERY_MB, verdict(worst <= QUERY_MB),
             max(after, key=lambda k: after[k]), worst, in_agent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--threads", type=int, default=65)
    parser.add_argument("--settle", type=float, default=0.5, help="seconds to wait before reading RSS")
    args = parser.parse_args()
    header("Agent memory: VmRSS of a target with PROBE=1 minus the same target without it",
           ["%d runs, fresh targets each (bench/targets/threads.py --threads %d), order rotating"
            % (args.runs, args.threads), "DESIGN: <= 10 MB before the first query; issue 24: <= 40 MB after any"])
    report(measure(args.threads, args.runs, args.settle))


if __name__ == "__main__":
    main()
