"""``probe TARGET page``: the page's server against a real 4-rank torchrun job on CPU (gloo) in which rank 2
waits in its data loader while ranks 0, 1 and 3 wait for it in all_reduce (tests/targets/page_job.py, the
trace on): its JSON endpoints by real HTTP requests, and the page itself in a real headless Chromium
(selenium), skipped with the reason where no browser is installed."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from procs import REPO, Proc, scaled, target_env
from test_cluster import needs_torchrun, torchrun_job


def _until(check, seconds, what):
    deadline = time.monotonic() + scaled(seconds)
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.5)
    raise AssertionError("%s within %.0f s; last: %r" % (what, scaled(seconds), last))


def _serve(*args):
    """A page server (`probe ... page`), its Proc and the URL it printed."""
    popen = subprocess.Popen([sys.executable, "-m", "probe", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=target_env(probe=False), cwd=REPO)
    proc = Proc(popen, "probe page")
    try:
        line = proc.read_line(30)
    except BaseException:
        proc.kill()
        raise
    if "--json" in args:
        return proc, json.loads(line)["url"]
    assert line.startswith("page: http://"), line
    return proc, line.split(" ", 1)[1]


def _end(proc):
    """Ctrl-C, as a person ends it: the server stops at once and says so; killed and reaped in any case."""
    if proc.alive():
        proc.popen.send_signal(signal.SIGINT)
        try:
            proc.popen.wait(scaled(10))
        except subprocess.TimeoutExpired:
            pass
    proc.kill()


def _get(url, path, headers=None, timeout=60):
    request = urllib.request.Request(url.split("?")[0].rstrip("/") + path, headers=headers or {})
    with urllib.request.urlopen(request, timeout=scaled(timeout)) as response:
        body = response.read()
        return json.loads(body) if response.headers.get("Content-Type", "").startswith("application/json") else body


def _post(url, path, value):
    request = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(value).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=scaled(60)) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def job():
    """The hung job and a page server for it: (master, rank -> pid, page URL)."""
    with torchrun_job("page_job.py", 4, timeout=scaled(120), TORCH_FR_BUFFER_SIZE="0",
                      PROBE_TORCH_TRACE="1") as (port, pids):
        master = "127.0.0.1:%d" % port
        proc, url = _serve(master, "page", "--refresh", "2", "--steps", "20")
        try:
            yield master, pids, url, proc
        finally:
            _end(proc)


def _stuck(url):
    report = _get(url, "/api/diagnose")
    return report if report.get("status") == "stuck" and report.get("culprits") == [2] else None


@needs_torchrun
def test_the_endpoints_answer_with_what_the_commands_say(job):
    master, pids, url, _ = job
    about = _get(url, "/api/about")
    assert about["target"] == master and about["single"] is False

    # diagnose: the verdict names rank 2 (the ranks waiting in all_reduce need a few seconds to read as stuck)
    report = _until(lambda: _stuck(url), 60, "diagnose naming rank 2")
    assert "rank 2 did not enter all_reduce" in report["verdicts"][0]["summary"], report["verdicts"][0]
    assert report["lines"][0].startswith("STUCK: ") and "load_next_batch" in "\n".join(report["lines"])

    # the grid: every rank, rank 2 in a stack group of its own; the flame graph: its frame, its ranks, marked
    view = _until(lambda: (lambda o: o if len(o.get("ranks", [])) == 4 and not o["failures"] else None)(
        _get(url, "/api/overview")), 30, "every rank's stacks")
    groups = {r["rank"]: r["group"] for r in view["ranks"]}
    assert groups[0] == groups[1] == groups[3] == 0 and groups[2] == 1, view["ranks"]
    assert {r["rank"]: r["pid"] for r in view["ranks"]} == pids
    main = next(t for t in view["flame"]["threads"] if t["thread"] == "MainThread")

    def path_to(node, func):
        if node["func"] == func:
            return [node]
        for kid in node["kids"]:
            found = path_to(kid, func)
            if found:
                return [node] + found
        return []

    loader = path_to(main["tree"], "load_next_batch")
    assert loader and (loader[-1]["ranks"], loader[-1]["n"]) == ("2", 1), loader
    parted = [i for i, n in enumerate(loader) if n["departs"]]
    assert len(parted) == 1 and all(n["ranks"] == "2" for n in loader[parted[0]:]), loader  # marked where it departs
    assert path_to(main["tree"], "train_step")[-1]["ranks"] == "0-1,3"

    # a rank's panel: its stacks and its process row
    rank2 = _get(url, "/api/rank?rank=2")
    assert rank2["process"]["pid"] == pids[2]
    assert any(f["func"] == "load_next_batch" for t in rank2["threads"] for f in t["frames"])
    assert rank2["command"] == "probe %s --ranks 2 backtrace" % master

    # step time and memory per rank from the trace (12 steps made before the hang; the last one unfinished)
    metrics = _until(lambda: (lambda m: m if len(m.get("series", [])) == 4 else None)(_get(url, "/api/metrics")),
                     30, "metrics of every rank")
    for series in metrics["series"]:
        assert series["source"] == "trace" and len(series["x"]) >= 5, series
        assert all(v is not None and v > 0 for v in series["step_s"]) and all(series["memory_mb"]), series

    # SQL on every rank, on one, and merged here
    every = _post(url, "/api/sql", {"sql": "SELECT pid FROM process.info"})
    assert sorted(r[0] for r in every["rows"]) == [0, 1, 2, 3] and [c["name"] for c in every["columns"]][:2] == ["rank", "host"]
    one = _post(url, "/api/sql", {"sql": "SELECT pid FROM process.info", "rank": 2})
    assert one["rows"] == [[2, one["rows"][0][1], pids[2]]] and one["command"].startswith("probe %s --ranks 2 query" % master)
    merged = _post(url, "/api/sql", {"sql": "SELECT pid FROM process.info", "merge": "SELECT count(*) AS n FROM result"})
    assert merged["rows"] == [[4]], merged
    wrong = _post(url, "/api/sql", {"sql": "SELECT nothing FROM no_such_table"})  # each rank says why, as the CLI does
    assert wrong["rows"] == [] and sorted(f["rank"] for f in wrong["failures"]) == [0, 1, 2, 3], wrong
    assert all("no_such_table" in f["reason"] for f in wrong["failures"]), wrong["failures"]

    # the trace for Perfetto: every rank's spans in one file
    exported = _get(url, "/api/trace")
    assert {e.get("pid") for e in exported["traceEvents"] if e.get("ph") == "X"} == {0, 1, 2, 3}, exported.get("otherData")


@needs_torchrun
def test_a_request_naming_another_host_is_refused_and_the_page_has_no_eval(job):
    _, _, url, _ = job
    with pytest.raises(urllib.error.HTTPError) as refused:
        _get(url, "/api/about", headers={"Host": "attacker.example:80"})
    assert refused.value.code == 403
    with pytest.raises(urllib.error.HTTPError) as missing:
        _get(url, "/api/eval")
    assert missing.value.code == 404
    page = _get(url, "/").decode()
    assert "http" not in page.replace("http://www.w3.org", "")  # nothing from the network: no CDN, no font
    script = _get(url, "/static/page.js").decode()
    assert "https://" not in script and "eval(" not in script


def _address_not_loopback():
    try:
        words = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return next((w for w in words if "." in w and not w.startswith("127.")), None)


def test_another_interface_needs_the_page_token_and_ctrl_c_ends_the_page(target_factory):
    target = target_factory("idle.py")
    address = _address_not_loopback()
    if address is None:
        pytest.skip("this machine has no address but loopback")
    proc, url = _serve(str(target.pid), "page", "--host", address, "--json")
    try:
        assert "?token=" in url and address in url
        token = url.split("?token=")[1]
        with pytest.raises(urllib.error.HTTPError) as refused:
            _get(url, "/api/about")
        assert refused.value.code == 403
        about = _get(url, "/api/about", headers={"X-Probe-Page-Token": token})
        assert about["single"] is True and about["target"] == str(target.pid)
        view = _get(url, "/api/overview", headers={"X-Probe-Page-Token": token})
        assert view["ranks"][0]["pid"] == target.pid and view["flame"]["threads"][0]["thread"] == "MainThread"
        proc.popen.send_signal(signal.SIGINT)
        assert proc.popen.wait(scaled(10)) == 0
        err = proc.popen.stderr.read().decode()
        assert "needs the page token" in err and "page stopped" in err, err
    finally:
        _end(proc)


# -- the page in a real browser ---------------------------------------------------------------------------


def _browser():
    """(chromium, chromedriver) paths, or a reason to skip."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return None, "selenium is not installed (pip install selenium; tests/run.sh does)"
    chromium = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    driver = shutil.which("chromedriver") or next((p for p in ("/usr/lib/chromium/chromedriver",) if os.path.exists(p)), None)
    if not chromium or not driver:
        return None, "no Chromium with its driver (Debian: apt-get install chromium chromium-driver; tests/run.sh does)"
    return (chromium, driver), None


@needs_torchrun
def test_the_page_in_a_browser_shows_the_hung_rank_apart(job, tmp_path):
    found, why = _browser()
    if found is None:
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    _, pids, url, _ = job
    _until(lambda: _stuck(url), 60, "diagnose naming rank 2")  # the server's own answer first
    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,2600",
                 "--user-data-dir=%s" % (tmp_path / "profile")):
        options.add_argument(flag)
    service = Service(found[1], log_output=str(tmp_path / "chromedriver.log"))
    browser = webdriver.Chrome(options=options, service=service)
    try:
        browser.set_page_load_timeout(scaled(60))
        browser.get(url)
        wait = WebDriverWait(browser, scaled(60), poll_frequency=0.3)

        verdict = wait.until(lambda b: (lambda t: t if t.startswith("STUCK") else None)(b.find_element(By.ID, "verdict").text))
        assert "rank 2" in verdict, verdict

        def cells(b):
            found = {c.get_attribute("data-rank"): c for c in b.find_elements(By.CSS_SELECTOR, "#grid .cell")}
            return found if len(found) == 4 and found["2"].get_attribute("data-culprit") == "1" else None

        grid = wait.until(cells)
        group = {r: c.get_attribute("data-group") for r, c in grid.items()}
        assert group["0"] == group["1"] == group["3"] != group["2"], group
        assert [r for r, c in grid.items() if "culprit" in c.get_attribute("class")] == ["2"], \
            browser.find_element(By.ID, "verdict-text").text

        frames = wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, '#flame g.frame[data-func="load_next_batch"]'))
        assert [f.get_attribute("data-ranks") for f in frames] == ["2"]
        assert browser.find_elements(By.CSS_SELECTOR, "#flame g.frame.departs")

        grid["2"].click()
        wait.until(lambda b: "load_next_batch" in b.find_element(By.ID, "rank-stacks").text)
        assert str(pids[2]) in browser.find_element(By.ID, "rank-process").text

        browser.find_element(By.ID, "sql-run").click()
        rows = wait.until(lambda b: b.find_element(By.ID, "sql-status").get_attribute("data-rows"))
        assert rows == "4", browser.find_element(By.ID, "sql-status").text
        assert len(browser.find_elements(By.CSS_SELECTOR, "#sql-result tbody tr")) == 4

        wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#chart-step polyline[data-rank]"))
        shot = tmp_path / "page.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10000
        print("the page's screenshot: %s" % shot)
        severe = [e for e in browser.get_log("browser") if e.get("level") == "SEVERE"]
        assert not severe, severe
    finally:
        browser.quit()
