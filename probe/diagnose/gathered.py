"""``probe diagnose``'s evidence through the node helpers: one request a node a look, answered compactly.

Directly, a look costs the client some 8-13 requests a rank (the stacks, the straggler's samples, the
queries), each over TCP with its handshake, and the rules' evidence parsed rank by rank. Through the node
helpers the client sends one ``POST /v1/gather`` ``{"op": "evidence"}`` to each node's helper; the helper
runs :func:`probe.diagnose.gather.collect` for each of its ranks over their unix sockets (so every rule
reads what it reads directly, a rank that cannot answer read from outside on its own node), and answers
with :func:`encode`: each distinct stack once (the ranks of a job share most of their frames), each rank's
threads pointing into that list, the rest of its evidence as it is. The client reads each distinct stack
text once however many nodes send it (:func:`decode`).

Times cross machines as ages: a look's ``at`` and the RSS readings are sent as seconds before the answer,
and set on this machine's clock as they arrive. A helper keeps its ranks' readings between looks (as the
node's watch does): ``since_s`` asks only for those of this diagnosis (the seconds before the request
came; 0 at a first look).
"""

import hashlib
import json
import threading
import time
from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from probe.client.fanout import MAX_OPEN
from probe.client.results import Frame

__all__ = ["encode", "decode", "Bad", "AUTO_ABOVE", "through_helpers", "sample", "Frames"]

AUTO_ABOVE = 32
"""``--via auto`` gathers diagnose's evidence through the node helpers for more ranks than this: a look
costs 8-13 requests a rank directly, so the helpers pay off far sooner than for one backtrace or query
(``probe.client.via_helpers.AUTO_ABOVE``)."""

_MAX_TEXT = 4096
_MAX_FRAMES = 4096
_FIELDS = ("pid", "state", "why", "source", "holder", "holder_id", "threads", "threads_why", "fr", "fr_why",
           "fr_copy", "trace", "trace_why", "training", "memory", "steps", "steps_why", "paths", "locks", "seconds")
_TYPES: Dict[str, Tuple[type, ...]] = {
    "pid": (int, type(None)), "state": (str,), "why": (str,), "source": (str,), "holder": (str, type(None)),
    "holder_id": (int, type(None)), "threads": (list, type(None)), "threads_why": (str, type(None)),
    "fr": (list, type(None)), "fr_why": (str, type(None)), "fr_copy": (dict, type(None)), "trace": (dict, type(None)),
    "trace_why": (str, type(None)), "training": (dict, type(None)), "memory": (dict, type(None)),
    "steps": (list, type(None)), "steps_why": (str, type(None)), "paths": (list, type(None)),
    "locks": (list, type(None)), "seconds": (int, float), "prefetching": (bool,)}


class Bad(Exception):
    """A helper's evidence failed a check: what was wrong."""


def through_helpers(cluster: Any) -> bool:
    """Whether a look goes through the node helpers: ``--via helpers``, or ``auto`` past ``AUTO_ABOVE``
    ranks where every rank has a helper (a job found through its master's helper)."""
    from probe.client import via_helpers

    via = getattr(cluster, "via", "auto")
    if via == "helpers":
        return via_helpers.through_helpers(cluster)  # UsageError where a rank has no helper
    every = bool(cluster.members) and all(m.helper and m.pid is not None for m in cluster.members)
    return via == "auto" and every and len(cluster.members) > AUTO_ABOVE


# -- the helper's side ------------------------------------------------------------------------------


def encode(evs: Sequence[Any], keep_after: Optional[float], known: Any = frozenset()) -> Dict[str, Any]:
    """A node's evidence (``RankEvidence`` of each rank) as JSON: ``{"stacks": [TEXT, ...], "ranks":
    [{...}]}``, a stack's TEXT the JSON of ``[[depth, func, file, line, code, frame_type], ...]`` and each
    rank's ``frames`` ``[[thread_id, thread_name, native_id, is_main, STACK], ...]`` (STACK an index into
    ``stacks``); the straggler's main-thread samples are indexes too. ``keep_after``: RSS readings taken
    before this (``time.monotonic()``) are left out. ``known``: the digests (:func:`digest`) of the stacks
    the client holds already: those are sent as ``#DIGEST`` instead of their text."""
    now = time.monotonic()
    texts: Dict[str, int] = {}

    def ref(key: Tuple[Any, ...], make: Any) -> int:
        """The index of a stack's text, its text made once per distinct stack (``key``: its frames as
        tuples) and kept across gathers: a node's ranks show the same stacks, look after look."""
        text = _TEXTS.get(key)
        if text is None:
            if len(_TEXTS) >= _MAX_TEXTS:
                _TEXTS.clear()
            text = _TEXTS[key] = json.dumps(make(key), default=str)
        at = texts.get(text)
        if at is None:
            at = texts[text] = len(texts)
        return at

    ranks = []
    for ev in evs:
        out: Dict[str, Any] = {"rank": ev.rank, "age": round(now - ev.at, 4)}
        for name in _FIELDS:
            value = getattr(ev, name)
            if value is not None and value != "":
                out[name] = value
        if ev.prefetching:
            out["prefetching"] = True
        if ev.frames is not None:
            threads: Dict[int, List[Any]] = {}
            heads: List[Any] = []
            for f in ev.frames:
                stack = threads.get(f.thread_id)
                if stack is None:
                    stack = threads[f.thread_id] = []
                    heads.append([f.thread_id, f.thread_name, f.native_id, f.is_main, stack])
                stack.append(f[4:])  # depth, func, file, line, code, frame_type
            out["frames"] = [[t, n, native, main, ref(tuple(stack), _as_lists)] for t, n, native, main, stack in heads]
        if isinstance(ev.training, dict) and isinstance(ev.training.get("main_samples"), list):
            out["training"] = dict(ev.training, main_samples=[  # [func, file, line, code] frames, as a stack
                ref(("sample",) + tuple(tuple(f[:4]) for f in sample), _sample_lists)
                for sample in ev.training["main_samples"]])
        if isinstance(ev.memory, dict) and isinstance(ev.memory.get("readings"), list):
            readings = [[round(now - t, 4), rss] for t, rss in ev.memory["readings"]
                        if keep_after is None or t >= keep_after]
            out["memory"] = dict(ev.memory, readings=readings)
        ranks.append(out)
    return {"stacks": [_named_by_digest(text, known) for text in texts], "ranks": ranks}


_TEXTS: Dict[Tuple[Any, ...], str] = {}  # a stack's frames -> its JSON text (encode)
_MAX_TEXTS = 1024
_DIGESTS: Dict[str, str] = {}  # a stack's JSON text -> its digest (encode)
MAX_KNOWN = 64
"""Digests of stacks a client names as held in one request (the most recent): a job's ranks share a few
stacks a thread, and each name costs the request 19 bytes."""


def digest(text: str) -> str:
    """A stack text's short name: 16 hex digits of its BLAKE2b hash (a helper naming a stack the client holds
    by it says no more than by its text, which it could send as well)."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def _named_by_digest(text: str, known: Any) -> str:
    if not known:
        return text
    name = _DIGESTS.get(text)
    if name is None:
        if len(_DIGESTS) >= _MAX_TEXTS:
            _DIGESTS.clear()
        name = _DIGESTS[text] = digest(text)
    return "#" + name if name in known else text


def _as_lists(key: Tuple[Any, ...]) -> List[List[Any]]:
    return [list(f) for f in key]


def _sample_lists(key: Tuple[Any, ...]) -> List[List[Any]]:
    return [[depth] + list(f) + ["python"] for depth, f in enumerate(key[1:])]


# -- the client's side ------------------------------------------------------------------------------


def decode(raw: Any, asked: Dict[int, Any], known: Dict[str, Any], arrived: float, evidence: Any) -> List[Any]:
    """The ``RankEvidence`` of one helper's answer (:func:`encode`), checked as it is read: ranks it was
    asked about, once each; stacks and frames of bounded types and sizes; each field of its type. ``known``:
    stack text -> its frames, shared across the helpers of one look. ``arrived``: this machine's monotonic
    time when the answer came. ``evidence``: the module ``probe.diagnose.gather``, which calls this and
    passes itself (imported here it would make a circle). :class:`Bad` says what was wrong."""
    STATES, RankEvidence = evidence.STATES, evidence.RankEvidence

    if not isinstance(raw, dict) or not isinstance(raw.get("stacks"), list) or not isinstance(raw.get("ranks"), list):
        raise Bad("the evidence has no stacks and ranks")
    stacks = [_stack(text, known) for text in raw["stacks"]]
    keys = [_key_once(stack, known) for stack in stacks]
    out: List[Any] = []
    seen = set()
    samples: List[Any] = [None] * len(stacks)  # each stack as a straggler's sample, made once an answer
    for item in raw["ranks"]:
        if not isinstance(item, dict):
            raise Bad("a rank's evidence is not an object")
        rank = item.get("rank")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank not in asked or rank in seen:
            raise Bad("it sent evidence of rank %s, which it was not asked about (or twice)" % ascii(rank)[:40])
        seen.add(rank)
        age = item.get("age")
        if not isinstance(age, (int, float)) or isinstance(age, bool) or not 0 <= age < 1e6:
            raise Bad("rank %d's evidence has no age" % rank)
        values: Dict[str, Any] = {}
        for name, value in item.items():  # the fields it sent (a rank's are a few of _FIELDS), not all of _FIELDS
            types = _TYPES.get(name)
            if types is None:
                continue  # rank, age, frames: read below; any other is not ours to read
            if type(value) not in types:  # JSON's own types, exactly: true is not a number here
                raise Bad("rank %d's %s is not of its type" % (rank, name))
            values[name] = value
        if values.get("state", "answering") not in STATES:
            raise Bad("rank %d's state is not one of %s" % (rank, ", ".join(STATES)))
        member = asked[rank]
        ev = RankEvidence(rank, member.host, **values)
        ev.at = arrived - age
        if "frames" in item:
            ev.frames = _frames(item["frames"], stacks, rank)
            evidence.keep_named(ev, _named(item["frames"], keys))
        if isinstance(ev.training, dict) and "main_samples" in ev.training:
            ev.training = dict(ev.training, main_samples=_samples(ev.training["main_samples"], stacks, samples,
                                                                  known, rank))
        if isinstance(ev.memory, dict) and "readings" in ev.memory:
            readings = ev.memory["readings"]
            if not isinstance(readings, list) or not all(
                    isinstance(r, list) and len(r) == 2 and isinstance(r[0], (int, float)) for r in readings):
                raise Bad("rank %d's RSS readings are not [age, bytes] pairs" % rank)
            ev.memory = dict(ev.memory, readings=[(arrived - a, rss) for a, rss in readings])
        if isinstance(ev.training, dict) and isinstance(ev.training.get("worker_stacks"), dict):
            ev.training = dict(ev.training, worker_stacks={
                pid: None if not isinstance(stack, list) else [tuple(f) for f in stack if isinstance(f, list)]
                for pid, stack in ev.training["worker_stacks"].items()})
        out.append(ev)
    return out


def _stack(text: Any, known: Dict[str, Any]) -> Any:
    """A stack's frames (``(depth, func, file, line, code, frame_type)``, innermost first) and its key as
    ``RankEvidence.stacks`` gives it, read and checked once per distinct text; ``#DIGEST``: one this client
    holds (:func:`encode`'s ``known``)."""
    if not isinstance(text, str) or len(text) > _MAX_FRAMES * 2 * _MAX_TEXT:
        raise Bad("a stack is not the JSON text of its frames")
    got = known.get(text)
    if got is not None:
        return got
    if text.startswith("#"):
        raise Bad("it named a stack by a digest this client does not hold")
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError):
        raise Bad("a stack is not the JSON text of its frames") from None
    if not isinstance(raw, list) or len(raw) > _MAX_FRAMES:
        raise Bad("a stack is not a list of at most %d frames" % _MAX_FRAMES)
    frames = []
    for f in raw:
        if not (isinstance(f, list) and len(f) == 6 and type(f[0]) is int and isinstance(f[1], str)
                and isinstance(f[2], str) and type(f[3]) is int and (f[4] is None or isinstance(f[4], str))
                and isinstance(f[5], str) and max(len(f[1]), len(f[2]), len(f[4] or ""), len(f[5])) <= _MAX_TEXT):
            raise Bad("a frame is not [depth, func, file, line, code, frame_type]")
        frames.append(tuple(f))
    got = known[text] = tuple(frames)
    hold(text, got, known)
    return got


_HELD: "OrderedDict[str, Any]" = OrderedDict()  # "#DIGEST" -> a stack's frames, read from a helper's answer
_MAX_HELD = 1024
_held_lock = threading.Lock()


def hold(text: str, frames: Any, known: Dict[str, Any]) -> None:
    """Keep a stack read in full under its digest, for this look (``known``) and the next ones (``_HELD``):
    the next requests name it as held, and the helpers send its digest instead of its text."""
    name = "#" + digest(text)
    known[name] = frames
    with _held_lock:
        _HELD.pop(name, None)
        _HELD[name] = frames
        while len(_HELD) > _MAX_HELD:
            _HELD.popitem(last=False)


def held() -> Dict[str, Any]:
    """The stacks this process holds by digest (``"#DIGEST"`` -> frames), the most recent last."""
    with _held_lock:
        return dict(_HELD)


def _key_once(stack: Any, known: Dict[Any, Any]) -> Any:
    """:func:`_key` of a stack, made once however many nodes send it, look after look (a stack held by its
    digest is the same object at every look: so is its key, and the rules compare two looks' stacks by
    identity before they compare them frame by frame)."""
    return _once(_KEYS, stack, _key)


_KEYS: Dict[int, Tuple[Any, Any]] = {}  # id(stack) -> (the stack, kept alive while its id is a key; its key)
_SAMPLES: Dict[int, Tuple[Any, Any]] = {}  # the same, for the straggler's samples
_SAMPLE_LISTS: Dict[Tuple[int, ...], List[Any]] = {}  # the ids of a rank's samples -> one list of them
_MAX_ONCE = 4096


def _once(memo: Dict[int, Tuple[Any, Any]], stack: Any, make: Any) -> Any:
    got = memo.get(id(stack))
    if got is not None and got[0] is stack:
        return got[1]
    value = make(stack)
    if len(memo) >= _MAX_ONCE:
        memo.clear()
    memo[id(stack)] = (stack, value)
    return value


def _key(stack: Any) -> Any:
    """(whether it has Python frames, its key as ``RankEvidence.stacks`` gives it): func, file, line, code."""
    python = sorted((f for f in stack if f[5] == "python"), key=lambda f: f[0])
    return bool(python), tuple((f[1], f[2], f[3], (f[4] or "").strip()) for f in python)


def _named(threads: List[Any], keys: List[Any]) -> List[Any]:
    """``RankEvidence._named`` of a rank's threads, from each distinct stack's key read once (the same order
    and names: main first, then by name and id; threads that share a name get #2...)."""
    out = []
    taken = set()
    for ident, name, _, is_main, at in sorted(threads, key=lambda t: (not t[3], t[1] or "", t[0])):
        has_python, key = keys[at]
        if not has_python:
            continue
        name = "MainThread" if is_main else (name or "?")
        unique, n = name, 1
        while unique in taken:
            n += 1
            unique = "%s#%d" % (name, n)
        taken.add(unique)
        out.append((unique, ident, key))
    return out


def _samples(refs: Any, stacks: List[Any], made: List[Any], known: Dict[Any, Any], rank: int) -> List[Any]:
    """A rank's main-thread samples from their indexes into the answer's ``stacks`` (``made``: each index's
    sample, once made)."""
    if not isinstance(refs, list):
        raise Bad("rank %d's main-thread samples are not stacks it sent" % rank)
    out = []
    for i in refs:
        if type(i) is not int or not 0 <= i < len(stacks):
            raise Bad("rank %d's main-thread samples are not stacks it sent" % rank)
        got = made[i]
        if got is None:
            got = made[i] = _sample(stacks[i], known)
        out.append(got)
    # Ranks whose samples are the same stacks share one list (read only), as they share the stacks: the
    # straggler rule then reads each distinct set once, not once a rank (16k ranks, a few distinct sets).
    # The list holds its samples, so the ids of its key stay theirs while it is kept.
    key = tuple(map(id, out))
    shared = _SAMPLE_LISTS.get(key)
    if shared is not None:
        return shared
    if len(_SAMPLE_LISTS) >= _MAX_ONCE:
        _SAMPLE_LISTS.clear()
    _SAMPLE_LISTS[key] = out
    return out


def _sample(stack: Any, known: Dict[Any, Any]) -> Any:
    """A straggler's sample, ``(func, file, line, code)`` frames, one object for every rank that has it."""
    return _once(_SAMPLES, stack, lambda frames: tuple((f[1], f[2], f[3], f[4]) for f in frames))


class Frames(Sequence[Frame]):
    """A rank's frames, made only when read: the rules read each distinct stack's key, made once for every
    rank (:func:`_named`), so that most ranks' frames (some 40 ``Frame`` a rank, 600,000 a look at 16k
    ranks) are never made at all. Reads as the list it stands for."""

    __slots__ = ("_threads", "_n", "_made")

    def __init__(self, threads: List[Tuple[Tuple[Any, ...], Tuple[Any, ...]]]) -> None:
        self._threads = threads  # [(thread_id, name, native_id, is_main), stack's frames], checked
        self._n = sum(len(stack) for _, stack in threads)
        self._made: Optional[List[Frame]] = None

    def _list(self) -> List[Frame]:
        if self._made is None:
            new = tuple.__new__
            self._made = [new(Frame, head + f) for head, stack in self._threads for f in stack]
        return self._made

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        return self._list()[i]

    def __iter__(self) -> Iterator[Frame]:
        return iter(self._list())

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, (list, Frames)) and list(self) == list(other)

    def __repr__(self) -> str:
        return repr(self._list())


def _frames(raw: Any, stacks: List[Any], rank: int) -> Frames:
    if not isinstance(raw, list):
        raise Bad("rank %d's frames are not a list" % rank)
    out: List[Tuple[Tuple[Any, ...], Tuple[Any, ...]]] = []
    ids = set()
    n = len(stacks)
    for thread in raw:  # JSON's own types, checked exactly (type() is): 3 threads a rank, 16k ranks a look
        if type(thread) is not list or len(thread) != 5:
            raise Bad("rank %d's thread is not [id, name, native id, is main, stack]" % rank)
        ident, name, native, is_main, at = thread
        if not (type(ident) is int and (name is None or type(name) is str and len(name) <= _MAX_TEXT)
                and (native is None or type(native) is int) and type(is_main) is bool
                and type(at) is int and 0 <= at < n):
            raise Bad("rank %d's thread is not [id, name, native id, is main, stack]" % rank)
        if ident in ids:
            raise Bad("rank %d has two threads of id %d" % (rank, ident))
        ids.add(ident)
        out.append(((ident, name, native, is_main), stacks[at]))
    return Frames(out)


def sample(chosen: Any, since_s: Optional[float], evidence: Any, early: Any = (),
           arrived: Any = None) -> Tuple[Dict[int, Any], List[Any]]:
    """One look at ``chosen``'s ranks through their node helpers: (rank -> evidence, the failures of the
    ranks that gave none). A helper that cannot gather (an older one) has its ranks looked at directly.
    ``evidence``: the module ``probe.diagnose.evidence`` (see :func:`decode`). ``early``: the ranks whose
    straggler samples are taken ahead of the look (``"ahead"``, each helper told of its own). ``arrived``:
    called with each helper's evidence as it comes, while the others are waited for (it must not raise)."""
    from probe.client import via_helpers
    from probe.client.members import RankFailure

    op: Dict[str, Any] = {"op": "evidence", "since_s": round(min(max(since_s or 0.0, 0.0), 600.0), 3)}
    if since_s is None:  # a first look: the helpers take the next look's straggler samples right after it
        op["prefetch"] = True
    # Every helper's answer takes a while (the straggler rule's samples, 80 ms apart, on each of its ranks):
    # all of them asked at once, up to the fan-out's bound on open requests.
    helpers = len({m.helper for m in chosen.members})
    known: Dict[str, Any] = held()  # stack text or "#DIGEST" -> its frames: this look's, and those held before
    names: List[Any] = [-1, []]  # (len(known) when made, the digests a request names)

    def own(members: List[Any]) -> Dict[str, Any]:
        """Its ranks that sample ahead; the stacks held so far (this look's requests are made as earlier
        answers come: the later ones name what the earlier ones sent)."""
        out: Dict[str, Any] = {"ahead": [m.rank for m in members if m.rank in early]} if early else {}
        if len(known) != names[0]:  # it grows only where a new stack was read: a few times a look
            try:
                names[:] = [len(known), [k[1:] for k in list(known) if k[:1] == "#"][-MAX_KNOWN:]]
            except RuntimeError:  # read by another thread's answer meanwhile (the TLS path): the names made before
                pass
        if names[1]:
            out["known"] = names[1]
        return out

    def read(members: List[Any], raw: Any) -> Any:
        """A helper's answer read as it came, while the others are waited for (``known`` is shared: a stack
        read twice at once is read twice, both alike): (its evidence, its failures), or what was wrong."""
        arrived_at = time.monotonic()
        asked = {m.rank: m for m in members}
        try:
            got = (decode(raw.get("evidence"), asked, known, arrived_at, evidence),
                   via_helpers.helper_failures(raw.get("failed", []), asked))
            if arrived is not None:
                arrived(got[0])
            return got
        except (Bad, via_helpers.BadAnswer) as exc:
            return str(exc)
        except Exception as exc:  # noqa: BLE001 -- a surprise in the reading: this helper's ranks, with why
            return "its evidence could not be read (%s: %s)" % (type(exc).__name__, str(exc)[:200])

    answered, direct, failures = via_helpers.ask_helpers(chosen, op, max(chosen.max_in_flight, min(helpers, MAX_OPEN)),
                                                         own, read)
    ranks: Dict[int, Any] = {}
    for members, got in answered:
        helper = str(members[0].helper)
        if isinstance(got, str):
            failures.extend(via_helpers.unusable(members, helper, got))
            continue
        evs, failed = got
        for ev in evs:
            ranks[ev.rank] = ev
        for member in members:
            if member.rank in ranks:
                continue
            failures.append(failed.get(member.rank) or RankFailure(
                member.rank, member.host, "internal", "its node helper at %s said nothing of it" % helper, 1))
    if direct:
        sub = chosen.plain(direct)
        by_client = {id(c): m for m, c in zip(sub.members, sub.clients)}
        for answer in sub.map(lambda c: evidence.collect(c, by_client[id(c)].rank, by_client[id(c)].host,
                                                         by_client[id(c)].pid, by_client[id(c)].state,
                                                         by_client[id(c)].rank in early)):
            ranks[answer.member.rank] = answer.value
        failures.extend(sub.failures)
    return ranks, failures
