"""The agent's memory: RSS of a target with ``PROBE=1`` minus the same target without it.

    python bench/bench_memory.py [--runs 7] [--threads 65] [--settle 0.5]

Each run starts bench/targets/threads.py twice, without and with ``PROBE=1`` (alternating which goes
first), waits for ``READY <pid>`` (and, with the agent, its socket), lets it settle, and reads
``VmRSS`` from /proc/PID/status. The agent's target is then asked one query of the simplest shape (one
table, columns, ORDER BY, LIMIT: answered without DuckDB and pyarrow since issue 24), a second one, and
a query DuckDB runs (GROUP BY: DuckDB and pyarrow load), and its RSS read again after each. Medians over
runs. DESIGN: agent memory before its first query <= 10 MB; issue 24: <= 40 MB after a first query over
one small table.
"""

import argparse
import time
from typing import Dict, List

from _common import Summary, Target, header, table, verdict

SQL = "SELECT func, file, lineno, depth FROM python.backtrace ORDER BY depth LIMIT 10"
TARGET_MB = 10.0
QUERY_MB = 40.0
DUCKDB_SQL = "SELECT is_main, count(*) AS n FROM python.threads GROUP BY ALL"


def rss_of(threads: int, probe: bool, settle: float) -> Dict[str, float]:
    """RSS (MB) of one fresh target after READY; with the agent, also after its first and second query."""
    import probe as probe_lib

    args = ("--threads", str(threads), "--main", "block")
    with Target("threads.py", *args, probe=probe) as target:
        time.sleep(settle)
        out = {"ready": target.rss_kb() / 1024.0}
        if probe:
            client = probe_lib.connect(str(target.pid))
            for label, sql in (("after 1st query", SQL), ("after 2nd query", SQL), ("after a DuckDB query", DUCKDB_SQL)):
                client.query_rows(sql)
                time.sleep(settle)
                out[label] = target.rss_kb() / 1024.0
        return out


def measure(threads: int, runs: int, settle: float) -> Dict[str, List[float]]:
    results: Dict[str, List[float]] = {"without PROBE": [], "PROBE=1, before 1st query": [],
                                       "PROBE=1, after 1st query": [], "PROBE=1, after 2nd query": [],
                                       "PROBE=1, after a DuckDB query (GROUP BY)": []}
    for i in range(runs):
        order = (False, True) if i % 2 == 0 else (True, False)
        for probe in order:
            got = rss_of(threads, probe, settle)
            if probe:
                results["PROBE=1, before 1st query"].append(got["ready"])
                results["PROBE=1, after 1st query"].append(got["after 1st query"])
                results["PROBE=1, after 2nd query"].append(got["after 2nd query"])
                results["PROBE=1, after a DuckDB query (GROUP BY)"].append(got["after a DuckDB query"])
            else:
                results["without PROBE"].append(got["ready"])
    return results


def report(results: Dict[str, List[float]]) -> None:
    base = results["without PROBE"]
    rows = []
    for name, values in results.items():
        s = Summary.of(values)
        deltas = [v - b for v, b in zip(values, base)]
        d = Summary.of(deltas)
        rows.append([name, str(s.n), "%.1f" % s.median, "%.1f-%.1f" % (s.low, s.high),
                     "-" if name == "without PROBE" else "%.1f" % d.median,
                     "-" if name == "without PROBE" else "%.1f-%.1f" % (d.low, d.high)])
    print(table(rows, ["what", "n", "RSS median MB", "RSS min-max", "minus no-PROBE, median MB", "min-max"]))
    before = Summary.of([v - b for v, b in zip(results["PROBE=1, before 1st query"], base)]).median
    after = Summary.of([v - b for v, b in zip(results["PROBE=1, after 1st query"], base)]).median
    print("ratios to the target without the agent (medians): before query %.2fx, after 1st query %.2fx"
          % (Summary.of(results["PROBE=1, before 1st query"]).median / Summary.of(base).median,
             Summary.of(results["PROBE=1, after 1st query"]).median / Summary.of(base).median))
    duck = Summary.of([v - b for v, b in zip(results["PROBE=1, after a DuckDB query (GROUP BY)"], base)]).median
    print("DESIGN agent memory before its first query <= %.0f MB: %s (median %.1f MB); after a first query over "
          "one table <= %.0f MB: %s (median %.1f MB); once DuckDB and pyarrow are loaded: %.1f MB, reported"
          % (TARGET_MB, verdict(before <= TARGET_MB), before, QUERY_MB, verdict(after <= QUERY_MB), after, duck))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--threads", type=int, default=65)
    parser.add_argument("--settle", type=float, default=0.5, help="seconds to wait before reading RSS")
    args = parser.parse_args()
    header("Agent memory: VmRSS of a target with PROBE=1 minus the same target without it",
           ["%d runs, fresh targets each (bench/targets/threads.py --threads %d), alternating order"
            % (args.runs, args.threads), "DESIGN: <= 10 MB before the first query"])
    report(measure(args.threads, args.runs, args.settle))


if __name__ == "__main__":
    main()
