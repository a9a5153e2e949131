"""Reader for the IDX format of MNIST (gzip-compressed or raw).

An IDX file is a 4-byte magic number (two zero bytes, a type code, the
number of dimensions), one big-endian uint32 per dimension, then the data.
Magic number, dimensions and file size are checked; a bad file raises
:class:`IDXError` naming it. Sizes are computed in Python integers, so no
header overflows them, and a gzip file is inflated as a stream that stops
one byte past what its header promises.
"""

from __future__ import annotations

import gzip
import os
import struct
import zlib

import numpy as np

from .._io import open_regular

_TYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
# deflate cannot expand data by more than 1032:1: a header promising more than that of the
# compressed size is refused before anything is inflated
_MAX_DEFLATE_RATIO = 1032


class IDXError(ValueError):
    """An IDX file is corrupt, truncated or not IDX at all."""


class _GzipReader:
    """``read(n)`` of the inflated stream; ``gzip`` inflates no further than asked, so the header bounds the work."""

    def __init__(self, f, path: str):
        self._g, self._path = gzip.GzipFile(fileobj=f, mode="rb"), path

    def read(self, n: int) -> bytes:
        try:
            return self._g.read(n)
        except (OSError, EOFError, zlib.error) as exc:
            raise IDXError(f"{self._path}: corrupt or truncated gzip data ({exc})") from None


def _exactly(reader, n: int, path: str, what: str) -> bytes:
    data = reader.read(n)
    if len(data) != n:
        raise IDXError(f"{path}: file truncated in the {what} ({len(data)} of {n} bytes)")
    return data


def read_idx(path) -> np.ndarray:
    """Read one IDX file (``.gz`` or raw) into a NumPy array of its native type and shape.

    Parameters
    ----------
    path : str or os.PathLike
        The file; gzip compression is recognised by its magic bytes, not the name.

    Returns
    -------
    numpy.ndarray
        Shape as the header says, dtype of its type code in native byte order.

    Raises
    ------
    FileNotFoundError
        ``path`` does not exist.
    IDXError
        (a ``ValueError``) naming the file: bad magic number, truncated or
        trailing data, a size that disagrees with the header, corrupt gzip.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"IDX file {path!r} does not exist")
    with open_regular(path, "the IDX file", IDXError) as f:
        file_size = os.fstat(f.fileno()).st_size
        gz = f.read(2) == b"\x1f\x8b"
        f.seek(0)
        reader = _GzipReader(f, path) if gz else f
        magic = reader.read(4)
        if len(magic) < 4:
            raise IDXError(f"{path}: too short to be an IDX file ({len(magic)} bytes)")
        zero, type_code, ndim = struct.unpack(">HBB", magic)
        if zero != 0 or type_code not in _TYPES or ndim == 0:
            raise IDXError(f"{path}: bad IDX magic number 0x{magic.hex()} (expected 0x0000TTDD with a known type)")
        header = 4 + 4 * ndim
        dims = struct.unpack(f">{ndim}I", _exactly(reader, 4 * ndim, path, f"header of {ndim} dimensions"))
        dtype = _TYPES[type_code]
        nbytes = dtype.itemsize
        for d in dims:
            nbytes *= d  # Python ints: never wraps around
        expected = header + nbytes
        if not gz and file_size != expected:
            what = "truncated" if file_size < expected else "has trailing bytes"
            raise IDXError(f"{path}: file {what}: {file_size} bytes for dimensions {dims} (expected {expected})")
        if gz and expected > _MAX_DEFLATE_RATIO * file_size + 1024:
            raise IDXError(f"{path}: header promises dimensions {dims} ({expected} bytes) but a gzip file of "
                           f"{file_size} bytes cannot hold that much")
        data = reader.read(nbytes + 1)  # one byte more than promised shows trailing data, no more is inflated
    if len(data) != nbytes:
        what = "truncated" if len(data) < nbytes else "has trailing bytes"
        size = f"{header + len(data)}" if len(data) <= nbytes else f"more than {expected}"
        raise IDXError(f"{path}: file {what}: {size} bytes for dimensions {dims} (expected {expected})")
    arr = np.frombuffer(data, dtype=dtype).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=True)
