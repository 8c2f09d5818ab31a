"""Ctrl-C on a snippet says what is true: one inside a call into C (which an interrupt cannot enter) is
told to stop and stops when the call returns; the CLI and the repl say so, and where it is."""

import os
import time

from terminal import Terminal, run_in_pty

import probe

IN_C = "import ctypes\nctypes.CDLL(None).sleep(3)\nopen(%r, 'w').write('ran on')\n"


def _running_snippet(pid: int) -> bool:
    client = probe.connect(str(pid), timeout=10)
    spinning = ("import sys, threading; me = threading.get_ident(); sum(1 for i, f in sys._current_frames().items() "
                "if i != me and f.f_code.co_filename == '<probe-eval>')")
    return client.eval(spinning).value == "1"


def test_ctrl_c_on_a_snippet_in_a_c_call_says_it_stops_when_the_call_returns(idle_target, tmp_path):
    marker = str(tmp_path / "after")
    status, screen, _ = run_in_pty([str(idle_target.pid), "eval", IN_C % marker],
                                   when=lambda _pid: _running_snippet(idle_target.pid), timeout=60)
    assert status == 130, screen
    assert "told to stop, but it is inside a call into C" in screen and "<probe-eval>" in screen, screen
    assert "was interrupted in the target" not in screen, screen
    deadline = time.monotonic() + 10
    while _running_snippet(idle_target.pid):  # the call returns, the interrupt lands before the next line
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert not os.path.exists(marker), "the line after the C call ran: the interrupt was lost"


def test_the_repl_says_a_second_ctrl_c_stops_waiting(idle_target, tmp_path):
    term = Terminal([str(idle_target.pid)], str(tmp_path))
    try:
        term.expect(">>> ")
        term.send("import ctypes; ctypes.CDLL(None).sleep(30)\r")
        deadline = time.monotonic() + 20
        while not _running_snippet(idle_target.pid):
            assert time.monotonic() < deadline, "the snippet never started"
            time.sleep(0.05)
        term.send("\x03")
        said = term.expect("Ctrl-C again stops waiting")
        assert "inside a call into C" in said, said
        term.send("\x03")
        term.expect("not waiting for it any more")
        term.expect(">>> ")
    finally:
        term.close()
