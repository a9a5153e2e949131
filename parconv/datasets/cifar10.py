"""CIFAR-10, the official binary version: local files, the archive, or a verified download.

Each file of ``cifar-10-batches-bin/`` is a run of 3,073-byte records: one
label byte (0..9), then 1,024 red, 1,024 green and 1,024 blue pixel bytes,
each plane row by row. The training set is ``data_batch_1.bin`` ..
``data_batch_5.bin`` (10,000 records each), the test set ``test_batch.bin``.
"""

from __future__ import annotations

import os
import tarfile
import zlib

import numpy as np

from .._io import atomic_open, open_regular
from . import _download as _dl

#: the files of each split, inside ``cifar-10-batches-bin/``
CIFAR10_FILES = {
    "train": tuple(f"data_batch_{i}.bin" for i in range(1, 6)),
    "test": ("test_batch.bin",),
}
#: names of the ten classes, by label (as ``batches.meta.txt``)
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
ARCHIVE = "cifar-10-binary.tar.gz"
FOLDER = "cifar-10-batches-bin"
_MD5 = "c32a1d4ab5d03f1284b67883e8d87530"  # of the archive, as published on the dataset's page
RECORD = 1 + 3 * 32 * 32
#: every official batch file holds 10,000 records; a file (or archive member) is never read past this
MAX_BATCH_BYTES = 10_000 * RECORD
# the official archive holds the folder, six batch files, batches.meta.txt and readme.html; a search for
# the batch files stops after this many entries or this many unpacked bytes (a gzip bomb is not inflated)
_MAX_ENTRIES = 64
_MAX_SPAN = 8 * MAX_BATCH_BYTES


def _parse(raw: bytes, source: str):
    """Images (n, 3, 32, 32) uint8 and labels (n,) of one batch file's bytes."""
    if len(raw) == 0 or len(raw) % RECORD:
        raise ValueError(f"{source}: truncated or not a CIFAR-10 binary batch: {len(raw)} bytes is not a "
                         f"whole number of {RECORD}-byte records")
    records = np.frombuffer(raw, np.uint8).reshape(-1, RECORD)
    labels = records[:, 0]
    bad = np.flatnonzero(labels > 9)
    if bad.size:
        raise ValueError(f"{source}: corrupt: record {bad[0]} has label {labels[bad[0]]} (labels are 0..9)")
    return records[:, 1:].reshape(-1, 3, 32, 32), labels


def _read_file(path: str) -> bytes:
    """One batch file's bytes: a regular file of at most :data:`MAX_BATCH_BYTES` (never a FIFO or device)."""
    with open_regular(path, "the CIFAR-10 batch file") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_BATCH_BYTES:
            raise ValueError(f"{path}: {size} bytes, more than a CIFAR-10 batch file holds ({MAX_BATCH_BYTES} "
                             f"bytes: 10,000 records of {RECORD})")
        raw = f.read(MAX_BATCH_BYTES + 1)
    if len(raw) > MAX_BATCH_BYTES:  # it grew while being read
        raise ValueError(f"{path}: more than {MAX_BATCH_BYTES} bytes, more than a CIFAR-10 batch file holds")
    return raw


def _read_archive(archive: str, names) -> dict:
    """The bytes of ``cifar-10-batches-bin/<name>`` for each name, read from the archive without extracting it.

    Only regular members of at most :data:`MAX_BATCH_BYTES` are read, and the search stops after
    ``_MAX_ENTRIES`` entries or ``_MAX_SPAN`` unpacked bytes: a small hostile archive cannot make it
    inflate gigabytes.
    """
    out = {}
    wanted = {f"{FOLDER}/{name}": name for name in names}
    try:
        with open_regular(archive, "the CIFAR-10 archive") as raw_file, \
                tarfile.open(fileobj=raw_file, mode="r:gz") as tar:
            for count, member in enumerate(tar, 1):
                if count > _MAX_ENTRIES or member.offset > _MAX_SPAN:
                    break
                name = wanted.pop(member.name, None)
                if name is None:
                    continue
                if not member.isreg():
                    kind = "a symbolic link" if member.issym() else "a hard link" if member.islnk() else \
                        "a directory" if member.isdir() else "a special file"
                    raise ValueError(f"{archive}: {member.name} is {kind}, expected a regular file (the batch "
                                     "files are plain members of the official archive)")
                if member.size > MAX_BATCH_BYTES:
                    raise ValueError(f"{archive}: {member.name} claims {member.size} bytes, more than a CIFAR-10 "
                                     f"batch file holds ({MAX_BATCH_BYTES} bytes: 10,000 records of {RECORD})")
                out[name] = tar.extractfile(member).read(member.size)
                if not wanted:
                    break
    except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise ValueError(f"{archive}: truncated or corrupt archive ({type(exc).__name__}: {exc})") from None
    if wanted:
        raise ValueError(f"{archive}: the archive has no {', '.join(wanted)} among its first {_MAX_ENTRIES} "
                         f"entries and {_MAX_SPAN} bytes (is it the binary version, {ARCHIVE}?)")
    return out


def _download_into(directory: str, names) -> dict:
    """Fetch and verify the archive into ``directory``, unpack the batch files beside it; their bytes."""
    archive = _dl.fetch([CIFAR10_URL], os.path.join(directory, ARCHIVE), _MD5)
    data = _read_archive(archive, CIFAR10_FILES["train"] + CIFAR10_FILES["test"])
    for name, raw in data.items():
        with atomic_open(os.path.join(directory, FOLDER, name)) as f:
            f.write(raw)
    return {name: data[name] for name in names}


def load_cifar10(split: str, path=None, download: bool = False, normalize: bool = True):
    """Load CIFAR-10 (the official binary version).

    Parameters
    ----------
    split : {"train", "test"}
        50,000 training images (five batch files) or 10,000 test images.
    path : str or path-like, optional
        A directory holding ``cifar-10-batches-bin/`` (or the batch files
        themselves, or the archive ``cifar-10-binary.tar.gz``, read without
        unpacking). Default: the user cache directory
        (``<cache>/parconv/cifar10``).
    download : bool, default False
        When the files are missing, fetch ``cifar-10-binary.tar.gz`` from the
        official site, verify its MD5 and unpack the batch files beside it
        (each written atomically).
    normalize : bool, default True
        Scale pixels to ``[0, 1]``; otherwise 0..255 as float32.

    Returns
    -------
    x : ndarray (N, 3, 32, 32) float32
        Channels red, green, blue.
    y : ndarray (N,) int64
        Labels 0..9, named by ``CIFAR10_CLASSES``.

    Raises
    ------
    FileNotFoundError
        No data found and ``download`` is False.
    ValueError
        A file is truncated or corrupt (the message names it), or the
        split is unknown.
    """
    if split not in CIFAR10_FILES:
        raise ValueError(f"load_cifar10: split must be 'train' or 'test', got {split!r}")
    names = CIFAR10_FILES[split]
    directory = os.fspath(path) if path is not None else _dl.cache_dir("cifar10")
    raws = {}
    for sub in (os.path.join(directory, FOLDER), directory):
        if all(os.path.exists(os.path.join(sub, n)) for n in names):
            for n in names:
                raws[os.path.join(sub, n)] = _read_file(os.path.join(sub, n))
            break
    else:
        archive = os.path.join(directory, ARCHIVE)
        if os.path.exists(archive):
            if download and _dl.digest(archive, "md5") != _MD5:
                raise ValueError(f"{archive}: checksum does not match the official archive; delete it to "
                                 f"download again")
            raws = {f"{archive}:{FOLDER}/{n}": raw for n, raw in _read_archive(archive, names).items()}
        elif download:
            raws = {os.path.join(directory, FOLDER, n): raw for n, raw in _download_into(directory, names).items()}
        else:
            raise FileNotFoundError(
                f"load_cifar10: no CIFAR-10 {split} data in {directory} (looked for {FOLDER}/{names[0]}, "
                f"{names[0]} and {ARCHIVE}); pass path= to a directory holding the binary version, or "
                f"download=True to fetch it")
    parts = [_parse(raw, source) for source, raw in raws.items()]
    n = sum(len(labels) for _, labels in parts)
    x = np.empty((n, 3, 32, 32), np.float32)
    y = np.empty(n, np.int64)
    start = 0
    for images, labels in parts:
        x[start:start + len(labels)] = images
        y[start:start + len(labels)] = labels
        start += len(labels)
    if normalize:
        x /= 255.0
    return x, y


__all__ = ["load_cifar10", "CIFAR10_FILES", "CIFAR10_CLASSES", "CIFAR10_URL"]
