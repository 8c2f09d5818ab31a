"""A bound on what a record or a dump, once parsed, may hold: how deep, how many values, how big an integer.

A file read from a shared directory is hostile. JSON and a plain pickle can only build containers and
scalars, yet a few hundred bytes of pickle can name one list from many places, again and again (a
"billion laughs": each level doubles what every later walk over it visits), and a list nested a million
deep or an integer of 200,000 digits ends the first recursive walk or text conversion in a traceback.
:func:`check` walks a parsed value once, without recursion, counting each shared container once but
weighing it as often as it is named (what later walks will visit), and says what is wrong, or None.
"""

import itertools
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

__all__ = ["MAX_DEPTH", "MAX_WEIGHT", "MAX_INT_BITS", "check"]

MAX_DEPTH = 64
"""Containers inside containers at most (a record nests some 10 deep; torch's dump 6)."""
MAX_WEIGHT = 20_000_000
"""Values at most, counted as every walk over the whole will meet them (a shared list each time it is
named), a string as one value per 256 characters: a 2000-entry dump with its stacks weighs well under 1M."""
MAX_INT_BITS = 128
"""An integer of more bits is no sequence number, time or size (torch's are 64-bit)."""

_CONTAINERS = (dict, list, tuple, set, frozenset)
_TYPES = frozenset(_CONTAINERS)  # JSON and a plain pickle build these exact types: a set lookup is quicker
_TEXTS = frozenset((str, bytes, bytearray))


def _children(value: Any) -> Iterable[Any]:
    if isinstance(value, dict):
        return itertools.chain.from_iterable(value.items())
    return value


def _big_int(value: Any, max_int_bits: int) -> Optional[str]:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > max_int_bits:
        return "it holds an integer of %d bits (more than %d)" % (value.bit_length(), max_int_bits)
    return None


def check(value: Any, max_depth: int = MAX_DEPTH, max_weight: int = MAX_WEIGHT,
          max_int_bits: int = MAX_INT_BITS) -> Optional[str]:
    """Why ``value`` (containers and scalars, as JSON or a plain pickle build them) is too much to read, in a
    few words; None where it is within the bounds. Linear in the values it holds, each shared container
    walked once."""
    if type(value) not in _TYPES:
        return _big_int(value, max_int_bits)
    weights: Dict[int, int] = {}  # id of a container walked whole -> what it weighs, shared uses included
    open_: Set[int] = set()  # ids of the containers on the path from the top to the one being walked
    stack: List[Tuple[Any, int, bool]] = [(value, 0, False)]
    while stack:
        item, depth, finished = stack.pop()
        key = id(item)
        if finished:
            total = 1
            for child in _children(item):
                kind = type(child)
                if kind in _TYPES:
                    total += weights[id(child)]
                elif kind in _TEXTS:
                    total += 1 + len(child) // 256
                else:
                    total += 1
            if total > max_weight:
                return "it expands to more than %d values (lists named again and again)" % max_weight
            weights[key] = total
            open_.discard(key)
            continue
        if key in weights:
            continue
        if key in open_:
            return "a container holds itself"
        if depth >= max_depth:
            return "it nests more than %d levels deep" % max_depth
        open_.add(key)
        stack.append((item, depth, True))
        for child in _children(item):
            kind = type(child)
            if kind in _TYPES:
                stack.append((child, depth + 1, False))
            elif kind is int and child.bit_length() > max_int_bits:
                return _big_int(child, max_int_bits)
    return None
