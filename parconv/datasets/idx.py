"""Reader for the IDX format of MNIST (gzip-compressed or raw).

An IDX file is a 4-byte magic number (two zero bytes, a type code, the
number of dimensions), one big-endian uint32 per dimension, then the data.
Magic number, dimensions and file size are checked; a bad file raises
:class:`IDXError` naming it.
"""

from __future__ import annotations

import gzip
import os
import struct
import zlib

import numpy as np

_TYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


class IDXError(ValueError):
    """An IDX file is corrupt, truncated or not IDX at all."""


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        head = f.read(2)
        f.seek(0)
        raw = f.read()
    if head == b"\x1f\x8b":
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise IDXError(f"{path}: corrupt or truncated gzip data ({exc})") from None
    return raw


def read_idx(path) -> np.ndarray:
    """Read one IDX file (``.gz`` or raw) into a NumPy array of its native type and shape."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"IDX file {path!r} does not exist")
    data = _read_bytes(path)
    if len(data) < 4:
        raise IDXError(f"{path}: too short to be an IDX file ({len(data)} bytes)")
    zero, type_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or type_code not in _TYPES or ndim == 0:
        raise IDXError(f"{path}: bad IDX magic number 0x{data[:4].hex()} (expected 0x0000TTDD with a known type)")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise IDXError(f"{path}: truncated header ({len(data)} bytes, {ndim} dimensions need {header})")
    dims = struct.unpack(f">{ndim}I", data[4:header])
    dtype = _TYPES[type_code]
    expected = header + int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(data) != expected:
        what = "truncated" if len(data) < expected else "has trailing bytes"
        raise IDXError(f"{path}: file {what}: {len(data)} bytes for dimensions {dims} (expected {expected})")
    arr = np.frombuffer(data, dtype=dtype, offset=header).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=True)
