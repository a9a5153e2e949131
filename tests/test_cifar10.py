"""load_cifar10 on small files written in the official binary format; downloads from file:// URLs only."""

import hashlib
import io
import os
import tarfile

import numpy as np
import pytest

import parconv as pc
from parconv.datasets import CIFAR10_FILES, load_cifar10
from parconv.datasets import cifar10 as cifar_mod

RECORD = 3073


def records(n, seed):
    """``n`` records: label byte, then the R, G and B planes (row-major); with the arrays they encode."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
    labels = rng.integers(0, 10, n, dtype=np.uint8)
    raw = b"".join(bytes([labels[i]]) + images[i].tobytes() for i in range(n))
    return raw, images, labels


def write_split(directory, split, n=3):
    """The split's files in ``directory``; returns the expected (x, y)."""
    os.makedirs(directory, exist_ok=True)
    xs, ys = [], []
    for k, name in enumerate(CIFAR10_FILES[split]):
        raw, images, labels = records(n + k, seed=hash((split, k)) % 1000)
        with open(os.path.join(directory, name), "wb") as f:
            f.write(raw)
        xs.append(images)
        ys.append(labels)
    return np.concatenate(xs).astype(np.float32) / 255, np.concatenate(ys).astype(np.int64)


def write_archive(path, seed=0):
    """A cifar-10-binary.tar.gz laid out as the official one; returns {split: (x, y)}."""
    expected = {}
    with tarfile.open(path, "w:gz") as tar:
        for split in ("train", "test"):
            xs, ys = [], []
            for k, name in enumerate(CIFAR10_FILES[split]):
                raw, images, labels = records(2, seed=seed + k + (10 if split == "test" else 0))
                info = tarfile.TarInfo(f"cifar-10-batches-bin/{name}")
                info.size = len(raw)
                tar.addfile(info, io.BytesIO(raw))
                xs.append(images)
                ys.append(labels)
            expected[split] = (np.concatenate(xs).astype(np.float32) / 255, np.concatenate(ys).astype(np.int64))
    return expected


@pytest.mark.parametrize("layout", ["folder", "flat"])
def test_reads_the_official_layout(tmp_path, layout):
    directory = tmp_path / "cifar-10-batches-bin" if layout == "folder" else tmp_path
    want_train = write_split(directory, "train")
    want_test = write_split(directory, "test")
    for split, (wx, wy) in (("train", want_train), ("test", want_test)):
        x, y = load_cifar10(split, path=tmp_path)
        assert x.dtype == np.float32 and x.shape == (len(wy), 3, 32, 32) and x.flags.c_contiguous
        assert y.dtype == np.int64
        np.testing.assert_array_equal(x, wx)
        np.testing.assert_array_equal(y, wy)
        assert 0.0 <= x.min() and x.max() <= 1.0
    assert len(want_train[1]) == 3 + 4 + 5 + 6 + 7  # the five batches, in order
    raw, _ = load_cifar10("test", path=tmp_path, normalize=False)
    np.testing.assert_array_equal(raw, want_test[0] * 255)


def test_pixel_layout_is_channel_planes():
    # one record: label 7, red plane all 10, green the column index, blue the row index
    rows, cols = np.meshgrid(np.arange(32), np.arange(32), indexing="ij")
    raw = bytes([7]) + bytes([10] * 1024) + cols.astype(np.uint8).tobytes() + rows.astype(np.uint8).tobytes()
    images, labels = cifar_mod._parse(raw, "x")
    assert labels.tolist() == [7]
    assert (images[0, 0] == 10).all()
    assert images[0, 1, 5, 3] == 3 and images[0, 2, 5, 3] == 5


def test_truncated_and_corrupt_files_are_named(tmp_path):
    write_split(tmp_path, "test")
    target = tmp_path / "test_batch.bin"
    data = target.read_bytes()
    target.write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"test_batch.bin: truncated .* 3073-byte records"):
        load_cifar10("test", path=tmp_path)
    target.write_bytes(b"")
    with pytest.raises(ValueError, match="test_batch.bin: truncated"):
        load_cifar10("test", path=tmp_path)
    target.write_bytes(bytes([12]) + data[1:])
    with pytest.raises(ValueError, match=r"test_batch.bin: corrupt: record 0 has label 12"):
        load_cifar10("test", path=tmp_path)


def test_missing_data_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no CIFAR-10 train data in .*pass path=.*download=True"):
        load_cifar10("train", path=tmp_path)
    write_split(tmp_path, "test")
    with pytest.raises(FileNotFoundError, match="data_batch_1.bin"):
        load_cifar10("train", path=tmp_path)
    with pytest.raises(ValueError, match="split must be 'train' or 'test', got 'valid'"):
        load_cifar10("valid", path=tmp_path)


def test_reads_the_archive_without_unpacking(tmp_path):
    expected = write_archive(tmp_path / "cifar-10-binary.tar.gz")
    for split in ("train", "test"):
        x, y = load_cifar10(split, path=tmp_path)
        np.testing.assert_array_equal(x, expected[split][0])
        np.testing.assert_array_equal(y, expected[split][1])
    assert sorted(os.listdir(tmp_path)) == ["cifar-10-binary.tar.gz"]


def test_truncated_archive(tmp_path):
    archive = tmp_path / "cifar-10-binary.tar.gz"
    write_archive(archive)
    data = archive.read_bytes()
    archive.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cifar-10-binary.tar.gz: truncated or corrupt archive"):
        load_cifar10("test", path=tmp_path)


@pytest.fixture
def served_archive(tmp_path, monkeypatch):
    """A local archive served through a file:// URL with its MD5 as the published one; the cache in tmp."""
    source = tmp_path / "server" / "cifar-10-binary.tar.gz"
    source.parent.mkdir()
    expected = write_archive(source, seed=5)
    monkeypatch.setattr(cifar_mod, "CIFAR10_URL", source.as_uri())
    monkeypatch.setattr(cifar_mod, "_MD5", hashlib.md5(source.read_bytes()).hexdigest())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return expected


def test_download_verifies_and_caches(served_archive, tmp_path):
    with pytest.raises(FileNotFoundError, match="download=True"):
        load_cifar10("test")
    x, y = load_cifar10("test", download=True)
    np.testing.assert_array_equal(x, served_archive["test"][0])
    np.testing.assert_array_equal(y, served_archive["test"][1])
    cache = tmp_path / "cache" / "parconv" / "cifar10"
    assert sorted(os.listdir(cache)) == ["cifar-10-batches-bin", "cifar-10-binary.tar.gz"]
    assert sorted(os.listdir(cache / "cifar-10-batches-bin")) == sorted(CIFAR10_FILES["train"] + CIFAR10_FILES["test"])
    x, y = load_cifar10("train")  # from the cache, without download
    np.testing.assert_array_equal(y, served_archive["train"][1])


def test_download_rejects_a_bad_checksum(served_archive, tmp_path, monkeypatch):
    monkeypatch.setattr(cifar_mod, "_MD5", "0" * 32)
    with pytest.raises(OSError, match="checksum mismatch"):
        load_cifar10("test", download=True)
    cache = tmp_path / "cache" / "parconv" / "cifar10"
    assert os.listdir(cache) == []  # nothing half-written is left to be trusted later


def test_download_failure_lists_the_url(tmp_path, monkeypatch):
    monkeypatch.setattr(cifar_mod, "CIFAR10_URL", (tmp_path / "absent.tar.gz").as_uri())
    with pytest.raises(OSError, match="could not download cifar-10-binary.tar.gz: file://"):
        load_cifar10("test", path=tmp_path / "dl", download=True)


def test_exported():
    assert pc.datasets.load_cifar10 is load_cifar10
    assert len(pc.datasets.CIFAR10_CLASSES) == 10
