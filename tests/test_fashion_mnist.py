"""load_fashion_mnist on small IDX files written by the test; the download path through file:// URLs."""

import gzip
import hashlib
import os
import struct

import numpy as np
import pytest

import parconv as pc
from parconv.datasets import FASHION_MNIST_FILES, IDXError, load_fashion_mnist
from parconv.datasets import fashion_mnist as fm


def idx_bytes(arr: np.ndarray) -> bytes:
    return struct.pack(">HBB", 0, 0x08, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()


def write_split(directory, split, n=5, compress=True, seed=0):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, n, dtype=np.uint8)
    os.makedirs(directory, exist_ok=True)
    for name, arr in zip(FASHION_MNIST_FILES[split], (images, labels)):
        data = idx_bytes(arr)
        if compress:
            (directory / name).write_bytes(gzip.compress(data))
        else:
            (directory / name[:-3]).write_bytes(data)
    return images, labels


@pytest.mark.parametrize("compress", [True, False])
@pytest.mark.parametrize("split", ["train", "test"])
def test_reads_idx_files(tmp_path, split, compress):
    images, labels = write_split(tmp_path, split, compress=compress)
    x, y = load_fashion_mnist(split, path=tmp_path)
    assert x.shape == (5, 1, 28, 28) and x.dtype == np.float32
    assert y.dtype == np.int64
    np.testing.assert_array_equal(x[:, 0], images.astype(np.float32) / 255)
    np.testing.assert_array_equal(y, labels)
    raw, _ = load_fashion_mnist(split, path=tmp_path, normalize=False)
    np.testing.assert_array_equal(raw[:, 0], images)


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"train-images-idx3-ubyte.gz not found in .*path=.*download=True"):
        load_fashion_mnist("train", path=tmp_path)
    with pytest.raises(ValueError, match="split must be 'train' or 'test', got 'dev'"):
        load_fashion_mnist("dev", path=tmp_path)
    write_split(tmp_path, "test")
    name = tmp_path / "t10k-images-idx3-ubyte.gz"
    name.write_bytes(name.read_bytes()[:-20])
    with pytest.raises(IDXError, match="t10k-images-idx3-ubyte.gz"):
        load_fashion_mnist("test", path=tmp_path)


def test_download_from_mirrors(tmp_path, monkeypatch):
    server = tmp_path / "server"
    images, labels = write_split(server, "test", seed=3)
    md5 = {name: hashlib.md5((server / name).read_bytes()).hexdigest() for name in FASHION_MNIST_FILES["test"]}
    # the first mirror is down; the second serves the files
    monkeypatch.setattr(fm, "_MIRRORS", ((tmp_path / "down").as_uri() + "/", server.as_uri() + "/"))
    monkeypatch.setattr(fm, "_MD5", md5)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match="download=True"):
        load_fashion_mnist("test")
    x, y = load_fashion_mnist("test", download=True)
    np.testing.assert_array_equal(y, labels)
    cache = tmp_path / "cache" / "parconv" / "fashion-mnist"
    assert sorted(os.listdir(cache)) == sorted(FASHION_MNIST_FILES["test"])
    np.testing.assert_array_equal(load_fashion_mnist("test")[0], x)
    # a cached file that no longer matches its checksum is refused when downloading
    (cache / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx_bytes(labels[:4])))
    with pytest.raises(IDXError, match="checksum does not match"):
        load_fashion_mnist("test", download=True)


def test_download_checksum_mismatch_leaves_nothing(tmp_path, monkeypatch):
    server = tmp_path / "server"
    write_split(server, "test")
    monkeypatch.setattr(fm, "_MIRRORS", (server.as_uri() + "/",))
    with pytest.raises(OSError, match="checksum mismatch"):
        load_fashion_mnist("test", path=tmp_path / "dl", download=True)
    assert os.listdir(tmp_path / "dl") == []


def test_exported():
    assert pc.datasets.load_fashion_mnist is load_fashion_mnist
    assert pc.datasets.FASHION_MNIST_CLASSES[9] == "Ankle boot"


def test_mnist_train_download_through_the_shared_fetch(tmp_path, monkeypatch):
    from parconv.datasets import load_mnist
    from parconv.datasets import mnist

    server = tmp_path / "server"
    images, labels = write_split(server, "train", seed=4)
    monkeypatch.setattr(mnist, "_MIRRORS", (server.as_uri() + "/",))
    monkeypatch.setattr(mnist, "_MD5", {n: hashlib.md5((server / n).read_bytes()).hexdigest()
                                        for n in FASHION_MNIST_FILES["train"]})
    x, y = load_mnist("train", path=tmp_path / "dl", download=True)
    np.testing.assert_array_equal(y, labels)
    assert sorted(os.listdir(tmp_path / "dl")) == sorted(FASHION_MNIST_FILES["train"])
