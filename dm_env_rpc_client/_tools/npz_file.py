"""``.npz`` files written in one system call: ``save_npz``, what ``NpzWriter`` uses.

An ``.npz`` is a zip archive of ``.npy`` members, which ``np.load`` reads.
``np.savez`` builds one through ``zipfile``, at about 35 µs of Python per member
(and deflate on top with ``np.savez_compressed``): for the short episodes of a
batched run (Catch's are 10 steps, 10 members each) that was most of what
recording cost. Here the archive is laid out by hand: each member's ``.npy``
header, its data as a view of the array (never copied in Python), the zip
headers (stored, or deflated with ``compress``), all handed to one ``os.writev``.
Members hold a fixed timestamp, so the same arrays always give the same bytes.
Files of 2 GiB or more (zip64) are left to ``np.savez``.
"""

from __future__ import annotations

import os
import pathlib
import struct
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_END = struct.Struct("<IHHHHIIH")
_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01, the zip epoch
_STORED, _DEFLATED = 0, 8
_ZIP64 = 2**31
_IOV_MAX = 1024
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)


def _npy_header(array: np.ndarray) -> bytes:
    """The ``.npy`` (version 1.0) header of a C-ordered ``array``."""
    descr = np.lib.format.dtype_to_descr(array.dtype)
    text = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': {array.shape!r}, }}"
    padding = -(10 + len(text) + 1) % 64
    body = (text + " " * padding + "\n").encode("latin1")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body


def npz_parts(arrays: Mapping[str, np.ndarray], compress: bool = False) -> list[bytes | memoryview]:
    """The bytes of an ``.npz`` holding ``arrays`` (object arrays are refused), in pieces."""
    parts: list[bytes | memoryview] = []
    central: list[bytes] = []
    offset = 0
    for key, value in arrays.items():
        array = np.asarray(value)
        if not array.flags.c_contiguous:
            array = array.copy(order="C")
        if array.dtype.hasobject:
            raise ValueError(f"{key!r} is an object array, which an .npz cannot hold unpickled.")
        header = _npy_header(array)
        data = memoryview(array.reshape(-1).view(np.uint8).data) if array.size else memoryview(b"")
        crc = zlib.crc32(data, zlib.crc32(header))
        size = len(header) + data.nbytes
        payload: list[bytes | memoryview] = [header, data]
        method = _STORED
        if compress:
            deflate = zlib.compressobj(6, zlib.DEFLATED, -15)
            payload = [deflate.compress(header) + deflate.compress(data) + deflate.flush()]
            method = _DEFLATED
        stored = sum(len(p) for p in payload)
        name = f"{key}.npy".encode()
        local = _LOCAL.pack(0x04034B50, 20, 0, method, 0, _DATE, crc, stored, size, len(name), 0)
        parts += [local + name, *payload]
        fields = (20, 20, 0, method, 0, _DATE, crc, stored, size, len(name), 0, 0, 0, 0)
        central.append(_CENTRAL.pack(0x02014B50, *fields, 0o600 << 16, offset) + name)
        offset += len(local) + len(name) + stored
    directory = b"".join(central)
    end = _END.pack(0x06054B50, 0, 0, len(central), len(central), len(directory), offset, 0)
    parts.append(directory + end)
    return parts


def save_npz(path: pathlib.Path, arrays: Mapping[str, np.ndarray], compress: bool = False) -> None:
    """Writes ``arrays`` as the ``.npz`` file ``path`` (see the module docs)."""
    total = sum(np.asarray(value).nbytes for value in arrays.values())
    if total >= _ZIP64:
        save = np.savez_compressed if compress else np.savez
        save(path, **arrays)  # type: ignore[arg-type]
        return
    write_parts(path, npz_parts(arrays, compress))


def write_parts(path: str | os.PathLike[str], parts: Sequence[Any], mode: int = 0o644) -> int:
    """Writes ``parts`` (buffers), one after the other, as the file ``path`` with one
    ``os.writev`` (a call per ``_IOV_MAX`` parts; a short write's rest piece by piece);
    returns the file's size. Also how ``integrations.minari`` writes its episode files."""
    size = 0
    descriptor = os.open(path, _CREATE, mode)
    try:
        for start in range(0, len(parts), _IOV_MAX):
            chunk = parts[start : start + _IOV_MAX]
            written = os.writev(descriptor, chunk)
            expected = sum(memoryview(p).nbytes for p in chunk)
            if written != expected:  # a short write: the rest, piece by piece
                _write_rest(descriptor, chunk, written)
            size += expected
    finally:
        os.close(descriptor)
    return size


def _write_rest(descriptor: int, parts: Sequence[Any], skip: int) -> None:
    for part in parts:
        view = memoryview(part).cast("B")
        if skip >= len(view):
            skip -= len(view)
            continue
        view, skip = view[skip:], 0
        while view:
            view = view[os.write(descriptor, view) :]
