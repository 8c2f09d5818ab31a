"""The objects the garbage collector tracks, of the types a table asks for, found without ever letting the
program run while an unfinished tuple of its own is held by us.

Why not a loop over ``gc.get_objects()``: that list holds a reference to every tracked object, among them a
tuple that another thread may still be filling. ``tuple(generator)`` makes the tuple first and shrinks it
to size at the end, which CPython refuses when anything else holds it (``SystemError: bad argument to
internal function``). A Python loop over the list lets the program's threads run between its bytecodes:
a rank importing torch._dynamo under Lightning died so while the agent looked for its trainer.

Here the list lives only inside C calls: it is made, read and let go by iterators that run no bytecode,
with the collector off, so that no finaliser runs either. Python code sees only the types first, then
only the objects of the chosen types (never a plain tuple). The cost: the program is held for two passes
in C over every tracked object, about 0.19 s at a million objects where the old loop held it 15 ms at a
time (``bench/bench_tracked.py``). The tables that scan do so only when asked, or when a trainer is
looked for and is in no frame.
"""

import gc
from itertools import chain, compress, islice, repeat
from typing import Any, Callable, Iterator, List, Set

__all__ = ["tracked_of", "tracked_types"]


def _every_object() -> Iterator[Any]:
    """Every tracked object: the collector's list is made at the first ``next`` and let go, inside C, when
    its last object has been read."""
    return chain.from_iterable(islice(iter(gc.get_objects, None), 1))  # gc.get_objects() once, when first asked


def _each_twice() -> Iterator[Any]:
    """Every tracked object twice in a row (o0, o0, o1, o1, ...), for two readers that take turns. Not
    ``itertools.tee``: its buffers are tracked objects made before the list, so the list holds the first
    one, which leads to all the others, and a cycle kept every object alive after the pass."""
    return chain.from_iterable(map(repeat, _every_object(), repeat(2)))


def tracked_types() -> Set[type]:
    """The type of every object the collector tracks (one pass in C; the set is made afterwards, in Python,
    since a metaclass may hash its classes in Python)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        types = list(map(type, _every_object()))
    finally:
        if enabled:
            gc.enable()
    return set(types)


def tracked_of(wanted: Callable[[type], bool]) -> List[Any]:
    """Every tracked object whose type ``wanted`` accepts (asked once a type, in Python, while no object is
    held); never a plain tuple. An error ``wanted`` raises for a type counts as "no"."""
    chosen = set()
    for cls in tracked_types():
        if cls is tuple:
            continue
        try:
            if wanted(cls):
                chosen.add(id(cls))
        except Exception:  # a class whose attributes raise: not one of ours
            continue
    if not chosen:
        return []
    enabled = gc.isenabled()
    gc.disable()
    try:
        objects = _each_twice()  # compress reads its datum, then its selector: the same object each turn
        return list(compress(objects, map(chosen.__contains__, map(id, map(type, objects)))))
    finally:
        if enabled:
            gc.enable()
