"""MNIST: the bundled real 10,000-image sample, local IDX files, or a checksum-verified download.

The bundled files are verified against their SHA256SUMS on every load;
downloads are checked against the official files' published MD5 digests.
"""

from __future__ import annotations

import os
from importlib import resources

import numpy as np

from . import _download as _dl
from .idx import IDXError, read_idx

#: file names and SHA-256 of the official MNIST files
MNIST_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
# MD5 digests of the official files, as published by the dataset's mirrors
_MD5 = {
    "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
}
_MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
)


def sample_path() -> str:
    """Directory of the bundled sample (the real MNIST test set, 10,000 images)."""
    return str(resources.files("parconv.datasets") / "data")


def _digest(path: str, algorithm: str = "sha256") -> str:
    return _dl.digest(path, algorithm)


def _bundled_checksums() -> dict:
    sums = {}
    with open(os.path.join(sample_path(), "SHA256SUMS")) as f:
        for line in f:
            if line.strip():
                digest, name = line.split()
                sums[name.lstrip("*")] = digest
    return sums


def _cache_dir() -> str:
    return _dl.cache_dir("mnist")


def _download(name: str, directory: str) -> str:
    return _dl.fetch([base + name for base in _MIRRORS], os.path.join(directory, name), _MD5[name])


def _to_arrays(images: np.ndarray, labels: np.ndarray, img_file: str, lbl_file: str, normalize: bool):
    if images.ndim != 3 or labels.ndim != 1:
        raise IDXError(f"{img_file}/{lbl_file}: expected (N, rows, cols) images and (N,) labels, "
                       f"got {images.shape} and {labels.shape}")
    if images.shape[0] != labels.shape[0]:
        raise IDXError(f"{img_file} has {images.shape[0]} images but {lbl_file} has {labels.shape[0]} labels")
    if labels.dtype.kind not in "iu":
        raise IDXError(f"{lbl_file}: labels are {labels.dtype}, expected integer class indices 0..9")
    bad = np.flatnonzero((labels < 0) | (labels > 9))
    if bad.size:  # as CIFAR-10's loader: a label past the ten classes is corruption, not an eleventh class
        raise IDXError(f"{lbl_file}: corrupt: label {bad[0]} is {labels[bad[0]]} (labels are 0..9; "
                       f"{bad.size} of {labels.size} out of range)")
    x = images[:, None, :, :].astype(np.float32)
    if normalize:
        x /= 255.0
    return x, labels.astype(np.int64)


def load_mnist(split: str = "test", path=None, download: bool = False, normalize: bool = True):
    """Load MNIST images and labels.

    Parameters
    ----------
    split : {"train", "test"}
        ``"test"`` (10,000 images) ships inside the package and is verified by
        SHA-256 on load. ``"train"`` (60,000) needs ``path`` or ``download``.
    path : str or path-like, optional
        Directory with the IDX files (gzip or raw, standard names).
    download : bool, default False
        Fetch missing files (checksum-verified) into the user cache directory.
    normalize : bool, default True
        Scale pixels to ``[0, 1]``; otherwise 0..255 as float32.

    Returns
    -------
    x : ndarray (N, 1, 28, 28) float32
    y : ndarray (N,) int64
    """
    if split not in MNIST_FILES:
        raise ValueError(f"load_mnist: split must be 'train' or 'test', got {split!r}")
    img_name, lbl_name = MNIST_FILES[split]
    if path is None and split == "test":
        directory = sample_path()
        sums = _bundled_checksums()
        for name in (img_name, lbl_name):
            digest = _digest(os.path.join(directory, name))
            if digest != sums.get(name):
                raise IDXError(f"bundled {os.path.join(directory, name)} fails its SHA-256 check "
                               f"({digest}); reinstall parconv")
        files = [os.path.join(directory, n) for n in (img_name, lbl_name)]
    else:
        directory = os.fspath(path) if path is not None else _cache_dir()
        files = []
        for name in (img_name, lbl_name):
            candidates = [os.path.join(directory, name), os.path.join(directory, name[:-3])]
            found = next((c for c in candidates if os.path.exists(c)), None)
            if found is None:
                if not download:
                    raise FileNotFoundError(
                        f"load_mnist: {name} not found in {directory}; pass path= to a directory holding it, "
                        f"or download=True to fetch it (the bundled sample is split='test')")
                found = _download(name, directory)
            elif download and found.endswith(".gz") and _digest(found, "md5") != _MD5[name]:
                raise IDXError(f"{found}: checksum does not match the official file; delete it to download again")
            files.append(found)
    images, labels = read_idx(files[0]), read_idx(files[1])
    return _to_arrays(images, labels, files[0], files[1], normalize)


__all__ = ["load_mnist", "sample_path", "MNIST_FILES"]
