"""The CPython version of an executable, read from its file: never by running it.

``probe list`` and ``inject`` run as root on shared hosts; a process that calls itself python may be
any user's binary, and executing it (``/proc/PID/exe -c ...``) would run that user's code as root.
So the version comes from the file's bytes: the ``Py_Version`` constant that CPython 3.11+ exports
(``PY_VERSION_HEX``), else the ``PY_VERSION`` string (``"3.10.13"``) in its read-only data.
"""

import mmap
import re
import struct
from typing import Iterator, Optional, Tuple

__all__ = ["python_version_of", "build_id", "has_debug_info"]

# The linker may merge "3.10.13" into the tail of a longer string ("/usr/lib/python/3.10.13").
_VERSION_STRING = re.compile(rb"(?<![0-9.])(3)\.(\d{1,2})\.\d{1,2}(?:(?:a|b|rc)\d{1,2})?\+?\x00")
_SYMBOL = b"Py_Version"


def python_version_of(path: str) -> Optional[Tuple[int, int]]:
    """(major, minor) of the CPython in the ELF file at ``path``; None when it cannot be told."""
    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _from_symbol(data) or _from_string(data)
    except (OSError, ValueError, struct.error):
        return None


def _from_symbol(data: "mmap.mmap") -> Optional[Tuple[int, int]]:
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:  # 64-bit little-endian only
        return None
    sections = list(_sections(data))
    for _name_index, kind, _addr, offset, size, link, entsize in sections:
        if kind not in (2, 11) or entsize != 24:  # SHT_SYMTAB, SHT_DYNSYM
            continue
        strings = sections[link]
        value = _find_symbol(data, offset, size, strings[3])
        if value is None:
            continue
        for _n, skind, addr, soffset, ssize, _l, _e in sections:
            if skind != 8 and addr and addr <= value < addr + ssize:  # not SHT_NOBITS
                (hexversion,) = struct.unpack_from("<I", data, soffset + value - addr)
                major, minor = hexversion >> 24 & 0xFF, hexversion >> 16 & 0xFF
                return (major, minor) if major == 3 else None
    return None


def build_id(path: str) -> Optional[str]:
    """The GNU build id of the ELF file at ``path`` (hex), None when it has none or cannot be read."""
    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
                return None
            for _name_index, kind, _addr, offset, size, _link, _entsize in _sections(data):
                if kind != 7:  # SHT_NOTE
                    continue
                at = offset
                while at + 12 <= offset + size:
                    namesz, descsz, note_type = struct.unpack_from("<III", data, at)
                    name_at = at + 12
                    desc_at = name_at + (namesz + 3) // 4 * 4
                    if note_type == 3 and data[name_at:name_at + namesz] == b"GNU\x00":  # NT_GNU_BUILD_ID
                        return data[desc_at:desc_at + descsz].hex() or None
                    at = desc_at + (descsz + 3) // 4 * 4
    except (OSError, ValueError, struct.error):
        return None
    return None


def has_debug_info(path: str) -> bool:
    """True when the ELF file at ``path`` carries DWARF (a ``.debug_info`` section with contents); True
    too when that cannot be told."""
    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
                return True
            sections = list(_sections(data))
            (names_index,) = struct.unpack_from("<H", data, 0x3E)
            names = sections[names_index][3]
            for name_index, kind, _addr, _offset, size, _link, _entsize in sections:
                name = data[names + name_index:names + name_index + 12]
                if name.startswith((b".debug_info\x00", b".zdebug_info")) and kind != 8 and size:
                    return True
            return False
    except (OSError, ValueError, IndexError, struct.error):
        return True


def _sections(data: "mmap.mmap") -> Iterator[Tuple[int, int, int, int, int, int, int]]:
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    for i in range(shnum):
        name, kind, _flags, addr, offset, size, link, _info, _align, entsize = struct.unpack_from(
            "<IIQQQQIIQQ", data, shoff + i * shentsize)
        yield name, kind, addr, offset, size, link, entsize


def _find_symbol(data: "mmap.mmap", offset: int, size: int, strtab: int) -> Optional[int]:
    wanted = _SYMBOL + b"\x00"
    for name, _info, _other, _shndx, value, _size in struct.iter_unpack("<IBBHQQ", data[offset:offset + size]):
        if name and data[strtab + name:strtab + name + len(wanted)] == wanted:
            return value
    return None


def _from_string(data: "mmap.mmap") -> Optional[Tuple[int, int]]:
    found = {(int(m.group(1)), int(m.group(2))) for m in _VERSION_STRING.finditer(data)}
    return found.pop() if len(found) == 1 else None
