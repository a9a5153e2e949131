"""Fashion-MNIST: Zalando's 28x28 clothing images in MNIST's IDX format, from local files or a verified download."""

from __future__ import annotations

import os

from . import _download as _dl
from .idx import IDXError, read_idx
from .mnist import _to_arrays

#: file names of the official Fashion-MNIST files per split (the same names as MNIST's)
FASHION_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
#: names of the ten classes, by label
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                         "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
# MD5 digests of the official files, as published in the dataset's repository
_MD5 = {
    "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
    "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
    "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
    "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
}
_MIRRORS = (
    "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
)


def load_fashion_mnist(split: str, path=None, download: bool = False, normalize: bool = True):
    """Load Fashion-MNIST images and labels.

    Parameters
    ----------
    split : {"train", "test"}
        60,000 training or 10,000 test images.
    path : str or path-like, optional
        Directory with the IDX files under their official names (gzip or
        raw). Default: the user cache directory
        (``<cache>/parconv/fashion-mnist``).
    download : bool, default False
        Fetch missing files into the directory, each verified against its
        published MD5 digest; files already there are verified too.
    normalize : bool, default True
        Scale pixels to ``[0, 1]``; otherwise 0..255 as float32.

    Returns
    -------
    x : ndarray (N, 1, 28, 28) float32
    y : ndarray (N,) int64
        Labels 0..9, named by ``FASHION_MNIST_CLASSES``.

    Raises
    ------
    FileNotFoundError
        A file is missing and ``download`` is False.
    IDXError
        A file is truncated, corrupt or fails its checksum (a ``ValueError``).
    """
    if split not in FASHION_MNIST_FILES:
        raise ValueError(f"load_fashion_mnist: split must be 'train' or 'test', got {split!r}")
    directory = os.fspath(path) if path is not None else _dl.cache_dir("fashion-mnist")
    files = []
    for name in FASHION_MNIST_FILES[split]:
        found = _dl.find_file(directory, (name, name[:-3]))
        if found is None:
            if not download:
                raise FileNotFoundError(
                    f"load_fashion_mnist: {name} not found in {directory}; pass path= to a directory holding "
                    f"the Fashion-MNIST files, or download=True to fetch them")
            found = _dl.fetch([base + name for base in _MIRRORS], os.path.join(directory, name), _MD5[name])
        elif download and found.endswith(".gz") and _dl.digest(found, "md5") != _MD5[name]:
            raise IDXError(f"{found}: checksum does not match the official file; delete it to download again")
        files.append(found)
    return _to_arrays(read_idx(files[0]), read_idx(files[1]), files[0], files[1], normalize)


__all__ = ["load_fashion_mnist", "FASHION_MNIST_FILES", "FASHION_MNIST_CLASSES"]
