"""A checkpoint's path comes from whoever holds the control scope (issue 33 item 11): it must not replace a
file of the job's user. Not through a link another user (uid 65534, a real second user) planted at PATH
or on the way to it, not over an existing file unless asked (--overwrite), and even then only over a
checkpoint."""

import hashlib
import json
import os
import shutil
import socket
import tempfile
from typing import Iterator

import pytest

import probe
from procs import running, run_cli, target_env
from test_runtime_fallback import _as_nobody

torch = pytest.importorskip("torch")

CONTROL = "control-token-of-the-paths-case"


def _sha(path: str) -> str:
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def shared() -> Iterator[str]:
    """A world-writable sticky directory every user reaches, as /tmp is."""
    path = tempfile.mkdtemp(prefix="probe-ck-shared-")
    os.chmod(path, 0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to be a second user")
def test_a_control_token_cannot_make_a_checkpoint_replace_the_users_files(shared, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    bashrc = home / ".bashrc"
    bashrc.write_text("export PATH=$HOME/bin:$PATH\n")
    keys = home / "keys"
    keys.mkdir()
    before = _sha(str(bashrc))
    link, dirlink = os.path.join(shared, "ck.pt"), os.path.join(shared, "out")

    def plant() -> None:
        os.symlink(str(bashrc), link)  # a link at PATH, to the user's file
        os.symlink(str(keys), dirlink)  # a link on the way, to the user's directory

    _as_nobody(plant)
    token = tmp_path / "control.token"
    token.write_text(CONTROL + "\n")
    token.chmod(0o600)
    port = _free_port()
    env = target_env(PROBE_LISTEN="127.0.0.1:%d" % port, PROBE_CONTROL_TOKEN_FILE=str(token))
    with running("train.py", "--idle", env=env, timeout=120) as proc:
        def save(path: str, *extra: str):
            return run_cli("127.0.0.1:%d" % port, "--token-file", str(token), "checkpoint", path, "--json", *extra,
                           timeout=120)

        for extra in ((), ("--overwrite",)):
            through = save(link, *extra)
            assert through.code != 0 and "symbolic link" in through.err, through
            assert os.path.islink(link) and os.readlink(link) == str(bashrc)
            over = save(str(bashrc), *extra)
            refusal = "exists already" if not extra else "not a checkpoint"
            assert over.code != 0 and refusal in over.err, over
            dotted = save(str(home / "keys" / ".." / ".bashrc"), *extra)
            assert dotted.code != 0, dotted
            inside = save(os.path.join(dirlink, "ck.pt"), *extra)
            assert inside.code != 0 and "uid 65534" in inside.err, inside
        assert _sha(str(bashrc)) == before and os.listdir(str(keys)) == []
        # hf writes a directory: an existing one (not made by this save) is not used unless asked
        made = run_cli(str(proc.pid), "eval", "import torch; scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 5)")
        assert made.code == 0, made.err
        hf = run_cli(str(proc.pid), "checkpoint", str(keys), "-F", "hf")
        assert hf.code != 0 and "exists already" in hf.err, hf
        assert os.listdir(str(keys)) == []
        # the ranks of one save share its directory (one save_id, as the CLI gives every rank); another save not
        client = probe.connect(str(proc.pid), timeout=120)
        fresh = str(tmp_path / "hf-ck")
        client.checkpoint(fresh, format="hf", save_id="save1")
        assert client.checkpoint(fresh, format="hf", save_id="save1")["path"] == fresh  # another rank's turn
        with pytest.raises(probe.ProbeError) as other:
            client.checkpoint(fresh, format="hf", save_id="save2")
        assert "exists already" in other.value.message
        client.checkpoint(fresh, format="hf", save_id="save2", overwrite=True)
        assert ".probe-save-save1" in os.listdir(fresh) and "pytorch_model.bin" in os.listdir(fresh)

        # Asked, a checkpoint replaces a checkpoint (the user's own way to save again to one name).
        mine = str(tmp_path / "mine.pt")
        first = save(mine)
        assert first.code == 0, first.err
        again = save(mine)
        assert again.code != 0 and "--overwrite" in again.err, again
        replaced = save(mine, "--overwrite")
        assert replaced.code == 0, replaced.err
        assert json.loads(replaced.out)["sha256"] == _sha(mine)
        assert torch.load(mine)["format"] == "probe.checkpoint/1"
    assert sorted(os.listdir(str(tmp_path))) == ["control.token", "hf-ck", "home", "mine.pt"]
