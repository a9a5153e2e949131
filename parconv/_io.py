"""Atomic writes and pickle-free ``.npz`` reads shared by checkpoints."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import zipfile

import numpy as np

META_KEY = "__parconv__"


@contextlib.contextmanager
def atomic_open(path, mode: str = "wb"):
    """Open a temporary file beside ``path``; on success it replaces ``path`` in one rename.

    An exception or a kill mid-write leaves the previous ``path`` untouched.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".parconv-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def save_npz(path, arrays: dict, meta: dict) -> None:
    """Write ``arrays`` plus a JSON ``meta`` record to ``path`` atomically (no pickle)."""
    payload = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    if META_KEY in payload:
        raise ValueError(f"array name {META_KEY!r} is reserved")
    payload[META_KEY] = np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8)
    with atomic_open(path) as f:
        np.savez(f, **payload)


def load_npz(path) -> tuple[dict, dict]:
    """Read a file written by :func:`save_npz`; returns ``(arrays, meta)``.

    Raises ``ValueError`` naming the file when it is corrupt, truncated or not
    a parconv checkpoint; never unpickles anything.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}  # read every member now: truncation shows here
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError, zipfile.LargeZipFile) as exc:
        raise ValueError(f"{path!r} is not a readable parconv checkpoint (corrupt or truncated?): "
                         f"{type(exc).__name__}: {exc}") from None
    raw = arrays.pop(META_KEY, None)
    if raw is None:
        raise ValueError(f"{path!r} is an .npz file but not a parconv checkpoint (no {META_KEY} record)")
    try:
        meta = json.loads(bytes(raw.astype(np.uint8)).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path!r}: corrupt checkpoint metadata: {exc}") from None
    return arrays, meta
