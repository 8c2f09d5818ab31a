"""Where CPython's ``_PyRuntime`` and ``Py_Version`` lie in a live process, for ``probe.reader.memory``.

The interpreter is the mapped ``libpython3.*.so`` where there is one (pyenv's and most source builds), else
the executable itself (Debian's and Ubuntu's ``/usr/bin/python3.*``, conda's, python-build-standalone's:
libpython linked in statically). Both symbols are looked for in the file's dynamic symbols (``.dynsym``,
which an interpreter built to load C extensions exports), then in its full symbol table (``.symtab``, where
it was linked without ``--export-dynamic`` and not stripped). The address in the process is the mapping of
the file's first segment (file offset 0, from ``/proc/PID/maps``) less that segment's address in the file:
0 for a shared library or a PIE executable (mapped anywhere), its fixed address for a non-PIE one (mapped
there), so both cases are the same sum.

The file is the target's to choose: it must be a regular file (a FIFO would block the read) under
``MAX_ELF``, the one mapped (device and inode), with ELF64 headers of the usual sizes and symbol tables
under ``MAX_TABLE``. An executable replaced since the process started (``(deleted)`` in its maps: a package
upgrade) is read through ``/proc/PID/exe``, which still names the file mapped.

The offsets are kept per file (path, device, inode, size, mtime) in ``CACHE_NAME`` in probe's runtime
directory (the user's own, owner-only); what is read back is checked as anything from the target is, and a
line that does not parse is ignored. Imports only ``os`` (``struct`` where the offsets are not kept yet).
"""

from __future__ import annotations

import os

from probe._private_file import replace_private

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, Optional, Tuple

__all__ = ["locate", "Refused", "CACHE_NAME"]

CACHE_NAME = "elf-symbols"
MAX_ELF = 1 << 30
"""The largest file taken for an interpreter (a libpython is some 20 MiB; a static python with debug
information a few hundred)."""
MAX_TABLE = 64 << 20
"""The largest symbol or string table read (more than any interpreter's)."""
MAX_CACHE = 1 << 16
WANTED = (b"_PyRuntime", b"Py_Version")
_DELETED = " (deleted)"


class Refused(Exception):
    """Why the symbols were not found, in words for the user (the memory reader's reason)."""


def locate(pid: int, runtime_dir: Optional[str]) -> Tuple[int, int]:
    """(address of ``_PyRuntime``, address of ``Py_Version``) in ``pid``. Raises ``Refused`` or ``OSError``."""
    path, start, device, inode, exe = _interpreter_file(pid)
    source = "/proc/%d/exe" % pid if exe and path.endswith(_DELETED) else path
    info = os.stat(source)
    if info.st_mode & 0o170000 != 0o100000 or info.st_size > MAX_ELF:
        raise Refused("its interpreter %s is no regular file of an interpreter's size" % path)
    if (os.major(info.st_dev), os.minor(info.st_dev), info.st_ino) != device + (inode,):
        raise Refused("its interpreter %s is not the file it mapped (replaced, or in another mount namespace)" % path)
    key = "%s\0%d\0%d\0%d\0%d" % (path, info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
    offsets = _cached(runtime_dir, key)
    if offsets is None:
        offsets = _symbols(source, path)
        _remember(runtime_dir, key, offsets)
    base, runtime, version = offsets
    return start - base + runtime, start - base + version


def _interpreter_file(pid: int) -> Tuple[str, int, Tuple[int, int], int, bool]:
    """(path, start of its mapping at file offset 0, device, inode, whether it is the executable) of the
    mapped libpython, else of the executable."""
    exe = os.readlink("/proc/%d/exe" % pid)
    chosen = None
    with open("/proc/%d/maps" % pid, "rb") as handle:
        for count, raw in enumerate(handle):
            if count > 1 << 20:
                break  # more mappings than a process may have (vm.max_map_count is 65530 by default)
            fields = raw.split(None, 5)
            if len(fields) < 6 or int(fields[2], 16) != 0:
                continue
            path = fields[5].rstrip(b"\n").decode("utf-8", "surrogateescape")
            name = path.rsplit("/", 1)[-1]
            shared = name.startswith("libpython3.") and ".so" in name
            if shared or (path == exe and chosen is None):
                major, minor = fields[3].split(b":")
                chosen = (path, int(fields[0].split(b"-")[0], 16), (int(major, 16), int(minor, 16)), int(fields[4]),
                          not shared)
                if shared:
                    return chosen
    if chosen is None:
        raise Refused("neither a libpython nor its executable %s is mapped in it" % exe)
    return chosen


def _symbols(source: str, path: str) -> Tuple[int, int, int]:
    """(address of the segment at file offset 0, ``_PyRuntime``'s, ``Py_Version``'s) in the file."""
    import struct  # only where the offsets are not kept yet: its C module is a shared object to load

    try:
        with open(source, "rb") as handle:
            found = _elf_symbols(handle, struct)
    except (struct.error, ValueError, IndexError):
        found = None  # cut short, or headers that point outside the file
    if isinstance(found, str):
        raise Refused("%s %s" % (path, found))
    if found is None:
        raise Refused("%s is no 64-bit little-endian ELF file that probe reads" % path)
    return found


def _elf_symbols(handle: Any, struct: Any) -> Any:
    """The offsets, or words saying which symbol is missing, or None (not an ELF file taken here)."""
    head = handle.read(64)
    if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
        return None  # 64-bit little-endian only
    phoff, shoff = struct.unpack_from("<QQ", head, 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 54)
    if phentsize != 56 or shentsize != 64:
        return None
    handle.seek(phoff)
    base = None
    for fields in struct.iter_unpack("<IIQQQQQQ", handle.read(phentsize * phnum)):
        if fields[0] == 1 and fields[2] == 0:  # PT_LOAD at file offset 0
            base = fields[3]
            break
    handle.seek(shoff)
    sections = list(struct.iter_unpack("<IIQQQQIIQQ", handle.read(shentsize * shnum)))
    if base is None:
        return None
    found: Dict[bytes, int] = {}
    for kind in (11, 2):  # SHT_DYNSYM, then SHT_SYMTAB
        table = next((s for s in sections if s[1] == kind), None)
        if table is None or not 0 <= table[6] < len(sections):
            continue
        strings = sections[table[6]]
        if max(strings[5], table[5]) > MAX_TABLE:
            continue
        handle.seek(strings[4])
        names = handle.read(strings[5])
        handle.seek(table[4])
        symbols = handle.read(table[5])
        for wanted, value in _find(names, symbols, struct).items():
            found.setdefault(wanted, value)
        if len(found) == len(WANTED):
            return base, found[WANTED[0]], found[WANTED[1]]
    if not any(s[1] in (11, 2) for s in sections):
        return "has no symbol table (stripped even of its dynamic symbols): CPython's _PyRuntime cannot be found"
    if WANTED[0] in found:  # Py_Version came with 3.11
        return "defines _PyRuntime but no Py_Version: a CPython older than 3.11, which this reader does not read"
    return "defines no symbol _PyRuntime (not CPython, or linked without exporting its symbols and stripped)"


def _find(names: bytes, symbols: bytes, struct: Any) -> Dict[bytes, int]:
    """The values of the ``WANTED`` symbols defined as data in one symbol table (its string table ``names``).
    A name may be the tail of a longer one in the string table: every place it ends a string counts."""
    at_name: Dict[int, bytes] = {}
    for wanted in WANTED:
        at = names.find(wanted + b"\0")
        while at >= 0 and len(at_name) < 1024:
            at_name[at] = wanted
            at = names.find(wanted + b"\0", at + 1)
    found = {}
    for name, info, _, section, value, _ in struct.iter_unpack("<IBBHQQ", symbols[:len(symbols) // 24 * 24]):
        wanted = at_name.get(name)
        if wanted is not None and section != 0 and info & 15 == 1 and value:  # defined, STT_OBJECT
            found.setdefault(wanted, value)
    return found


def _cached(runtime_dir: Optional[str], key: str) -> Optional[Tuple[int, int, int]]:
    """The offsets kept for ``key``; None where there are none, or the file is not the user's own."""
    if runtime_dir is None:
        return None
    try:
        fd = os.open(os.path.join(runtime_dir, CACHE_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid() or info.st_mode & 0o077 or info.st_size > MAX_CACHE:
            return None
        text = os.read(fd, MAX_CACHE).decode("utf-8", "surrogateescape")
    finally:
        os.close(fd)
    for line in text.split("\n"):
        stored, _, values = line.rpartition("\0=")
        if stored == key:
            numbers = values.split(",")
            if len(numbers) == 3 and all(n.isascii() and n.isdigit() and len(n) <= 20 for n in numbers):
                base, runtime, version = (int(n) for n in numbers)
                return base, runtime, version
    return None


def _remember(runtime_dir: Optional[str], key: str, offsets: Tuple[int, int, int]) -> None:
    """Keep ``offsets`` for ``key`` (owner-only, replaced whole); a failure to is nobody's problem."""
    if runtime_dir is None or "\n" in key:
        return
    path = os.path.join(runtime_dir, CACHE_NAME)
    line = "%s\0=%d,%d,%d" % ((key,) + offsets)
    try:
        with open(path, "rb") as handle:
            kept = [old for old in handle.read(MAX_CACHE).decode("utf-8", "surrogateescape").split("\n")
                    if old and not old.startswith(key.split("\0", 1)[0] + "\0")]
    except OSError:
        kept = []
    replace_private(path, "\n".join(kept[-63:] + [line]).encode("utf-8", "surrogateescape") + b"\n")
