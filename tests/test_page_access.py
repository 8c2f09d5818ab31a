"""``probe PID page`` admits its owner only: another local user (a child dropped to uid 65534) gets nothing
from any route, with the token or without; the owner's browser opens the printed URL, and a cookie
(HttpOnly, SameSite=Strict) carries the token from then on; a page of another origin open in that same
browser runs no SQL through it (cross-site request forgery, in a real headless Chromium); and names that
carry HTML show as text there, nothing of them run."""

import http.client
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from other_user import NOBODY, run_as
from procs import scaled, target_env
from test_page import _browser, _chromium, _end, _post, _serve, _until

ROUTES = [("GET", "/"), ("GET", "/index.html"), ("GET", "/static/page.js"), ("GET", "/static/page.css"),
          ("GET", "/favicon.ico"), ("GET", "/api/about"), ("GET", "/api/diagnose"), ("GET", "/api/overview"),
          ("GET", "/api/metrics"), ("GET", "/api/rank?rank=0"), ("GET", "/api/trace"), ("GET", "/no-such-page"),
          ("HEAD", "/"), ("POST", "/api/sql")]
LOCALS_SQL = "SELECT name, value FROM python.locals WHERE name = 'api_key' OR name = 'url'"


def _ask(port, method, path, headers):
    """(status, body) of one request to 127.0.0.1:port; the POST is the page's own SQL request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        body = json.dumps({"sql": LOCALS_SQL}).encode() if method == "POST" else None
        if method == "POST":
            headers = dict(headers, **{"Content-Type": "application/json", "X-Probe-Page": "1",
                                       "Origin": "http://127.0.0.1:%d" % port})
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read().decode("utf-8", "replace")
    except OSError as exc:
        return None, "%s: %s" % (type(exc).__name__, exc)
    finally:
        conn.close()


def _every_route(port, token):
    """Each route asked with no token, then with the token in each of its three places."""
    ways = {"none": ({}, ""), "header": ({"X-Probe-Page-Token": token}, ""), "query": ({}, "token=" + token),
            "cookie": ({"Cookie": "probe_page_%d=%s" % (port, token)}, "")}
    out = []
    for way, (headers, query) in ways.items():
        for method, path in ROUTES:
            asked = path + (("&" if "?" in path else "?") + query if query else "")
            out.append((way, method, path) + _ask(port, method, asked, headers))
    return out


def _as_nobody(port, token):
    """_every_route, asked as uid 65534."""
    got = run_as(NOBODY, lambda: json.dumps(_every_route(port, token)).encode())
    assert not got.startswith(b"child failed"), got
    return [tuple(row) for row in json.loads(got)]


@pytest.mark.skipif(os.getuid() != 0, reason="a second uid needs root (setuid to 65534)")
def test_another_local_user_gets_nothing_from_the_page_even_with_its_token(target_factory):
    target = target_factory("secret_locals.py")
    proc, url = _serve(str(target.pid), "page", "--refresh", "1")
    try:
        port, token = int(url.split(":")[2].split("/")[0]), url.partition("?token=")[2]
        others = _as_nobody(port, token)
        assert len(others) == 4 * len(ROUTES), others
        for way, method, path, status, body in others:
            assert status == 403, (way, method, path, status, body)
            assert method == "HEAD" or "this page admits only uid %d" % os.getuid() in body, (way, method, path, body)
            assert "sk-live" not in body and "hunter2" not in body and str(target.pid) not in body, body
        owner = _every_route(port, "not-" + token)  # the owner too, without the right token: nothing
        for way, method, path, status, body in owner:
            assert status == 403, (way, method, path, status, body)
            assert method == "HEAD" or "page token is missing or wrong" in body, (way, method, path, body)
        # the owner with it: the same requests answer, the job's locals among them
        assert _ask(port, "GET", "/api/about", {"X-Probe-Page-Token": token})[0] == 200
        status, body = _ask(port, "POST", "/api/sql", {"Cookie": "probe_page_%d=%s" % (port, token)})
        # (its SQL sees secret-looking locals masked, as a read token does: the name is there, its value not)
        assert status == 200 and "api_key" in body and "********" in body and "sk-live-" not in body, body
        proc.popen.send_signal(2)
        proc.popen.wait(scaled(10))
        err = proc.popen.stderr.read().decode()
        assert "it admits uid %d (" % os.getuid() in err and "you) only, with the token in the URL above" in err, err
    finally:
        _end(proc)


def test_a_post_without_the_pages_marks_runs_no_sql(idle_target):
    """Each mark the page's own POST carries, left out in turn: refused, and said why."""
    proc, url = _serve(str(idle_target.pid), "page")
    try:
        port, token = int(url.split(":")[2].split("/")[0]), url.partition("?token=")[2]
        page = {"X-Probe-Page-Token": token, "Content-Type": "application/json", "X-Probe-Page": "1",
                "Origin": "http://127.0.0.1:%d" % port}
        body = json.dumps({"sql": "SELECT 1 AS one"}).encode()

        def post(**changed):
            headers = {k: v for k, v in dict(page, **changed).items() if v is not None}
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=scaled(60))
            try:
                conn.request("POST", "/api/sql", body=body, headers=headers)
                response = conn.getresponse()
                return response.status, json.loads(response.read())
            finally:
                conn.close()

        assert post()[0] == 200 and post()[1]["rows"] == [[1]]
        for changed, why in [({"Content-Type": "text/plain; application/json"}, "Content-Type: application/json"),
                             ({"Content-Type": "text/plain"}, "Content-Type: application/json"),
                             ({"Content-Type": "application/json, text/plain"}, "Content-Type: application/json"),
                             ({"X-Probe-Page": None}, "X-Probe-Page: 1"),
                             ({"Origin": None}, "Origin"), ({"Origin": "http://127.0.0.2:%d" % port}, "Origin"),
                             ({"Origin": "null"}, "Origin"), ({"Sec-Fetch-Site": "same-site"}, "another origin"),
                             ({"X-Probe-Page-Token": None}, "page token")]:
            status, answer = post(**changed)
            assert status == 403 and why in answer["error"], (changed, status, answer)
    finally:
        _end(proc)


# -- in a real browser -------------------------------------------------------------------------------------


def _site(host, html):
    """An HTTP server on ``host`` (127.0.0.0/8) that gives ``html`` at / : a web site the owner visits."""

    class Site(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = html.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            return

    server = ThreadingHTTPServer((host, 0), Site)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
    return server


# A page of another origin tries the page's SQL three ways a browser lets it without asking: a fetch whose
# Content-Type a browser sends without a preflight (text/plain, with "application/json" as a parameter), a
# text/plain form posted into a frame, and (to be preflighted, and refused) a fetch with the page's header.
_ATTACK = """<!doctype html><html><body><iframe name="sink"></iframe>
<form id="form" method="POST" enctype="text/plain" target="sink" action="%(page)s/api/sql">
<input type="hidden" name='{"sql": "SELECT &#39;%(mark)s-form&#39; AS x", "pad": "' value='"}'></form>
<script>
const page = "%(page)s", mark = "%(mark)s";
const sql = kind => JSON.stringify({sql: "SELECT '" + mark + "-" + kind + "' AS x"});
document.getElementById("form").submit();  // the frame's first (blank) load is over: the next is the answer's
const frame = new Promise(done => {
  document.querySelector("iframe").addEventListener("load", () => done("frame loaded"));
  setTimeout(() => done("frame timed out"), 20000);
});
Promise.all([
  fetch(page + "/api/sql", {method: "POST", mode: "no-cors", credentials: "include",
                            headers: {"Content-Type": "text/plain; application/json"}, body: sql("fetch")})
    .then(r => "fetch sent: " + r.type, e => "fetch failed: " + e),
  fetch(page + "/api/sql", {method: "POST", credentials: "include",
                            headers: {"Content-Type": "application/json", "X-Probe-Page": "1"}, body: sql("cors")})
    .then(r => "cors answered " + r.status, e => "cors failed: " + e),
  frame,
]).then(results => { document.body.dataset.results = JSON.stringify(results); document.title = "done"; });
</script></body></html>"""


def _trail(pid):
    directory = os.environ["PROBE_RUNTIME_DIR"]
    names = [n for n in os.listdir(directory) if n.startswith("audit-%d-" % pid) and n.endswith(".jsonl")]
    if len(names) != 1:
        return ""
    with open(os.path.join(directory, names[0])) as handle:
        return handle.read()


def test_a_page_of_another_origin_runs_no_sql_through_the_owners_browser(target_factory, tmp_path):
    """The owner has the page open (its cookie set); a site on 127.0.0.2 (another site) and one on another
    port of 127.0.0.1 (the same site, whose requests carry a SameSite=Strict cookie) try the page's SQL.
    The target audits its reads: the owner's queries are in its trail, none of theirs."""
    found, why = _browser()
    if found is None:
        pytest.skip(why)
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    target = target_factory("idle.py", env=target_env(PROBE_AUDIT_READS="1", PROBE_SQL_IN_AGENT="1"))
    proc, url = _serve(str(target.pid), "page", "--refresh", "2")
    base = url.split("?")[0].rstrip("/")
    sites = []
    browser = _chromium(found, tmp_path)
    try:
        browser.get(url)
        wait = WebDriverWait(browser, scaled(60), poll_frequency=0.3)
        wait.until(lambda b: b.find_element(By.ID, "target").text.startswith(str(target.pid)))
        browser.execute_script("document.getElementById('sql').value = \"SELECT 'csrf-owner' AS x\"")
        browser.find_element(By.ID, "sql-run").click()
        assert wait.until(lambda b: b.find_element(By.ID, "sql-status").get_attribute("data-rows")) == "1"
        _until(lambda: "csrf-owner" in _trail(target.pid), 30, "the owner's query in the target's audit trail")

        for host, mark in (("127.0.0.2", "csrf-cross-site"), ("127.0.0.1", "csrf-same-site")):
            site = _site(host, _ATTACK % {"page": base, "mark": mark})
            sites.append(site)
            browser.get("http://%s:%d/" % (host, site.server_address[1]))
            wait.until(lambda b: b.title == "done")
            results = json.loads(browser.find_element(By.TAG_NAME, "body").get_attribute("data-results"))
            assert results[0] == "fetch sent: opaque" and results[1].startswith("cors failed"), results
        _post(url, "/api/sql", {"sql": "SELECT 'csrf-after' AS x"})  # a query after theirs, to know the trail is read late enough
        trail = _until(lambda: (lambda t: t if "csrf-after" in t else None)(_trail(target.pid)), 30, "the last query")
        assert "csrf-cross-site" not in trail and "csrf-same-site" not in trail, \
            [line for line in trail.splitlines() if "csrf-" in line]
        port = int(base.rsplit(":", 1)[1])  # the same-site page's requests carried it: the page was open
        assert [c["name"] for c in browser.get_cookies()] == ["probe_page_%d" % port]
    finally:
        browser.quit()
        for site in sites:
            site.shutdown()
            site.server_close()
        _end(proc)


def test_the_printed_url_opens_the_page_a_cookie_carries_it_and_markup_in_names_shows_as_text(target_factory,
                                                                                             tmp_path):
    """tests/targets/markup_names.py names a thread, a function and a file with a script element and an image
    whose error handler would set window.pwned: the page shows them as written, and no element of theirs is
    made. The printed URL opens the page, drops its token from the address bar, and leaves an HttpOnly,
    SameSite=Strict cookie that opens the page again without it."""
    found, why = _browser()
    if found is None:
        pytest.skip(why)
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    markup = '<script>window.pwned=1</script><img src=x onerror="window.pwned=2">'
    file_markup = '<img src=x onerror="window.pwned=3">'
    target = target_factory("markup_names.py", str(tmp_path))
    proc, url = _serve(str(target.pid), "page", "--refresh", "2")
    base = url.split("?")[0]
    browser = _chromium(found, tmp_path)
    try:
        browser.get(url)
        wait = WebDriverWait(browser, scaled(60), poll_frequency=0.3)
        wait.until(lambda b: b.find_element(By.ID, "target").text.startswith(str(target.pid)))
        assert browser.current_url == base, browser.current_url  # the token is out of the address bar
        cookies = browser.get_cookies()
        assert len(cookies) == 1 and cookies[0]["value"] == url.split("?token=")[1], cookies
        assert cookies[0]["httpOnly"] is True and cookies[0]["sameSite"] == "Strict", cookies
        assert browser.execute_script("return document.cookie") == ""  # HttpOnly: no script reads it

        browser.get(base)  # again, without the token: the cookie carries it
        wait.until(lambda b: b.find_element(By.ID, "target").text.startswith(str(target.pid)))
        wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, '#grid .cell[data-rank="0"]'))[0].click()
        stacks = wait.until(lambda b: (lambda t: t if "marked" in t else None)(b.find_element(By.ID, "rank-stacks").text))
        assert '"thread%s"' % markup in stacks and "marked%s (" % markup in stacks, stacks
        assert "file%s.py" % file_markup in stacks and "event.wait()  # %s" % markup in stacks, stacks
        frames = wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#flame g.frame"))
        assert any(f.get_attribute("data-func") == "marked" + markup for f in frames)
        assert any(h.text == 'Thread "thread%s": 1 distinct stack across 1 of 1 rank' % markup
                   for h in browser.find_elements(By.CSS_SELECTOR, "#flame h3"))
        made = browser.execute_script(
            "return {pwned: window.pwned === undefined ? null : window.pwned,"
            " images: document.querySelectorAll('img').length,"
            " scripts: [...document.querySelectorAll('script')].map(s => s.getAttribute('src'))}")
        assert made == {"pwned": None, "images": 0, "scripts": ["/static/page.js"]}, made
        severe = [e for e in browser.get_log("browser") if e.get("level") == "SEVERE"]
        assert not severe, severe  # a blocked inline handler would be said here
    finally:
        browser.quit()
        _end(proc)
