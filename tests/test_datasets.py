"""The bundled MNIST sample, the IDX reader on real files, and quadrants."""

import os
import shutil

import numpy as np
import pytest

import parconv as pc
from parconv.datasets import IDXError, load_mnist, quadrants, sample_path


def test_bundled_sample_is_the_real_mnist_test_set():
    x, y = load_mnist("test")
    assert x.shape == (10000, 1, 28, 28) and x.dtype == np.float32
    assert y.shape == (10000,) and y.dtype == np.int64
    assert 0.0 <= x.min() and x.max() <= 1.0
    assert y[:10].tolist() == [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]
    assert np.bincount(y).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    raw, _ = load_mnist("test", normalize=False)
    assert raw.max() == 255.0


def test_load_from_path_gzip_and_raw(tmp_path):
    import gzip

    for name in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        with gzip.open(os.path.join(sample_path(), name)) as f:
            (tmp_path / name[:-3]).write_bytes(f.read())  # raw, uncompressed
    x, y = load_mnist("test", path=tmp_path)
    x0, y0 = load_mnist("test")
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(y, y0)


def test_missing_files_and_bad_split(tmp_path):
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte.gz not found.*download=True"):
        load_mnist("train", path=tmp_path)
    with pytest.raises(ValueError, match="split must be 'train' or 'test', got 'val'"):
        load_mnist("val")


def test_mismatched_image_and_label_counts(tmp_path):
    import gzip
    import struct

    for name in ("t10k-images-idx3-ubyte.gz",):
        shutil.copy(os.path.join(sample_path(), name), tmp_path / name)
    labels = np.zeros(5, np.uint8)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(
        gzip.compress(struct.pack(">HBBI", 0, 8, 1, 5) + labels.tobytes()))
    with pytest.raises(IDXError, match="10000 images but .* has 5 labels"):
        load_mnist("test", path=tmp_path)


def test_bundled_checksum_is_verified(monkeypatch, tmp_path):
    fake = tmp_path / "data"
    shutil.copytree(sample_path(), fake)
    os.chmod(fake / "t10k-labels-idx1-ubyte.gz", 0o644)
    with open(fake / "t10k-labels-idx1-ubyte.gz", "ab") as f:
        f.write(b"x")
    monkeypatch.setattr("parconv.datasets.mnist.sample_path", lambda: str(fake))
    with pytest.raises(IDXError, match="fails its SHA-256 check"):
        load_mnist("test")


def test_quadrants():
    x, y = quadrants(1000, seed=1)
    assert x.shape == (1000, 2) and y.shape == (1000, 1)
    np.testing.assert_array_equal(y[:, 0], (x[:, 0] * x[:, 1] > 0).astype(np.float32))
    x2, _ = quadrants(1000, seed=1)
    np.testing.assert_array_equal(x, x2)
    with pytest.raises(ValueError, match="n must be >= 1"):
        pc.datasets.quadrants(0)
