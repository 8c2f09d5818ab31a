"""What a node helper sends as diagnose's evidence (``probe.diagnose.gathered``) is read as hostile: each
rank's fields of JSON's own types exactly, its threads well formed and pointing into the stacks it sent,
its straggler samples too, only ranks it was asked about and each once; anything else is refused with
what was wrong (``Bad``: the client then names that helper's ranks as unusable), and a good answer reads
back the frames and samples it was made of."""

import copy
import json
from types import SimpleNamespace

import pytest

from probe.client.results import Frame
from probe.diagnose import gather, gathered
from probe.diagnose.evidence import RankEvidence


def _evidence(rank: int) -> RankEvidence:
    frames = [Frame(1000, "MainThread", 2000 + rank, True, d, f, "/job/train.py", 10 + d, "x = 1")
              for d, f in enumerate(("wait", "allreduce", "step", "<module>"))]
    frames += [Frame(1001, "pin_memory", 3000 + rank, False, 0, "get", "/usr/lib/queue.py", 180, "self.not_empty.wait()")]
    sample = [("wait", "/job/train.py", 10, "x = 1"), ("step", "/job/train.py", 12, "x = 1")]
    return RankEvidence(rank, "node0", 4000 + rank, frames=frames, seconds=0.4,
                        training={"main_samples": [sample, sample]}, steps=[{"optimizer": "SGD", "steps": 5}])


def _answer() -> dict:
    return json.loads(json.dumps(gathered.encode([_evidence(0), _evidence(1)], None)))


def _read(raw: dict) -> list:
    asked = {r: SimpleNamespace(rank=r, host="node0") for r in (0, 1)}
    return gathered.decode(raw, asked, {}, 100.0, gather)


def test_a_good_answer_reads_back_its_frames_and_samples():
    evs = _read(_answer())
    assert [ev.rank for ev in evs] == [0, 1]
    for ev in evs:
        want = _evidence(ev.rank)
        assert list(ev.frames) == [f._replace(code=f.code) for f in want.frames]
        assert ev.stacks() == want.stacks()
        assert ev.training["main_samples"] == [tuple(want.training["main_samples"][0])] * 2
        assert ev.pid == 4000 + ev.rank and ev.seconds == 0.4


def _broken(change) -> dict:
    raw = copy.deepcopy(_answer())
    change(raw)
    return raw


@pytest.mark.parametrize("change, said", [
    (lambda raw: raw["ranks"][0].update(pid=True), "pid is not of its type"),
    (lambda raw: raw["ranks"][0].update(seconds=True), "seconds is not of its type"),
    (lambda raw: raw["ranks"][0].update(state=["answering"]), "state is not of its type"),
    (lambda raw: raw["ranks"][0].update(state="fine"), "state is not one of"),
    (lambda raw: raw["ranks"][1].update(rank=0), "which it was not asked about (or twice)"),
    (lambda raw: raw["ranks"][1].update(rank=7), "which it was not asked about (or twice)"),
    (lambda raw: raw["ranks"][0].update(age=-1), "has no age"),
    (lambda raw: raw["ranks"][0]["frames"][0].__setitem__(4, 99), "thread is not [id"),
    (lambda raw: raw["ranks"][0]["frames"][0].__setitem__(3, 1), "thread is not [id"),
    (lambda raw: raw["ranks"][0]["frames"][0].__setitem__(0, "1000"), "thread is not [id"),
    (lambda raw: raw["ranks"][0]["frames"][0].append(0), "thread is not [id"),
    (lambda raw: raw["ranks"][0]["frames"].__setitem__(0, {"id": 1}), "thread is not [id"),
    (lambda raw: raw["ranks"][0]["frames"][1].__setitem__(0, 1000), "two threads of id 1000"),
    (lambda raw: raw["ranks"][0]["training"].update(main_samples=[0, 99]), "samples are not stacks it sent"),
    (lambda raw: raw["ranks"][0]["training"].update(main_samples=[True]), "samples are not stacks it sent"),
    (lambda raw: raw["ranks"][0]["training"].update(main_samples="0"), "samples are not stacks it sent"),
    (lambda raw: raw["stacks"].__setitem__(0, "[[0, 1]]"), "a frame is not"),
    (lambda raw: raw.update(ranks={}), "no stacks and ranks"),
])
def test_a_hostile_answer_is_refused_with_what_was_wrong(change, said):
    with pytest.raises(gathered.Bad) as caught:
        _read(_broken(change))
    assert said in str(caught.value), str(caught.value)
