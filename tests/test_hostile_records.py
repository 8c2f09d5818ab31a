"""Records and dumps made to hurt the reader (issue 33, items 6 and 7): crafted Flight Recorder pickles and
JSON (shared lists named again and again, a huge integer, a million levels deep) end in a few seconds with
one line that names the file, never a traceback; in a shared snapshot directory, what another user (a real
uid 65534) planted is listed apart with its owner, never read as yours, read by path only with a warning,
and a damaged file of your own is named while the rest is listed."""

import json
import os
import pickle
import shutil
import tempfile
import time
from typing import Dict, Iterator, List, Tuple

import pytest
from procs import run_cli, running, scaled

from probe.snapshot.store import snapshot_id

NOBODY = 65534


def _laughs(levels: int = 30, fan: int = 10) -> bytes:
    """A torch-shaped dump whose one entry's input_sizes is a list of ``fan`` names of the list below it,
    ``levels`` deep: under 1 KB of pickle, fan**levels values to any walk over it."""
    out = bytearray(b"\x80\x02]q\x00(" + b"K\x01" * fan + b"e")  # memo 0: [1, 1, ...]
    for level in range(1, levels):
        out += b"]q" + bytes([level]) + b"(" + (b"h" + bytes([level - 1])) * fan + b"e"
    out += (b"}X\x07\x00\x00\x00entries]}X\x0b\x00\x00\x00input_sizesh" + bytes([levels - 1]) +
            b"sX\x11\x00\x00\x00collective_seq_idK\x01s" + b"as.")
    return bytes(out)


def _crafted() -> Dict[str, Tuple[bytes, str]]:
    """name -> (the dump's bytes, what the error must say)."""
    deep = b"\x80\x02}X\x07\x00\x00\x00entries" + b"]" * 1_000_000 + b"a" * 999_999 + b"s."
    return {
        "laughs": (_laughs(), "expands to more than"),
        "bigint": (pickle.dumps({"entries": [{"collective_seq_id": 7 ** 240_000}]}, protocol=4), "integer of"),
        "textint": (b"\x80\x02}X\x07\x00\x00\x00entries](}X\x02\x00\x00\x00idI" + b"9" * 200_000 + b"\nsea.",
                    "not a Flight Recorder dump that can be read"),
        "deep": (deep, "nests more than"),
        "deepjson": (b'{"entries": ' + b"[" * 1_000_000 + b"]" * 1_000_000 + b"}", "not JSON"),
        "shallowjson": (b'{"entries": [{"input_sizes": ' + b"[" * 500 + b"]" * 500 + b"}]}", "nests more than"),
    }


@pytest.mark.parametrize("name", sorted(_crafted()))
def test_a_crafted_dump_ends_in_seconds_with_one_line_naming_it(tmp_path, name: str) -> None:
    data, said = _crafted()[name]
    (tmp_path / ("%s_0" % name)).write_bytes(data)
    started = time.monotonic()
    result = run_cli("snapshot:%s" % (tmp_path / ("%s_" % name)), "diagnose", timeout=scaled(60))
    took = time.monotonic() - started
    assert result.code == 2 and "Traceback" not in result.err, (result.code, result.err[-2000:])
    assert str(tmp_path / ("%s_0" % name)) in result.err and said in result.err, result.err
    assert took < scaled(10), took


def _as(uid: int, work: List[Tuple[str, str, bytes]]) -> None:
    """A forked child of user ``uid`` makes each ("dir", path, b"") and writes each ("file", path, bytes)."""
    child = os.fork()
    if child == 0:
        code = 1
        try:
            os.setgid(uid)
            os.setuid(uid)
            for kind, path, data in work:
                if kind == "dir":
                    os.mkdir(path, 0o755)
                else:
                    with open(path, "wb") as handle:
                        handle.write(data)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


@pytest.fixture(scope="module")
def shared() -> Iterator[Dict[str, str]]:
    """A shared snapshot directory (mode 1777, as /tmp): one snapshot of ours, recorded from a live process;
    then, by uid 65534, a copy of it claiming to be job pid6121 recorded later, and a directory whose
    rank-00000.json nests a million deep; and one directory of ours whose only record is damaged."""
    if os.geteuid() != 0:
        pytest.skip("planting another user's records needs root to become uid 65534")
    root = tempfile.mkdtemp(prefix="probe-shared-", dir="/tmp")
    os.chmod(root, 0o1777)
    alone = os.path.join(root, "only-theirs")  # not a snapshot's name: a shared directory of its own
    os.mkdir(alone)
    os.chmod(alone, 0o1777)
    try:
        with running("idle.py") as proc:
            made = run_cli(str(proc.pid), "snapshot", "--dir", root, "--json", timeout=scaled(90))
        assert made.code == 0, made.err
        ours = json.loads(made.out)["path"]
        later = time.time() + 600
        planted = os.path.join(root, snapshot_id("pid6121", later))
        deep = os.path.join(root, snapshot_id("pid777", later + 1))
        theirs = os.path.join(alone, snapshot_id("pid6121", later))
        forged = os.path.join(root, "x\npid1-20260101T000000Z  forged line")  # a name that would print a row
        work = [("dir", planted, b""), ("dir", deep, b""), ("dir", theirs, b""), ("dir", forged, b""),
                ("file", os.path.join(forged, "rank-00000.json"), b"{}")]
        for name in os.listdir(ours):
            with open(os.path.join(ours, name), "rb") as handle:
                raw = json.loads(handle.read())
            raw["job"] = "pid6121"
            work.append(("file", os.path.join(planted, name), json.dumps(raw).encode()))
            work.append(("file", os.path.join(theirs, name), json.dumps(raw).encode()))
        work.append(("file", os.path.join(deep, "rank-00000.json"), b"[" * 1_000_000 + b"]" * 1_000_000))
        _as(NOBODY, work)
        damaged = os.path.join(root, snapshot_id("pid888", time.time() - 3600))
        os.mkdir(damaged, 0o700)
        with open(os.path.join(damaged, "rank-00000.json"), "wb") as handle:
            handle.write(b'{"format": "probe-snapshot 1", "x": ' + b"[" * 200 + b"]" * 200 + b"}")
        yield {"root": root, "ours": ours, "planted": planted, "deep": deep, "damaged": damaged, "alone": alone}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_another_user_s_records_are_listed_apart_with_their_owner(shared: Dict[str, str]) -> None:
    listed = run_cli("snapshots", shared["root"], timeout=scaled(60))
    assert listed.code == 0 and "Traceback" not in listed.err, (listed.code, listed.err[-2000:])
    mine, _, others = listed.out.partition("written by other users")
    assert os.path.basename(shared["ours"]) in mine and "pid6121" not in mine and "pid777" not in mine, listed.out
    for path in (shared["planted"], shared["deep"]):
        line = next(l for l in others.splitlines() if os.path.basename(path) in l)
        assert "nobody (uid 65534)" in line, others
    assert os.path.join(shared["damaged"], "rank-00000.json") in listed.out and "nests more than" in listed.out
    assert "x\\npid1-20260101T000000Z  forged line" in others and "\npid1-" not in listed.out, others
    rows = [json.loads(line) for line in run_cli("snapshots", shared["root"], "--json").out.splitlines()]
    owners = {row["id"]: row["owner"] for row in rows}
    assert owners[os.path.basename(shared["ours"])] is None, owners
    assert owners[os.path.basename(shared["planted"])] == "nobody (uid 65534)", owners


def test_the_newest_snapshot_is_yours_and_another_user_s_is_read_by_path_with_a_warning(shared: Dict[str, str]) -> None:
    newest = run_cli("snapshot:" + shared["root"], "diagnose", timeout=scaled(60))
    assert "pid6121" not in newest.out and "warning" not in newest.err, (newest.out, newest.err)
    assert newest.code != 2 and "RECORD: a record of process" in newest.out, (newest.code, newest.out, newest.err)
    asked = run_cli("snapshot:" + shared["planted"], "diagnose", timeout=scaled(60))
    warned = "probe: warning: %s was written by nobody (uid 65534), not by you" % shared["planted"]
    assert warned in asked.err, asked.err
    deep = run_cli("snapshot:" + shared["deep"], "diagnose", timeout=scaled(60))
    assert deep.code == 2 and "Traceback" not in deep.err and "rank-00000.json is not a probe snapshot record" \
        in deep.err, (deep.code, deep.err[-2000:])
    alone = run_cli("snapshot:" + shared["alone"], "diagnose", timeout=scaled(60))
    assert alone.code == 2 and "no snapshot of yours in %s (1 by other users, not read unless named by path)" \
        % shared["alone"] in alone.err, (alone.code, alone.err)
