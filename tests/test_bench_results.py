"""bench/RESULTS.md is the table bench/report.py makes of the run records in bench/results/ (issue 35 item 5):
checked here without running a benchmark. The records are the history; the docs quote the newest of them."""

import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
from types import ModuleType
from typing import List

from procs import REPO, target_env

BENCH = os.path.join(REPO, "bench")


def report_module() -> ModuleType:
    """bench/report.py (bench/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("bench_report", os.path.join(BENCH, "report.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def docs_texts() -> List[str]:
    """README.md and the docs site's pages, each with its whitespace folded: where a figure may be quoted."""
    texts = []
    for path in [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "**", "*.md"),
                                                                     recursive=True)):
        with open(path, encoding="utf-8") as handle:
            texts.append(" ".join(handle.read().split()))
    return texts


def test_results_md_is_the_table_the_records_give():
    report = report_module()
    with open(os.path.join(BENCH, "RESULTS.md"), encoding="utf-8") as handle:
        current = handle.read()
    assert current == report.render(report.load()), "bench/RESULTS.md is stale: run python bench/report.py"
    assert current.count("\n") <= 300
    done = subprocess.run([sys.executable, os.path.join(BENCH, "report.py"), "--check"], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env=target_env(probe=False))
    assert done.returncode == 0, done.stdout + done.stderr


def test_report_check_fails_on_a_results_md_the_records_do_not_give(tmp_path):
    stale = tmp_path / "RESULTS.md"
    stale.write_text("# Benchmark results\n\nedited by hand\n")
    done = subprocess.run([sys.executable, os.path.join(BENCH, "report.py"), "--check", "--out", str(stale)],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env=target_env(probe=False))
    assert done.returncode == 1
    assert "differs from what the records give" in done.stderr


def test_every_record_holds_a_run():
    records = report_module().load()
    assert records
    for name, record in records:
        assert record["schema"] == 1, name
        assert name.endswith("_%s.json" % record["bench"]), name
        assert re.match(r"20\d\d-\d\d-\d\d", record["date"]), name
        for key in ("machine", "load", "commit", "figures", "summary", "output", "notes"):
            assert key in record, (name, key)
        for figure in record["figures"]:
            assert figure["figure"] and "ratio" in figure and "peer" in figure, (name, figure)


def test_a_bench_run_writes_its_record(tmp_path):
    """A real process using the benches' helpers (no benchmark: two made-up series) leaves one record with its
    figure, its peer, the ratio and spread, what it printed, the machine, the load and the commit."""
    script = tmp_path / "bench_tiny.py"
    script.write_text(
        "import sys\n"
        "sys.path.insert(0, %r)\n"
        "from _common import figure, start_run, summary_table\n"
        "start_run('tiny: a against b')\n"
        "a, b = [0.010, 0.012, 0.011], [0.020, 0.022, 0.021]\n"
        "print(summary_table({'a': a, 'b': b}))\n"
        "figure('a', a, peer='b', peer_values=b, goal='<= 1x', met=True)\n"
        "print('SUMMARY: a 0.52x b')\n" % BENCH)
    out = tmp_path / "results"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=REPO,
                          env=dict(target_env(probe=False), BENCH_RESULTS=str(out)))
    assert done.returncode == 0, done.stderr
    (path,) = out.glob("*_bench_tiny.json")
    assert "record: " in done.stdout
    record = json.loads(path.read_text())
    assert record["bench"] == "bench_tiny" and record["title"] == "tiny: a against b"
    (fig,) = record["figures"]
    assert fig["figure"] == "a" and fig["peer"] == "b" and fig["median"] == 11.0 and fig["peer_median"] == 21.0
    assert fig["ratio"] == round(11 / 21, 4) and fig["range"] == [10.0, 12.0] and fig["met"] is True
    assert record["summary"] == ["SUMMARY: a 0.52x b"]
    assert [row["what"] for row in record["rows"]] == ["a", "b"]
    assert any(line.startswith("a ") for line in record["output"])
    assert record["machine"]["cpus"] == os.cpu_count() and record["machine"]["python"] == sys.version.split()[0]
    assert len(record["load"]["start"]) == 3
    assert "commit" in record
    report = report_module()
    assert "| bench_tiny | a | b | **0.52x**" in report.render(report.load(str(out)))


def test_a_failed_run_writes_no_record(tmp_path):
    script = tmp_path / "bench_broken.py"
    script.write_text("import sys\nsys.path.insert(0, %r)\nfrom _common import start_run\nstart_run('broken')\n"
                      "raise RuntimeError('the target did not start')\n" % BENCH)
    out = tmp_path / "results"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=REPO,
                          env=dict(target_env(probe=False), BENCH_RESULTS=str(out)))
    assert done.returncode == 1
    assert not list(out.glob("*.json"))
