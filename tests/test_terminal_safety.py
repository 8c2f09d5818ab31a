"""No escape sequence from a target reaches the user's terminal (issue 17, item 7).

A real target (``targets/escapes.py``) names a thread, a function, a source file, a module and a table
with OSC 52 (which sets the terminal's clipboard) and CSI sequences (which clear the screen and move the
cursor), and prints them from a snippet. What probe shows a person has them made visible (ESC as
``\\x1b``); JSON keeps them exact (``\\u001b``, which decodes to the very same string), and so does a
snippet's output or CSV sent to a pipe.
"""

import json
import os
import shutil
import subprocess

import pytest

from procs import run_cli, spawn
from terminal import Terminal, run_in_pty

from probe.cli.render import render_backtrace, render_table, visible
from probe.client.results import Frame, Rows

OSC52 = "\x1b]52;c;cHduZWQ=\x07"
CSI = "\x1b[2J\x1b[H\x9b1m"
EVIL = OSC52 + CSI
SHOWN = "\\x1b]52;c;cHduZWQ=\\x07\\x1b[2J\\x1b[H\\x9b1m"  # EVIL as a person sees it
RAW = ("\x1b", "\x07", "\x9b")  # none of these may reach a terminal


def _clean(text: str) -> None:
    """No control character that a terminal acts on: only newlines (and tabs) remain."""
    for char in RAW:
        assert char not in text, "raw %r in the output:\n%s" % (char, text)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    proc = spawn("escapes.py", ("live", str(tmp_path_factory.mktemp("escapes"))))
    yield proc
    proc.kill()


# -- pure functions ------------------------------------------------------------------------------------


def test_visible_writes_out_every_control_character_and_keeps_the_rest():
    assert visible(EVIL) == SHOWN
    assert visible("a\nb\tc\rd\x00\x7f\u202e\udc80") == "a\\nb\\tc\\rd\\x00\\x7f\\u202e\\udc80"
    assert visible("a\nb\tc\rd", lines=True) == "a\nb\tc\\rd"  # text in lines keeps its layout
    assert visible("naïve 東京 ✓ \\x1b") == "naïve 東京 ✓ \\x1b"  # printable text, backslashes included, as is


def test_renderers_show_names_from_a_target_escaped():
    frames = [Frame(7, "t" + EVIL, 70, False, 0, "f" + EVIL, "/x" + EVIL + ".py", 3, code="pass  # " + EVIL)]
    lines = list(render_backtrace(frames))
    _clean("\n".join(lines))
    assert lines[0] == 'Thread 7 "t%s" (native 70)' % SHOWN
    table = "\n".join(render_table(Rows((("v" + EVIL, "VARCHAR"),), [[EVIL + "\nnext"]]), width=200))
    _clean(table)
    assert SHOWN + "\\nnext" in table and "v" + SHOWN in table


# -- a real target, through the real CLI ------------------------------------------------------------------


def test_backtrace_shows_names_escaped_and_json_keeps_them_exact(live):
    text = run_cli(str(live.pid), "backtrace")
    assert text.code == 0, text.err
    _clean(text.out + text.err)
    assert '"thread%s"' % SHOWN in text.out
    assert "evil%s (" % SHOWN in text.out and "file%s.py:2)" % SHOWN in text.out
    assert "event.wait()  # %s" % SHOWN in text.out
    rows = json.loads(run_cli(str(live.pid), "backtrace", "--json").out)
    evil = [r for r in rows if r["func"] == "evil" + EVIL]
    assert evil and evil[0]["thread_name"] == "thread" + EVIL
    assert evil[0]["file"].endswith("file%s.py" % EVIL) and evil[0]["code"] == "event.wait()  # " + EVIL


def test_query_tables_schema_and_errors_show_escapes_while_json_and_piped_csv_stay_exact(live):
    sql = "SELECT name FROM python.modules WHERE name LIKE 'mod%' UNION ALL SELECT value FROM escapes.values"
    table = run_cli(str(live.pid), "query", sql)
    assert table.code == 0, table.err
    _clean(table.out)
    assert "mod" + SHOWN in table.out
    assert sorted(r["name"] for r in json.loads(run_cli(str(live.pid), "query", sql, "--json").out)) == \
        sorted([EVIL, "mod" + EVIL])
    csv = run_cli(str(live.pid), "query", sql, "-F", "csv")  # piped: for a script, exact
    assert "mod" + EVIL in csv.out.splitlines(), csv.out
    for command in (("tables",), ("schema", "escapes.values")):
        listing = run_cli(str(live.pid), *command)
        assert listing.code == 0, listing.err
        _clean(listing.out)
        assert "Rows" + SHOWN in listing.out
    assert json.loads(run_cli(str(live.pid), "schema", "escapes.values", "--json").out)["description"] == "Rows" + EVIL
    failed = run_cli(str(live.pid), "query", "SELECT * FROM escapes.failing")
    assert failed.code != 0
    _clean(failed.err)
    assert "broken" + SHOWN in failed.err, failed.err


def test_a_snippets_output_is_exact_in_a_pipe_and_in_json(live):
    piped = run_cli(str(live.pid), "eval", "import sys; print(EVIL); print(EVIL, file=sys.stderr); EVIL")
    assert piped.code == 0, piped.err
    assert piped.out == EVIL + "\n" + repr(EVIL) + "\n"  # CSI too (click strips it from a pipe)
    assert piped.err == EVIL + "\n"
    answer = json.loads(run_cli(str(live.pid), "eval", "--json", "print(EVIL)").out)
    assert answer["stdout"] == EVIL + "\n"


def test_on_a_real_terminal_nothing_from_the_target_acts(live):
    for args in (["backtrace"], ["query", "SELECT value FROM escapes.values"], ["eval", "print(EVIL)"],
                 ["query", "SELECT value FROM escapes.values", "-F", "csv"],
                 ["eval", "raise ValueError(EVIL)"], ["query", "SELECT * FROM escapes.failing"]):
        code, shown, _ = run_in_pty([str(live.pid), *args], columns=200)
        _clean(shown)
        assert SHOWN in shown, (args, code, shown)


def test_the_repl_shows_a_snippets_escapes_made_visible(live, tmp_path):
    term = Terminal([str(live.pid)], tmp_path)
    try:
        term.expect(">>> ")
        term.send("print(EVIL)\r")
        shown = term.expect(">>> ")
        _clean(shown)
        assert SHOWN in shown
        term.send("\x04")
        term.wait_exit()
    finally:
        term.close()


def test_across_ranks_grouped_stacks_show_names_escaped(live):
    result = run_cli("-t", str(live.pid), "-t", str(live.pid), "--all-ranks", "backtrace")
    assert result.code == 0, result.err
    _clean(result.out + result.err)
    assert 'Thread "thread%s"' % SHOWN in result.out and "evil%s (" % SHOWN in result.out


def test_a_stuck_targets_stacks_and_health_read_from_outside_are_escaped(tmp_path):
    proc = spawn("escapes.py", ("gil", str(tmp_path)))
    try:
        stacks = run_cli("--timeout", "20", str(proc.pid), "backtrace")
        _clean(stacks.out + stacks.err)
        assert "evil_gil%s" % SHOWN in stacks.out, (stacks.code, stacks.out, stacks.err)
        health = run_cli("--timeout", "20", str(proc.pid), "health")
        _clean(health.out + health.err)
        rows = json.loads(run_cli("--timeout", "20", str(proc.pid), "backtrace", "--json").out)
        assert "evil_gil" + EVIL in [r["func"] for r in rows]
    finally:
        proc.kill()


@pytest.mark.skipif(shutil.which("gcore") is None, reason="gcore comes with gdb (apt-get install gdb)")
def test_a_core_files_stacks_are_escaped(live, tmp_path):
    prefix = str(tmp_path / "core")
    done = subprocess.run(["gcore", "-o", prefix, str(live.pid)], capture_output=True, text=True, timeout=120)
    core = "%s.%d" % (prefix, live.pid)
    assert done.returncode == 0 and os.path.exists(core), done.stderr[-2000:]
    result = run_cli("core:" + core, "backtrace")
    assert result.code == 0, result.err
    _clean(result.out + result.err)
    # The reader takes the names from the core's memory as they are stored (it reads a name that is not
    # pure ASCII only in part, with NULs before it): whatever it reads is shown escaped.
    assert "evil\\x1b]" in result.out, result.out
    rows = json.loads(run_cli("core:" + core, "backtrace", "--json").out)
    assert any("evil\x1b]" in r["func"] for r in rows), rows
