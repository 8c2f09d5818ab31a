"""probe T repl driven through a real pseudo-terminal: editing, blocks, completion, Ctrl-C, Ctrl-D, history."""

import time

import pytest

from procs import scaled
from terminal import Terminal

import probe
from probe.cli.commands.repl import group_outputs

SPINNING = ("import sys, threading; me = threading.get_ident(); sum(1 for i, f in sys._current_frames().items() "
            "if i != me and f.f_code.co_filename == '<probe-eval>')")


@pytest.fixture
def terminal_factory(tmp_path):
    opened = []

    def open_(*args: str) -> Terminal:
        term = Terminal(args, tmp_path)
        opened.append(term)
        return term

    yield open_
    for term in opened:
        term.close()


def test_repl_in_a_real_terminal(idle_target, terminal_factory, tmp_path):
    term = terminal_factory(str(idle_target.pid))
    term.expect("probe repl: %d" % idle_target.pid)
    term.expect(">>> ")
    term.send("x = 41\r")
    term.expect(">>> ")
    term.send("x + 1\r")
    assert "42" in term.expect(">>> ")
    term.send("def f():\r")
    term.expect("... ")
    term.send("    return x + 2\r")
    term.expect("... ")
    term.send("\r")
    term.expect(">>> ")
    term.send("f()\r")
    assert "43" in term.expect(">>> ")
    term.send("counte\t")  # completes from the target's __main__: `counter`
    term.expect("counter")
    term.send("['n'] > 0\r")
    assert "True" in term.expect(">>> ")
    term.send("while True: pass\r")
    term.expect("... ")
    term.send("\r")  # a compound statement ends with an empty line
    client = probe.connect(str(idle_target.pid))
    deadline = time.monotonic() + 10
    while client.eval(SPINNING).value != "1":
        assert time.monotonic() < deadline, "the snippet never started in the target"
    term.send("\x03")  # Ctrl-C: interrupts the snippet in the target, not the REPL
    shown = term.expect(">>> ")
    assert "interrupting the snippet in the target" in shown and "EvalInterrupted" in shown, shown
    assert client.eval(SPINNING).value == "0"
    term.send("1 / 0\r")
    assert "ZeroDivisionError" in term.expect(">>> ")
    term.send("\x04")  # Ctrl-D leaves
    assert term.wait_exit() == 0
    history = (tmp_path / ".probe_history").read_text()
    assert "x = 41" in history and "while True: pass" in history


def test_several_targets_grouped_by_output(target_factory, terminal_factory):
    first, second = target_factory("idle.py"), target_factory("idle.py")
    term = terminal_factory("-t", str(first.pid), "-t", str(second.pid))
    term.expect(">>> ")
    term.send("counter['n'] > 0\r")
    shown = term.expect(">>> ")
    assert "== %d, %d ==" % (first.pid, second.pid) in shown and "True" in shown
    term.send("import os; os.getpid()\r")
    shown = term.expect(">>> ")
    assert "== %d ==" % first.pid in shown and "== %d ==" % second.pid in shown
    term.send("\x04")
    assert term.wait_exit() == 0


def test_group_outputs():
    assert group_outputs([("a", "1\n"), ("b", "2\n"), ("c", "1\n")]) == [(["a", "c"], "1\n"), (["b"], "2\n")]


@pytest.mark.parametrize("line", ["exit()", "quit()", "raise SystemExit", "import sys; print('bye'); sys.exit(3)"])
def test_leaving_the_repl_the_ways_a_console_leaves_never_ends_the_target(idle_target, terminal_factory, line):
    """exit() and quit() leave the repl (run here: in the target they would close its stdin); SystemExit
    raised in the target is caught there by the agent, and leaves the repl too. The target runs on."""
    term = terminal_factory(str(idle_target.pid))
    term.expect(">>> ")
    term.send(line + "\r")
    if "print" in line:
        assert "SystemExit" not in term.expect("bye", timeout=scaled(30))  # what it printed is shown
    assert term.wait_exit(timeout=scaled(30)) == 0
    assert idle_target.popen.poll() is None
    client = probe.connect(str(idle_target.pid))
    assert client.eval("import sys; sys.stdin is None or not sys.stdin.closed").value == "True"
