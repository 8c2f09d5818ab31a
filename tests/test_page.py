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
from contextlib import contextmanager

import pytest

from procs import REPO, TARGETS, Proc, scaled, target_env
from test_cluster import TORCHRUN, _free_ports, _kill_job, _ready_ranks, needs_torchrun, torchrun_job


def _until(check, seconds, what):
    deadline = time.monotonic() + scaled(seconds)
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.5)
    raise AssertionError("%s within %.0f s; last: %r" % (what, scaled(seconds), last))


def _serve(*args, env=None):
    """A page server (`probe ... page`), its Proc and the URL it printed."""
    popen = subprocess.Popen([sys.executable, "-m", "probe", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=env or target_env(probe=False), cwd=REPO)
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


def _token(url):
    """The page token of a printed URL: a script sends it in a header (a browser, in the cookie the URL sets)."""
    return {"X-Probe-Page-Token": url.split("?token=")[1]} if "?token=" in url else {}


def _get(url, path, headers=None, timeout=60):
    request = urllib.request.Request(url.split("?")[0].rstrip("/") + path, headers=dict(_token(url), **(headers or {})))
    with urllib.request.urlopen(request, timeout=scaled(timeout)) as response:
        body = response.read()
        return json.loads(body) if response.headers.get("Content-Type", "").startswith("application/json") else body


def _post(url, path, value):
    """A POST as the page makes it: JSON, its own header and its own origin, and the token."""
    base = url.split("?")[0].rstrip("/")
    request = urllib.request.Request(base + path, data=json.dumps(value).encode(), method="POST", headers=dict(
        _token(url), **{"Content-Type": "application/json", "X-Probe-Page": "1", "Origin": base}))
    with urllib.request.urlopen(request, timeout=scaled(60)) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def job():
    """The hung job and a page server for it: (master, rank -> pid, page URL)."""
    with torchrun_job("page_job.py", 4, timeout=scaled(120), TORCH_FR_BUFFER_SIZE="0",
                      PROBE_TORCH_TRACE="1", PROBE_STACK_EVERY="1") as (port, pids):
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
        for kid in node.get("kids", []):
            found = path_to(kid, func)
            if found:
                return [node] + found
        return []

    loader = path_to(main["tree"], "load_next_batch")
    assert loader and (loader[-1]["ranks"], loader[-1]["n"]) == ("2", 1), loader
    parted = [i for i, n in enumerate(loader) if n.get("departs")]
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


@contextmanager
def _job_keeping_its_output(tmp_path, script, nproc, extra=(), **env):
    """test_cluster's torchrun job, with the launcher's stderr (its own, its helper's and its ranks') kept in
    ``tmp_path/launcher.err`` for the failure message: yields (PROBE_PORT, rank -> pid, that path)."""
    port = _free_ports(nproc)
    err = tmp_path / "launcher.err"
    with open(err, "wb") as sink:
        launcher = subprocess.Popen([TORCHRUN, "--nproc-per-node=%d" % nproc, "--master-port=%d" % _free_ports(1),
                                     *extra, os.path.join(TARGETS, script)], stdout=subprocess.PIPE, stderr=sink,
                                    env=target_env(probe=False, PROBE_PORT=str(port), **env), start_new_session=True)
    try:
        yield port, _ready_ranks(Proc(launcher, "torchrun " + script), nproc, time.monotonic() + scaled(120)), err
    finally:
        _kill_job(launcher)


@needs_torchrun
def test_the_grid_says_which_rank_holds_its_gil_and_which_is_dead(tmp_path):
    """tests/targets/rank_states.py: rank 1 keeps its GIL in a C call, rank 3 is killed once its node's helper
    lists it (a rank killed before its helper ever saw it has no cell of its own to turn dead: see the test
    below), ranks 0 and 2 wait. The launcher's monitor looks after 600 s only: torchrun does not end the job."""
    with _job_keeping_its_output(tmp_path, "rank_states.py", 4, ("--monitor-interval=600",), GIL_RANK="1") as (
            port, pids, err):
        proc, url = _serve("127.0.0.1:%d" % port, "page", "--refresh", "1")
        seen = []

        def states(wanted):
            _get(url, "/api/diagnose")  # the grid takes the states of diagnose's last look
            view = _get(url, "/api/overview")
            if "ranks" not in view:  # this gathering failed (said in its error): the page shows it, and looks again
                seen.append(view)
                return None
            seen.append([(r["rank"], r["state"], r["why"][:80]) for r in view["ranks"]])
            return view if wanted({r["rank"]: r["state"] for r in view["ranks"]}) else None

        try:
            _until(lambda: states(lambda got: sorted(got) == [0, 1, 2, 3] and got[3] == "running"), 60,
                   "every rank listed, rank 3 running")
            os.kill(pids[3], signal.SIGKILL)
            view = _until(lambda: states(lambda got: got == {0: "running", 1: "gil_held", 2: "running", 3: "dead"}),
                          60, "ranks 1 and 3 shown as GIL held and dead")
        except (AssertionError, OSError) as exc:  # OSError: the page's server did not answer (urllib's errors)
            raise AssertionError("%s; the grid said, oldest first: %r; the launcher's stderr ends: %s"
                                 % (exc, seen[-8:], err.read_text(errors="replace")[-3000:])) from None
        finally:
            _end(proc)
        why = {r["rank"]: r["why"] for r in view["ranks"]}
        assert "killed by signal 9" in why[3], why
        assert view["groups"][0]["ranks"] == [0, 2]  # rank 1's stack, read from outside, is a group of its own
        assert [g["ranks"] for g in view["groups"]][1:] == [[1]] and "hold_the_gil" in view["groups"][1]["top"]


def test_a_rank_no_helper_lists_has_a_cell_that_says_so(tmp_path):
    """Rank 1 of a job of 2 never starts (as a rank killed before its node's helper saw it, or on a node whose
    helper does not report): the grid still has its cell, silent, and says why, as `probe ... ranks` does."""
    from probe.client import transport
    from probe.errors import ProbeError
    from test_node_helper import ranks_of

    def listed(runtime, port):  # the node's helper, started by rank 0, lists it (a page started before would
        try:  # find one agent at HOST:PORT, and serve the page of that one process)
            answer = transport.request(transport.UnixAddress(os.path.join(runtime, "node-%d.sock" % port)), "GET",
                                       "/v1/ranks", None, {}, 5.0)
            return answer.status == 200 and json.loads(bytes(answer.body))["members"]
        except (OSError, ProbeError):
            return False

    with ranks_of(tmp_path, 1, GIL_RANK="none", SLURM_NTASKS="2") as job:
        _until(lambda: listed(job["runtime"], job["port"]), 30, "rank 0 listed by its node's helper")
        proc, url = _serve("127.0.0.1:%d" % job["port"], "page", "--refresh", "1", env=job["env"])
        try:
            view = _until(lambda: (lambda o: o if o.get("ranks") else None)(_get(url, "/api/overview")), 30,
                          "the grid of the job")
        finally:
            _end(proc)
    assert [(r["rank"], r["state"]) for r in view["ranks"]] == [(0, "running"), (1, "silent")], view["ranks"]
    assert view["ranks"][1]["why"].startswith("not listed by its node's helper") and view["ranks"][1]["pid"] is None
    assert [f["rank"] for f in view["failures"]] == ["1"] and view["total"] == 2, view["failures"]


def test_one_process_without_the_trace_charts_the_step_counter(target_factory):
    """probe PID page on a training loop (tests/targets/train.py, no trace): a point a step from torch.steps."""
    target = target_factory("train.py", timeout=60)
    proc, url = _serve(str(target.pid), "page", "--refresh", "1")
    try:
        def grown():
            series = _get(url, "/api/metrics")["series"]
            return series if series and len(series[0]["x"]) >= 3 else None

        series = _until(grown, 30, "three steps charted")
        assert series[0]["source"] == "counter" and series[0]["x"] == sorted(set(series[0]["x"])), series
        # torch.steps has no step time before its second step: a look that saw the first has none (under load)
        assert all(v > 0 for x, v in zip(series[0]["x"], series[0]["step_s"]) if x >= 2), series
        assert all(v > 0 for v in series[0]["memory_mb"]) and series[0]["x"][-1] >= 2, series
        report = _get(url, "/api/diagnose")
        assert report["status"] == "healthy" and report["lines"][0].startswith("HEALTHY: "), report["lines"]
        view = _get(url, "/api/overview")
        assert [(r["rank"], r["pid"], r["state"]) for r in view["ranks"]] == [(0, target.pid, "running")]
        with pytest.raises(urllib.error.HTTPError) as untraced:  # never traced: said, no empty file
            _get(url, "/api/trace")
        assert untraced.value.code == 400 and "no rank gave its trace" in json.loads(untraced.value.read())["error"]
        with pytest.raises(urllib.error.HTTPError) as merge:
            _post(url, "/api/sql", {"sql": "SELECT 1", "merge": "SELECT * FROM result"})
        assert merge.value.code == 400 and "one process" in json.loads(merge.value.read())["error"]
    finally:
        _end(proc)


def test_another_loopback_address_needs_the_page_token_and_ctrl_c_ends_the_page(target_factory):
    """--host 127.0.0.2 (a second address of this machine; tests send nothing beyond 127.0.0.0/8): the URL
    names it, nothing answers without the token, stderr says whom the page admits, Ctrl-C ends it."""
    target = target_factory("idle.py")
    proc, url = _serve(str(target.pid), "page", "--host", "127.0.0.2", "--json")
    try:
        assert url.startswith("http://127.0.0.2:") and "?token=" in url, url
        with pytest.raises(urllib.error.HTTPError) as refused:
            _get(url.split("?")[0], "/api/about")
        assert refused.value.code == 403
        about = _get(url, "/api/about")
        assert about["single"] is True and about["target"] == str(target.pid)
        view = _get(url, "/api/overview")
        assert view["ranks"][0]["pid"] == target.pid and view["flame"]["threads"][0]["thread"] == "MainThread"
        proc.popen.send_signal(signal.SIGINT)
        assert proc.popen.wait(scaled(10)) == 0
        err = proc.popen.stderr.read().decode()
        assert "it admits uid %d (" % os.getuid() in err and "with the token in the URL above" in err, err
        assert "page stopped" in err, err
    finally:
        _end(proc)


def test_a_taken_port_and_a_snapshot_are_refused_in_words(idle_target):
    import socket

    from procs import run_cli

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = run_cli(str(idle_target.pid), "page", "--port", str(port), timeout=scaled(60))
    assert result.code == 2 and "cannot serve on 127.0.0.1:%d" % port in result.err, result
    assert "--port" in result.err
    result = run_cli("snapshot:/nowhere", "page", timeout=scaled(60))
    assert result.code == 2 and "a snapshot does not change" in result.err, result


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


def _chromium(found, tmp_path):
    """A headless Chromium driven by selenium, the installed browser and driver named (nothing downloaded)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    options.add_experimental_option("prefs", {"download.default_directory": str(tmp_path / "downloads"),
                                              "download.prompt_for_download": False})
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,2600",
                 "--user-data-dir=%s" % (tmp_path / "profile")):
        options.add_argument(flag)
    browser = webdriver.Chrome(options=options, service=Service(found[1], log_output=str(tmp_path / "chromedriver.log")))
    browser.set_page_load_timeout(scaled(60))
    browser.set_script_timeout(scaled(60))
    return browser


@needs_torchrun
def test_the_page_in_a_browser_shows_the_hung_rank_apart(job, tmp_path):
    found, why = _browser()
    if found is None:
        pytest.skip(why)
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    _, pids, url, _ = job
    _until(lambda: _stuck(url), 60, "diagnose naming rank 2")  # the server's own answer first
    browser = _chromium(found, tmp_path)
    try:
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
        csv = browser.execute_script("return csvText(lastRows)").splitlines()  # what Download CSV saves
        assert csv[0] == "rank,host,pid,rss_mb,cpu_percent,num_threads" and len(csv) == 5, csv
        assert sorted(int(line.split(",")[2]) for line in csv[1:]) == sorted(pids.values())

        browser.find_element(By.ID, "trace-export").click()
        saved = wait.until(lambda b: (lambda t: t if "saved" in t or "error" in t else None)(
            b.find_element(By.ID, "trace-status").text))
        assert int(saved.split()[0]) > 0 and "events saved as probe-trace-" in saved, saved
        name = saved.split(" saved as ")[1].split()[0]
        exported = _until(lambda: (tmp_path / "downloads" / name).exists() and
                          json.loads((tmp_path / "downloads" / name).read_text()), 30, "the trace's file")
        assert {e["pid"] for e in exported["traceEvents"] if e.get("ph") == "X"} == {0, 1, 2, 3}

        wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#chart-step polyline[data-rank]"))
        # where each rank has been: a bar a run of one stack, for every rank (the node helper samples each second)
        try:
            bars = wait.until(lambda b: (lambda found: found if {e.get_attribute("data-rank") for e in found} ==
                                         {"0", "1", "2", "3"} else None)(b.find_elements(By.CSS_SELECTOR, "#timeline rect")))
        except Exception:
            raise AssertionError("timeline: %s; bars of ranks %s" % (
                browser.find_element(By.ID, "timeline-status").text,
                sorted({e.get_attribute("data-rank") for e in browser.find_elements(By.CSS_SELECTOR, "#timeline rect")})))
        assert all(float(e.get_attribute("width")) >= 2 for e in bars), [e.get_attribute("width") for e in bars]
        shot = tmp_path / "page.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10000
        print("the page's screenshot: %s" % shot)
        severe = [e for e in browser.get_log("browser") if e.get("level") == "SEVERE"]
        assert not severe, severe
    finally:
        browser.quit()


class _Firefox:
    """Firefox headless, driven over Marionette, its own remote protocol (JSON messages framed ``LENGTH:``):
    Debian packages no geckodriver, and selenium would download one. Only the few commands used here."""

    def __init__(self, binary, tmp_path):
        import socket

        with socket.socket() as probe_port:
            probe_port.bind(("127.0.0.1", 0))
            port = probe_port.getsockname()[1]
        profile = tmp_path / "firefox-profile"
        profile.mkdir()
        (profile / "user.js").write_text("".join('user_pref("%s", %s);\n' % (k, json.dumps(v)) for k, v in {
            "marionette.port": port, "browser.shell.checkDefaultBrowser": False,
            "datareporting.policy.dataSubmissionEnabled": False, "toolkit.telemetry.reportingpolicy.firstRun": False,
            "browser.startup.homepage_override.mstone": "ignore", "app.update.disabledForTesting": True}.items()))
        self.log = open(tmp_path / "firefox.log", "wb")
        self.popen = subprocess.Popen([binary, "--marionette", "--headless", "--no-remote", "--profile", str(profile),
                                       "--width", "1400", "--height", "2600", "about:blank"],
                                      stdout=self.log, stderr=subprocess.STDOUT)
        self.id = 0
        try:
            deadline = time.monotonic() + scaled(60)
            while True:
                try:
                    self.sock = socket.create_connection(("127.0.0.1", port), timeout=scaled(60))
                    break
                except OSError:
                    if time.monotonic() > deadline or self.popen.poll() is not None:
                        raise AssertionError("Firefox's Marionette did not listen within %.0f s" % scaled(60)) from None
                    time.sleep(0.3)
            self.stream = self.sock.makefile("rb")
            self._read()  # its greeting
            self.call("WebDriver:NewSession", {})
        except BaseException:
            self.quit()
            raise

    def _read(self):
        length = b""
        while not length.endswith(b":"):
            byte = self.stream.read(1)
            if not byte:
                raise AssertionError("Firefox closed Marionette's connection")
            length += byte
        return json.loads(self.stream.read(int(length[:-1])))

    def call(self, name, params):
        self.id += 1
        body = json.dumps([0, self.id, name, params]).encode()
        self.sock.sendall(b"%d:%s" % (len(body), body))
        _, _, error, result = self._read()
        if error:
            raise AssertionError("%s: %s" % (name, error))
        return result.get("value") if isinstance(result, dict) else result

    def js(self, script):
        return self.call("WebDriver:ExecuteScript", {"script": script, "args": []})

    def quit(self):
        try:
            if getattr(self, "sock", None) is not None:
                self.call("Marionette:Quit", {"flags": ["eForceQuit"]})
                self.popen.wait(scaled(20))
        except (AssertionError, OSError, subprocess.TimeoutExpired):
            pass
        finally:
            if self.popen.poll() is None:
                self.popen.kill()
                self.popen.wait(scaled(20))
            if getattr(self, "sock", None) is not None:
                self.sock.close()
            self.log.close()


@needs_torchrun
def test_the_page_in_firefox_shows_the_hung_rank_apart(job, tmp_path):
    import base64

    binary = next((p for p in map(shutil.which, ("firefox-esr", "firefox")) if p), None)
    if binary is None:
        pytest.skip("no Firefox (Debian: apt-get install firefox-esr; tests/run.sh does)")
    _, _, url, _ = job
    _until(lambda: _stuck(url), 60, "diagnose naming rank 2")
    firefox = _Firefox(binary, tmp_path)
    try:
        firefox.call("WebDriver:Navigate", {"url": url})
        verdict = _until(lambda: (lambda t: t if t.startswith("STUCK") else None)(
            firefox.js("return document.getElementById('verdict').textContent")), 60, "the verdict in Firefox")
        assert "rank 2" in verdict, verdict
        cells = _until(lambda: (lambda c: c if c and len(c) == 4 and c["2"][1] == "1" else None)(firefox.js(
            "const out = {}; for (const c of document.querySelectorAll('#grid .cell'))"
            " out[c.dataset.rank] = [c.dataset.group, c.dataset.culprit]; return out;")), 30, "the grid in Firefox")
        assert cells["0"][0] == cells["1"][0] == cells["3"][0] != cells["2"][0], cells
        assert firefox.js("return [...document.querySelectorAll('#flame g.frame[data-func=\"load_next_batch\"]')]"
                          ".map(g => g.dataset.ranks)") == ["2"]
        firefox.js("document.getElementById('sql-run').click()")
        rows = _until(lambda: firefox.js("return document.getElementById('sql-status').dataset.rows"), 30, "SQL rows")
        assert rows == "4", firefox.js("return document.getElementById('sql-status').textContent")
        shot = tmp_path / "page-firefox.png"
        shot.write_bytes(base64.b64decode(firefox.call("WebDriver:TakeScreenshot", {"full": True, "hash": False})))
        print("the page's screenshot in Firefox: %s" % shot)
    finally:
        firefox.quit()


# -- 256 ranks: what a refresh moves stays bounded, and the page draws it quickly ---------------------------


class _ManyRanks:
    """A job of 256 ranks as the page's server receives it from a source: made here (no such job fits this
    machine), through the same shaping and serving as a real one. Each rank has its own deep stack in a
    thread of its own (more distinct stacks than the page draws), rank 77 stands apart in the main thread."""

    single = False
    label = "many:9700"

    def __init__(self, ranks=256, steps=50):
        self.ranks = ranks
        self.steps = steps

    def command(self, ranks, rest):
        return "probe many:9700 %s" % rest

    def diagnose(self):
        from probe.diagnose.verdict import Report, Verdict

        verdict = Verdict("collective_hang", "stuck", "collective hang: rank 77 did not enter all_reduce", culprits=[77],
                          victims=[r for r in range(self.ranks) if r != 77])
        return Report("stuck", [verdict], [], 3.0, 2, {}), None

    def overview(self):
        main = (("all_reduce", "/x/c10d.py", 10), ("train_step", "/x/train.py", 20), ("main", "/x/train.py", 40))
        odd = (("wait", "/x/threading.py", 331), ("load_next_batch", "/x/train.py", 29), ("main", "/x/train.py", 44))
        threads = {"MainThread": {main: [r for r in range(self.ranks) if r != 77], odd: [77]},
                   "worker": {tuple(("f%d" % d, "/x/w.py", r) for d in range(120)): [r] for r in range(self.ranks)}}
        members = [{"rank": r, "host": "node%d" % (r // 8), "pid": 1000 + r, "state": "running"} for r in range(self.ranks)]
        return {"members": members, "threads": threads, "outside": {}, "failures": [], "total": self.ranks,
                "asked_directly": []}

    def metrics(self, history):
        trace = {r: [{"step": s, "step_s": 0.5 + (0.3 if r == 77 else 0) + s / 1000, "memory_mb": 1000 + r + s}
                     for s in range(100, 100 + self.steps)] for r in range(self.ranks)}
        return dict(history.update(trace, {}, {}, list(range(self.ranks))), queries=[])

    def rank(self, rank):
        return {"rank": rank, "threads": [], "process": {"pid": 1000 + rank}}

    def sql(self, sql, rank, merge, max_rows):
        return {"columns": [{"name": "rank", "type": "BIGINT"}], "rows": [[r] for r in range(self.ranks)],
                "truncated": False, "total": self.ranks, "failures": []}

    def trace_events(self):
        return [], []


@pytest.fixture
def many_ranks_page():
    import threading

    from probe.page.server import PageServer

    server = PageServer(_ManyRanks(), refresh=2.0, steps=50)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        yield server.urls()["url"]
    finally:
        server.httpd.shutdown()
        thread.join(scaled(10))


def test_a_refresh_of_256_ranks_moves_bounded_answers(many_ranks_page):
    from probe.page.data import MAX_DEPTH, MAX_FRAMES, MAX_STACKS

    url = many_ranks_page
    raw = {path: _raw(url, path) for path in ("/api/overview", "/api/metrics", "/api/diagnose")}
    overview, metrics = json.loads(raw["/api/overview"]), json.loads(raw["/api/metrics"])
    assert len(overview["ranks"]) == 256 and [g["ranks"] for g in overview["groups"]][1] == [77]
    worker = next(t for t in overview["flame"]["threads"] if t["thread"] == "worker")
    assert worker["stacks"] == 256 and 0 < worker["stacks_drawn"] < MAX_STACKS  # cut by the frames sent in all

    def depth(node):
        return 1 + max([depth(k) for k in node.get("kids", [])] or [0])

    def count(node):
        return 1 + sum(count(k) for k in node.get("kids", []))

    assert depth(worker["tree"]) == MAX_DEPTH + 2  # the thread, 80 frames, and "(40 frames more)"
    assert sum(count(t["tree"]) for t in overview["flame"]["threads"]) <= MAX_FRAMES + 2 * MAX_DEPTH
    assert len(metrics["series"]) == 256 and all(len(s["x"]) == 50 for s in metrics["series"])
    sizes = {path: len(body) for path, body in raw.items()}
    assert sizes["/api/overview"] < 300_000 and sizes["/api/metrics"] < 300_000, sizes


def _raw(url, path):
    request = urllib.request.Request(url.split("?")[0].rstrip("/") + path, headers=_token(url))
    with urllib.request.urlopen(request, timeout=scaled(30)) as response:
        return response.read()


def test_the_page_of_256_ranks_draws_a_refresh_quickly(many_ranks_page, tmp_path):
    found, why = _browser()
    if found is None:
        pytest.skip(why)
    browser = _chromium(found, tmp_path)
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        browser.get(many_ranks_page)
        wait = WebDriverWait(browser, scaled(60), poll_frequency=0.3)
        wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "#grid .cell")) == 256 and
                   b.find_elements(By.CSS_SELECTOR, '#chart-step svg[data-kind="heat"]'))
        assert browser.find_element(By.CSS_SELECTOR, '#grid .cell[data-rank="77"]').get_attribute("data-group") == "1"
        browser.find_element(By.ID, "pause").click()  # no refresh of its own while one is timed
        wait.until(lambda b: b.execute_script("return !busy"))
        took = browser.execute_async_script(
            "const done = arguments[0]; const t = performance.now(); refresh().then(() => done(performance.now() - t));")
        assert took < scaled(3) * 1000, "a refresh of 256 ranks took %.0f ms" % took
        shot = tmp_path / "page-256.png"
        browser.save_screenshot(str(shot))
        print("a refresh of 256 ranks: %.0f ms (answers given again from the server's cache); screenshot: %s" % (took, shot))
    finally:
        browser.quit()


# -- the shaping, on readings made by hand ------------------------------------------------------------------


def test_a_rank_state_is_the_worse_of_what_its_helper_lists_and_what_diagnose_saw():
    from probe.page.data import grid_state

    assert grid_state("running", "answering") == "running"
    assert grid_state("running", "gil_held") == "gil_held"
    assert grid_state("running", "stopped") == grid_state("stopped", None) == "stopped"
    assert grid_state("silent", "answering") == grid_state("running", "no_answer") == grid_state("unreported", None) == "silent"
    assert grid_state("dead", "answering") == grid_state("running", "dead") == "dead"


def test_without_the_trace_the_step_counter_gives_a_point_a_step_and_rss_a_point_a_look():
    from probe.page.data import StepHistory

    history = StepHistory(3)
    for steps in (5, 5, 6, 7, 8, 9):  # the same step seen twice is one point; only the last 3 are kept
        out = history.update({}, {0: {"steps": steps, "step_s": 0.25}}, {0: 100.0 + steps, 1: 50.0}, [0, 1])
    series = {s["rank"]: s for s in out["series"]}
    assert series[0]["source"] == "counter" and series[0]["x"] == [7, 8, 9] and series[0]["memory_mb"] == [107, 108, 109]
    assert series[1]["source"] == "memory" and series[1]["unit"] == "look" and series[1]["x"] == [4, 5, 6]
    out = history.update({0: [{"step": 3, "step_s": 0.5, "memory_mb": 9.0}]}, {}, {}, [0])  # the trace wins; rank 1 gone
    assert [(s["rank"], s["source"], s["x"]) for s in out["series"]] == [(0, "trace", [3])]
