"""Checksum-verified downloads into the user cache directory, shared by the dataset loaders.

A download goes to a temporary file beside its target and replaces the
target in one rename only after its MD5 digest matched, so an interrupted
or corrupt transfer never leaves a file that a later load would trust.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import urllib.request

from .._io import open_regular

__all__ = ["digest", "cache_dir", "fetch", "find_file"]


def digest(path, algorithm: str = "sha256") -> str:
    """Hex digest of a file's bytes (read in 1 MiB chunks)."""
    h = hashlib.new(algorithm)
    with open_regular(path) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_dir(dataset: str) -> str:
    """``<user cache dir>/parconv/<dataset>`` (platformdirs; ``$XDG_CACHE_HOME`` on Linux)."""
    from platformdirs import user_cache_dir

    return os.path.join(user_cache_dir("parconv"), dataset)


def fetch(urls, target: str, md5: str, timeout: float = 60) -> str:
    """Download the first of ``urls`` that works and matches ``md5`` to ``target``; returns ``target``.

    Raises ``OSError`` listing every URL's failure when none gives the file, and saying where to put
    a copy fetched by other means.
    """
    directory = os.path.dirname(os.path.abspath(target))
    os.makedirs(directory, exist_ok=True)
    name = os.path.basename(target)
    errors = []
    for url in urls:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".part", dir=directory)
        try:
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as r:
                shutil.copyfileobj(r, out)
            got = digest(tmp, "md5")
            if got != md5:
                errors.append(f"{url}: checksum mismatch (MD5 {got}, expected {md5})")
                continue
            os.replace(tmp, target)
            return target
        except OSError as exc:
            errors.append(f"{url}: {exc}")
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    raise OSError(f"could not download {name}: " + "; ".join(errors) + f". Without network access here, fetch "
                  f"{name} elsewhere (from {' or '.join(urls)}; MD5 {md5}) and copy it to "
                  f"{os.path.abspath(target)} (or pass path= to the directory that holds it)")


def find_file(directory: str, names) -> str | None:
    """The first of ``names`` that exists in ``directory``, as a path, or ``None``."""
    for name in names:
        candidate = os.path.join(directory, name)
        if os.path.exists(candidate):
            return candidate
    return None
