"""Atomic writes and pickle-free ``.npz`` reads shared by checkpoints.

Writes go to a ``.parconv-*.tmp`` file in the target's directory, are
fsynced, given the mode an ordinary ``open`` would give them under the
process umask, and renamed over the target in one step.

Reads treat the file as hostile: every member is checked (name, compression,
``.npy`` header, sizes computed in Python integers, CRC) before anything is
allocated for it, and every failure is one ``ValueError`` naming the file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
import threading
import time
import warnings
import zipfile

import numpy as np

META_KEY = "__parconv__"
TMP_PREFIX, TMP_SUFFIX = ".parconv-", ".tmp"
# a temporary file untouched this long was left by a killed writer (live writers keep touching theirs)
STALE_TMP_SECONDS = 60.0
# deflate cannot expand data by more than 1032:1, so a member claiming more is a bomb or corrupt
_MAX_DEFLATE_RATIO = 1032
_ARRAY_KINDS = "biuf"  # bool, int, uint, float: what parconv writes; never object or structured data
_MAX_JSON_DEPTH = 64

_umask_lock = threading.Lock()
_umask_cached: int | None = None


def _current_umask() -> int:
    """The process umask, read without changing it where the OS allows.

    Linux reports it in ``/proc/self/status``; elsewhere it is read once with
    the set-and-restore ``os.umask`` dance (under a lock) and cached, since
    that dance briefly changes it for every thread.
    """
    global _umask_cached
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _umask_lock:
        if _umask_cached is None:
            _umask_cached = os.umask(0o022)
            os.umask(_umask_cached)
        return _umask_cached


def remove_stale_temporaries(directory, max_age: float = STALE_TMP_SECONDS) -> list[str]:
    """Delete ``.parconv-*.tmp`` files in ``directory`` older than ``max_age`` seconds.

    Only regular files of that pattern owned by this user are touched: they
    are what a writer killed between ``mkstemp`` and the rename leaves behind.
    Returns the paths removed.
    """
    removed = []
    now = time.time()
    uid = os.getuid() if hasattr(os, "getuid") else None
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        if not (entry.name.startswith(TMP_PREFIX) and entry.name.endswith(TMP_SUFFIX)):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or (uid is not None and st.st_uid != uid):
                continue
            if now - st.st_mtime > max_age:
                os.unlink(entry.path)
                removed.append(entry.path)
        except OSError:
            continue  # another process removed or replaced it first
    return removed


@contextlib.contextmanager
def atomic_open(path, mode: str = "wb"):
    """Open a temporary file beside ``path``; on success it replaces ``path`` in one rename.

    An exception or a kill mid-write leaves the previous ``path`` untouched;
    the new file gets mode ``0o666 & ~umask`` like one made by ``open``
    (``mkstemp`` alone would leave it ``0o600``). Stale temporaries of killed
    writers in the same directory are removed first.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        _make_directory(directory)
        remove_stale_temporaries(directory)
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=TMP_SUFFIX, dir=directory)
        os.fchmod(fd, 0o666 & ~_current_umask())
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(exc, OSError) and exc.errno is not None and _names_temporary_or_nothing(exc):
            # name the file being written, not its temporary
            raise OSError(exc.errno, exc.strerror, path) from None
        raise
    _fsync_directory(directory)


def _names_temporary_or_nothing(exc: OSError) -> bool:
    name = exc.filename
    return name is None or (isinstance(name, str) and os.path.basename(name).startswith(TMP_PREFIX))


def _make_directory(directory: str) -> None:
    if os.path.exists(directory) and not os.path.isdir(directory):
        # makedirs would say "File exists", which hides what is wrong
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), directory)
    os.makedirs(directory, exist_ok=True)


def _fsync_directory(directory: str) -> None:
    """Make the rename itself durable; some filesystems refuse a directory fsync, which is harmless."""
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def check_writable_target(path) -> None:
    """Raise ``OSError`` now if a file cannot be written at ``path`` the way :func:`atomic_open` writes it.

    Creates the directory if needed and writes and removes a temporary file
    there, which catches read-only filesystems, missing permissions and a
    path component that is a file -- before hours of training, not after.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "is a directory, expected a file name", path)
    directory = os.path.dirname(os.path.abspath(path))
    _make_directory(directory)
    try:
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=TMP_SUFFIX, dir=directory)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot write files in {directory}: {exc.strerror}", path) from None
    os.close(fd)
    os.unlink(tmp)


def save_npz(path, arrays: dict, meta: dict) -> None:
    """Write ``arrays`` plus a JSON ``meta`` record to ``path`` atomically (no pickle)."""
    # np.asarray(order="C"), not ascontiguousarray: that turns 0-d arrays (counters) into 1-d ones
    payload = {k: np.asarray(v, order="C") for k, v in arrays.items()}
    if META_KEY in payload:
        raise ValueError(f"array name {META_KEY!r} is reserved")
    payload[META_KEY] = np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8)
    with atomic_open(path) as f:
        np.savez(f, **payload)


def _bad(path, what: str) -> ValueError:
    return ValueError(f"{path!r} is not a readable parconv checkpoint: {what}")


def _read_member(path, zf: zipfile.ZipFile, info: zipfile.ZipInfo, archive_size: int) -> np.ndarray:
    """One ``.npy`` member, its header checked against its size before any allocation."""
    name = info.filename
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise _bad(path, f"member {name!r} uses compression method {info.compress_type} "
                         "(only stored and deflated members are read)")
    if info.flag_bits & 0x1:
        raise _bad(path, f"member {name!r} is encrypted")
    if info.compress_size > archive_size:
        raise _bad(path, f"member {name!r} claims {info.compress_size} bytes, more than the file's {archive_size}")
    if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
        raise _bad(path, f"member {name!r} is stored uncompressed but claims {info.file_size} bytes "
                         f"in {info.compress_size}")
    if info.compress_type == zipfile.ZIP_DEFLATED and info.file_size > _MAX_DEFLATE_RATIO * info.compress_size + 64:
        raise _bad(path, f"member {name!r} claims {info.file_size} bytes from {info.compress_size} "
                         "compressed bytes, more than deflate can produce")
    with zf.open(info) as f:
        try:
            version = np.lib.format.read_magic(f)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a Python 2 era header is parsed with a warning; checks follow
                if version == (1, 0):
                    shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
                elif version == (2, 0):
                    shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
                else:
                    raise ValueError(f"unknown .npy format version {version}")
        except (zipfile.BadZipFile, OSError):
            raise
        except Exception as exc:  # numpy parses the header text with tokenize/ast: any of their errors can come
            raise _bad(path, f"member {name!r} has a corrupt .npy header ({type(exc).__name__}: {exc})") from None
        if dtype.kind not in _ARRAY_KINDS or dtype.fields is not None or dtype.subdtype is not None:
            raise _bad(path, f"member {name!r} holds {dtype} data; only plain numeric arrays are read")
        if not all(type(n) is int and n >= 0 for n in shape):
            raise _bad(path, f"member {name!r} has an invalid shape {shape!r}")
        count = 1
        for n in shape:
            count *= n  # Python ints: a product past 2**64 is a size mismatch below, not an overflow
        nbytes = count * dtype.itemsize
        header = f.tell()
        if header + nbytes != info.file_size:
            raise _bad(path, f"member {name!r} has shape {shape} of {dtype} ({nbytes} bytes) but holds "
                             f"{info.file_size - header} bytes of data")
        data = bytearray(nbytes)  # writable, so the arrays handed out are too
        view, got = memoryview(data), 0
        while got < nbytes:
            n = f.readinto(view[got:])
            if not n:
                raise _bad(path, f"member {name!r} is truncated")
            got += n
        if f.read(1):
            raise _bad(path, f"member {name!r} holds more data than its header says")
    arr = np.frombuffer(data, dtype=dtype).reshape(shape, order="F" if fortran else "C")
    return np.asarray(arr, order="C").astype(dtype.newbyteorder("="), copy=False)  # keeps 0-d arrays 0-d


def _depth(value, limit: int) -> int:
    """Nesting depth of a JSON value, stopping past ``limit``."""
    stack, deepest = [(value, 1)], 0
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            break
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
    return deepest


def load_npz(path) -> tuple[dict, dict]:
    """Read a file written by :func:`save_npz`; returns ``(arrays, meta)``.

    Raises ``FileNotFoundError`` when ``path`` does not exist and one
    ``ValueError`` naming the file for anything else wrong with it (not a
    zip, a member that is not a plain numeric ``.npy``, unsupported
    compression, sizes that disagree, a bad CRC, metadata that is not a JSON
    object); never unpickles anything. The metadata's content is checked by
    the caller (:mod:`parconv._checkpoint`).
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    if os.path.isdir(path):
        raise _bad(path, "it is a directory")
    arrays = {}
    try:
        archive_size = os.path.getsize(path)
        with open_regular(path, "the checkpoint") as f, zipfile.ZipFile(f) as zf:
            for info in zf.infolist():
                name = info.filename
                if not name.endswith(".npy") or len(name) == 4:
                    raise _bad(path, f"member {name!r} is not a .npy array")
                key = name[:-4]
                if key in arrays:
                    raise _bad(path, f"member {name!r} appears twice")
                arrays[key] = _read_member(path, zf, info, archive_size)
    except ValueError as exc:
        if str(exc).startswith(repr(path)):
            raise
        raise _bad(path, f"{type(exc).__name__}: {exc}") from None
    except (zipfile.BadZipFile, zipfile.LargeZipFile) as exc:
        head = _head(path)
        what = "a plain .npy array, not an .npz checkpoint" if head.startswith(b"\x93NUMPY") else \
            f"not a zip archive ({exc})" if isinstance(exc, zipfile.BadZipFile) and "not a zip" in str(exc) \
            else f"corrupt or truncated ({exc})"
        raise _bad(path, what) from None
    except (OSError, EOFError, RuntimeError, NotImplementedError, OverflowError, MemoryError, SyntaxError,
            RecursionError, UnicodeDecodeError, TypeError, KeyError, IndexError) as exc:
        # zipfile and numpy's header parser raise all of these on crafted bytes
        raise _bad(path, f"corrupt or truncated ({type(exc).__name__}: {exc})") from None
    raw = arrays.pop(META_KEY, None)
    if raw is None:
        raise ValueError(f"{path!r} is an .npz file but not a parconv checkpoint (no {META_KEY} record)")
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise _bad(path, f"the {META_KEY} record is {raw.dtype} of shape {raw.shape}, expected uint8 bytes")
    try:
        meta = json.loads(raw.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"{path!r}: corrupt checkpoint metadata: {type(exc).__name__}: {exc}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path!r}: checkpoint metadata is a JSON {type(meta).__name__}, expected an object")
    if _depth(meta, _MAX_JSON_DEPTH) > _MAX_JSON_DEPTH:
        raise ValueError(f"{path!r}: checkpoint metadata is nested deeper than {_MAX_JSON_DEPTH} levels")
    return arrays, meta


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"


def open_regular(path, what: str = "file", error=ValueError):
    """Open ``path`` for reading in binary mode, refusing anything but a regular file with a ``ValueError``.

    The check is made on the opened descriptor (``O_NONBLOCK``: opening a FIFO does not wait for a
    writer), so a FIFO, ``/dev/zero`` or a symbolic link to them cannot hang or feed a reader forever.
    """
    path = os.fspath(path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path!r}: {what} is {_file_kind(st.st_mode)}; expected a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _head(path, n: int = 8) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(n)
    except OSError:
        return b""
