"""pc.data: transforms against per-image references, the DataLoader's order, resume, memmaps and threads."""

import gc
import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import parconv as pc
from parconv.data import DataLoader
from parconv.data import transforms as T


def images(n=6, c=3, h=8, w=7, seed=0):
    return np.random.default_rng(seed).standard_normal((n, c, h, w)).astype(np.float32)


# ------------------------------------------------------------------ per-image references
def crop_reference(x, size, padding, rng):
    """One image at a time, drawing the offsets as RandomCrop documents."""
    (h, w), (ph, pw) = size, padding
    n, c, height, width = x.shape
    top = rng.integers(0, height + 2 * ph - h + 1, size=n)
    left = rng.integers(0, width + 2 * pw - w + 1, size=n)
    out = np.empty((n, c, h, w), np.float32)
    for i in range(n):
        img = np.zeros((c, height + 2 * ph, width + 2 * pw), np.float32)
        img[:, ph:ph + height, pw:pw + width] = x[i]
        out[i] = img[:, top[i]:top[i] + h, left[i]:left[i] + w]
    return out


def flip_reference(x, p, rng):
    flip = rng.random(x.shape[0]) < p
    return np.stack([img[:, :, ::-1] if f else img for img, f in zip(x, flip)])


@given(n=st.integers(1, 5), c=st.integers(1, 3), height=st.integers(1, 9), width=st.integers(1, 9),
       ph=st.integers(0, 3), pw=st.integers(0, 3), dh=st.integers(0, 6), dw=st.integers(0, 6),
       seed=st.integers(0, 2**32))
def test_random_crop_matches_per_image_reference(n, c, height, width, ph, pw, dh, dw, seed):
    h, w = max(1, height + 2 * ph - dh), max(1, width + 2 * pw - dw)
    x = images(n, c, height, width, seed % 1000)
    t = T.RandomCrop((h, w), padding=(ph, pw))
    out = t(x, np.random.default_rng(seed))
    assert out.dtype == np.float32 and out.flags.c_contiguous and out.shape == (n, c, h, w)
    np.testing.assert_array_equal(out, crop_reference(x, (h, w), (ph, pw), np.random.default_rng(seed)))


@given(n=st.integers(1, 8), p=st.sampled_from([0.0, 0.3, 0.5, 1.0]), seed=st.integers(0, 2**32))
def test_flip_matches_per_image_reference(n, p, seed):
    x = images(n, 2, 3, 5, seed % 1000)
    before = x.copy()
    out = T.RandomHorizontalFlip(p)(x, np.random.default_rng(seed))
    np.testing.assert_array_equal(out, flip_reference(x, p, np.random.default_rng(seed)))
    np.testing.assert_array_equal(x, before)  # the input is not modified
    assert out.flags.c_contiguous


def test_crop_statistics_and_zero_padding():
    x = np.ones((4000, 1, 4, 4), np.float32)
    out = T.RandomCrop(4, padding=2)(x, np.random.default_rng(1))
    # the sum of a crop counts the image pixels it covers: 4 - |dy| rows times 4 - |dx| columns
    rows_covered = out[:, 0].any(axis=2).sum(axis=1)
    assert set(np.unique(rows_covered)) == {2, 3, 4}
    # offsets are uniform over 5 values per axis: a full-overlap row range has probability 1/5
    assert abs(np.mean(rows_covered == 4) - 0.2) < 0.03
    assert np.isin(out, [0.0, 1.0]).all()
    same = T.RandomCrop(4)(x[:3], np.random.default_rng(0))
    np.testing.assert_array_equal(same, x[:3])


def test_flip_statistics():
    x = np.arange(2 * 5000, dtype=np.float32).reshape(5000, 1, 1, 2)
    out = T.RandomHorizontalFlip(0.3)(x, np.random.default_rng(2))
    flipped = out[:, 0, 0, 0] > out[:, 0, 0, 1]
    assert abs(flipped.mean() - 0.3) < 0.03
    np.testing.assert_array_equal(T.RandomHorizontalFlip(0.0)(x, np.random.default_rng(0)), x)
    np.testing.assert_array_equal(T.RandomHorizontalFlip(1.0)(x, np.random.default_rng(0)), x[..., ::-1])


def test_normalize_per_channel():
    x = images(4, 3, 5, 5)
    mean, std = [0.1, -0.2, 0.3], [0.5, 2.0, 0.25]
    out = T.Normalize(mean, std)(x)
    expected = (x - np.float32(mean).reshape(1, 3, 1, 1)) / np.float32(std).reshape(1, 3, 1, 1)
    np.testing.assert_array_equal(out, expected)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(T.Normalize(0.5, 2.0)(x), (x - np.float32(0.5)) / np.float32(2.0))
    flat = np.random.default_rng(0).random((5, 3)).astype(np.float32)  # (N, C) works too
    np.testing.assert_allclose(T.Normalize(mean, std)(flat), (flat - mean) / std, rtol=1e-6)
    u8 = np.full((2, 3, 2, 2), 255, np.uint8)
    assert T.Normalize(mean, std)(u8).dtype == np.float32


def test_normalize_matches_torchvision_formula():
    torch = pytest.importorskip("torch")
    x = images(3, 3, 4, 4)
    mean, std = [0.49, 0.48, 0.45], [0.25, 0.24, 0.26]
    ref = (torch.from_numpy(x) - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    np.testing.assert_allclose(T.Normalize(mean, std)(x), ref.numpy(), rtol=1e-6, atol=1e-7)


def test_compose_draws_in_sequence():
    x = images(5, 3, 8, 8)
    crop, flip, norm = T.RandomCrop(6, padding=1), T.RandomHorizontalFlip(), T.Normalize([0, 0, 0], [2, 2, 2])
    composed = T.Compose([crop, flip, norm, lambda a: a + 1])
    out = composed(x, np.random.default_rng(3))
    rng = np.random.default_rng(3)
    expected = norm(flip(crop(x, rng), rng)) + 1
    np.testing.assert_array_equal(out, expected)
    assert "RandomCrop(size=(6, 6), padding=(1, 1))" in repr(composed)


def test_own_generator_seeded():
    x = images(6)
    a, b = T.RandomHorizontalFlip(seed=5), T.RandomHorizontalFlip(seed=5)
    np.testing.assert_array_equal(a(x), b(x))
    pc.manual_seed(11)
    first = [T.RandomCrop(6, padding=2)(x) for _ in range(2)]
    pc.manual_seed(11)
    again = [T.RandomCrop(6, padding=2)(x) for _ in range(2)]
    for u, v in zip(first, again):
        np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("make, exc, match", [
    (lambda: T.RandomCrop(0), ValueError, "size must be >= 1"),
    (lambda: T.RandomCrop((3, 3, 3)), TypeError, r"size must be an int or a pair \(h, w\)"),
    (lambda: T.RandomCrop(3, padding=-1), ValueError, "padding must be >= 0"),
    (lambda: T.RandomCrop(3, padding=1.5), TypeError, "padding must be an int"),
    (lambda: T.RandomHorizontalFlip(1.5), ValueError, r"p must be a probability in \[0, 1\], got 1.5"),
    (lambda: T.Normalize([0, 0], [1, 1, 1]), ValueError, "same length"),
    (lambda: T.Normalize([0], [0.0]), ValueError, "std must be > 0"),
    (lambda: T.Normalize("a", 1), TypeError, "mean must be a number or a sequence"),
    (lambda: T.Compose(T.Normalize(0, 1)), TypeError, "transforms must be a list"),
    (lambda: T.Compose([3]), TypeError, r"transforms\[0\] must be callable"),
    (lambda: T.RandomCrop(3, seed=-1), ValueError, "seed must be an int >= 0"),
])
def test_transform_arguments_validated(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_transform_inputs_validated():
    x = images(2, 3, 4, 4)
    with pytest.raises(ValueError, match=r"size \(9, 9\) is larger than the padded image \(6, 6\)"):
        T.RandomCrop(9, padding=1)(x, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"4-D \(N, C, H, W\) batch, got shape \(2, 3, 4\)"):
        T.RandomHorizontalFlip()(x[:, :, 0], np.random.default_rng(0))
    with pytest.raises(TypeError, match="x must be a NumPy array batch, got list"):
        T.RandomHorizontalFlip()([[1.0]], np.random.default_rng(0))
    with pytest.raises(ValueError, match="mean has 2 values but x has 3 channels"):
        T.Normalize([0, 0], [1, 1])(x)
    with pytest.raises(TypeError, match="rng must be a numpy.random.Generator"):
        T.RandomCrop(2)(x, rng=3)


# ------------------------------------------------------------------ DataLoader over arrays
def collect(it):
    return [(xb.copy(), None if yb is None else yb.copy()) for xb, yb in it]


def test_loader_batches_cover_every_sample_once():
    x = np.arange(23 * 2, dtype=np.float64).reshape(23, 2)
    y = np.arange(23, dtype=np.int32)
    loader = DataLoader(x, y, batch_size=5, seed=3)
    assert len(loader) == 5 and loader.num_samples == 23
    batches = collect(loader)
    assert [b[0].shape for b in batches] == [(5, 2)] * 4 + [(3, 2)]
    for xb, yb in batches:
        assert xb.dtype == np.float32 and xb.flags.c_contiguous
        assert yb.dtype == np.int32
        np.testing.assert_array_equal(xb[:, 0], 2 * yb)  # rows stay paired with their labels
    seen = np.concatenate([yb for _, yb in batches])
    assert sorted(seen.tolist()) == list(range(23)) and seen.tolist() != list(range(23))
    assert len(DataLoader(x, y, batch_size=5, drop_last=True)) == 4
    assert [len(yb) for _, yb in DataLoader(x, y, batch_size=5, drop_last=True)] == [5] * 4


def test_loader_order_depends_only_on_seed_and_epoch():
    x = np.arange(50, dtype=np.float32).reshape(50, 1)
    a, b = DataLoader(x, batch_size=8, seed=7), DataLoader(x, batch_size=8, seed=7)
    np.testing.assert_array_equal(a.order(3), b.order(3))
    assert not np.array_equal(a.order(0), a.order(1))
    assert not np.array_equal(a.order(0), DataLoader(x, batch_size=8, seed=8).order(0))
    first, second = collect(a), collect(a)  # iter() runs epoch 0, then epoch 1
    for got, want in zip(first + second, collect(b.epoch(0)) + collect(b.epoch(1))):
        np.testing.assert_array_equal(got[0], want[0])
    assert [yb for _, yb in first] == [None] * len(first)
    np.testing.assert_array_equal(np.concatenate([xb for xb, _ in first])[:, 0], a.order(0))
    plain = DataLoader(x, batch_size=8, shuffle=False)
    np.testing.assert_array_equal(np.concatenate([xb for xb, _ in plain])[:, 0], np.arange(50))


@pytest.mark.parametrize("prefetch", [0, 2])
def test_resume_mid_epoch_is_bit_identical(prefetch):
    x = images(37, 3, 8, 8)
    y = np.arange(37) % 10
    aug = T.Compose([T.RandomCrop(8, padding=2), T.RandomHorizontalFlip(), T.Normalize([0.1] * 3, [0.9] * 3)])
    loader = DataLoader(x, y, batch_size=6, transform=aug, seed=12, prefetch=prefetch)
    full = collect(loader.epoch(4))
    tail = collect(DataLoader(x, y, batch_size=6, transform=aug, seed=12, prefetch=2).epoch(4, start_batch=3))
    assert len(tail) == len(full) - 3
    for (xa, ya), (xb, yb) in zip(full[3:], tail):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)
    assert collect(loader.epoch(4, start_batch=len(loader))) == []
    again = collect(loader.epoch(4))
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(full, again))
    other = collect(loader.epoch(5))
    assert not np.array_equal(full[0][0], other[0][0])


def test_transform_sees_the_batch_generator():
    calls = []

    class Record(T.Transform):
        def apply(self, x, rng):
            calls.append(rng.integers(1 << 30))
            return x * 2

    x = np.ones((10, 1, 2, 2), np.float32)
    loader = DataLoader(x, batch_size=4, transform=Record(), seed=1)
    out = collect(loader.epoch(2))
    assert all((xb == 2).all() for xb, _ in out)
    collect(loader.epoch(2, start_batch=1))
    assert calls[1:3] == calls[3:5]  # batches 1 and 2 drew the same numbers both times
    assert len(set(calls[:3])) == 3
    doubled = collect(DataLoader(x, batch_size=4, transform=lambda a: a + 1, seed=1))
    assert all((xb == 2).all() for xb, _ in doubled)


def test_seed_none_follows_manual_seed():
    x = np.arange(30, dtype=np.float32).reshape(30, 1)
    pc.manual_seed(3)
    a = DataLoader(x, batch_size=4)
    pc.manual_seed(3)
    b = DataLoader(x, batch_size=4)
    assert a.seed == b.seed
    np.testing.assert_array_equal(a.order(0), b.order(0))


def test_memmap_batches_equal_in_memory_batches(tmp_path):
    data = images(40, 2, 3, 3).astype(np.float64)
    mm = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float64, shape=data.shape)
    mm[:] = data
    mm.flush()
    del mm
    x = np.load(tmp_path / "x.npy", mmap_mode="r")
    labels = np.memmap(tmp_path / "y.bin", dtype=np.int64, mode="w+", shape=(40,))
    labels[:] = np.arange(40)
    loader = DataLoader(x, labels, batch_size=7, seed=5, transform=T.RandomHorizontalFlip())
    assert isinstance(loader.x, np.memmap)  # not read into memory
    ref = DataLoader(data, np.arange(40), batch_size=7, seed=5, transform=T.RandomHorizontalFlip())
    for (xa, ya), (xb, yb) in zip(collect(loader.epoch(1)), collect(ref.epoch(1))):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)
        assert type(ya) is np.ndarray and ya.dtype == np.int64


def test_memmap_rows_are_read_in_file_order(tmp_path):
    reads = []

    class Recording(np.memmap):
        def __getitem__(self, index):
            if isinstance(index, np.ndarray):
                reads.append(index.copy())
            return super().__getitem__(index)

    mm = Recording(tmp_path / "x.bin", dtype=np.float32, mode="w+", shape=(30, 2))
    mm[:] = np.arange(60, dtype=np.float32).reshape(30, 2)
    loader = DataLoader(mm, batch_size=8, seed=4, prefetch=0)
    batches = collect(loader.epoch(0))
    order = loader.order(0)
    for b, (xb, _) in enumerate(batches):  # batch order kept, though the rows were read sorted
        np.testing.assert_array_equal(xb[:, 0], 2 * order[b * 8:(b + 1) * 8])
    assert len(reads) == 4 and all((np.diff(r) > 0).all() for r in reads)


# ------------------------------------------------------------------ batch sources
def test_generator_source():
    def batches():
        for i in range(3):
            yield np.full((2, 3), i, np.float64), np.array([i, i])
        yield np.zeros((1, 3), np.int32)

    loader = DataLoader(batches(), seed=0, transform=lambda a: a + 1)
    assert loader.num_samples is None
    out = collect(loader)
    assert [xb[0, 0] for xb, _ in out] == [1.0, 2.0, 3.0, 1.0]
    assert out[3][1] is None and out[1][1].tolist() == [1, 1]
    assert all(xb.dtype == np.float32 for xb, _ in out)
    with pytest.raises(TypeError, match="number of batches of a generator source is unknown"):
        len(loader)
    with pytest.raises(RuntimeError, match="one-shot iterator"):
        iter(loader)


def test_reiterable_source_and_start_batch():
    class Source:
        def __len__(self):
            return 4

        def __iter__(self):
            return ((np.full((2, 1), i, np.float32), np.array([i, i])) for i in range(4))

    loader = DataLoader(Source())
    assert len(loader) == 4
    assert [yb[0] for _, yb in loader] == [0, 1, 2, 3]
    assert [yb[0] for _, yb in loader.epoch(1, start_batch=2)] == [2, 3]


def test_bad_source_batches_raise_in_the_consumer():
    loader = DataLoader(iter([(np.zeros((2, 2)), np.zeros(3))]))
    with pytest.raises(ValueError, match=r"batch 0 of the source: x has 2 samples but y has shape \(3,\)"):
        collect(loader)
    loader = DataLoader(iter(["text"]), prefetch=0)
    with pytest.raises(TypeError, match="must be an \\(x, y\\) pair or an array, got str"):
        collect(loader)


# ------------------------------------------------------------------ worker thread
def loader_threads():
    return [t for t in threading.enumerate() if t.name == "parconv-DataLoader"]


def wait_no_threads(timeout=5.0):
    deadline = time.monotonic() + timeout
    while loader_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return loader_threads()


def test_worker_exception_reraised_and_thread_ends():
    def bad(x):
        if x[0, 0] >= 8:
            raise ArithmeticError("bad batch")
        return x

    x = np.arange(20, dtype=np.float32).reshape(20, 1)
    it = iter(DataLoader(x, batch_size=4, shuffle=False, transform=bad))
    assert next(it)[0][0, 0] == 0 and next(it)[0][0, 0] == 4
    with pytest.raises(ArithmeticError, match="bad batch"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    assert wait_no_threads() == []


def test_threads_stop_when_closed_or_dropped():
    x = np.zeros((1000, 4), np.float32)
    loader = DataLoader(x, batch_size=1, prefetch=3)
    it = iter(loader)
    next(it)
    assert len(loader_threads()) == 1
    it.close()
    assert loader_threads() == []
    for _ in range(5):  # abandoned part-way, many times over
        it = loader.epoch(0)
        next(it)
        del it
    gc.collect()
    assert wait_no_threads() == []
    with loader.epoch(1) as it:
        next(it)
    assert wait_no_threads() == []
    assert sum(1 for _ in loader.epoch(0)) == 1000
    assert wait_no_threads() == []


def test_prefetch_zero_matches_threaded():
    x = images(17, 3, 6, 6)
    aug = T.Compose([T.RandomCrop(5, padding=1), T.RandomHorizontalFlip()])
    a = collect(DataLoader(x, batch_size=4, transform=aug, seed=2, prefetch=0))
    b = collect(DataLoader(x, batch_size=4, transform=aug, seed=2, prefetch=4))
    assert all(np.array_equal(u[0], v[0]) for u, v in zip(a, b)) and len(a) == len(b) == 5


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("kwargs, exc, match", [
    ({"x": np.zeros((4, 2)), "batch_size": 0}, ValueError, "batch_size must be >= 1, got 0"),
    ({"x": np.zeros((4, 2)), "batch_size": 2.0}, TypeError, "batch_size must be an int, got float"),
    ({"x": np.zeros((4, 2)), "shuffle": 1}, TypeError, "shuffle must be a bool, got int"),
    ({"x": np.zeros((4, 2)), "prefetch": -1}, ValueError, "prefetch must be >= 0"),
    ({"x": np.zeros((4, 2)), "seed": -2}, ValueError, "seed must be >= 0"),
    ({"x": np.zeros((4, 2)), "transform": 3}, TypeError, "transform must be callable or None, got int"),
    ({"x": np.array(["a", "b"])}, TypeError, "x must be a numeric array, got dtype <U1"),
    ({"x": np.zeros((4, 2)), "y": np.zeros(3)}, ValueError, "same number of samples, got 4 and 3"),
    ({"x": np.zeros((4, 2)), "y": np.array([None] * 4)}, TypeError, "y must be a numeric array, got dtype object"),
    ({"x": np.zeros((0, 2))}, ValueError, "at least one sample"),
    ({"x": np.float32(3.0)}, ValueError, "must have a sample axis"),
    ({"x": [[1.0], [2.0, 3.0]]}, TypeError, "x must be a numeric array-like"),
    ({"x": np.zeros((4, 2)), "batch_size": 5, "drop_last": True}, ValueError, "leaves no batch"),
    ({"x": iter([]), "y": np.zeros(3)}, ValueError, "y must be None when x is an iterable"),
])
def test_loader_arguments_validated(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        DataLoader(**kwargs)


def test_epoch_arguments_validated():
    loader = DataLoader(np.zeros((10, 1)), batch_size=3)
    with pytest.raises(ValueError, match="start_batch must be <= 4"):
        loader.epoch(0, start_batch=5)
    with pytest.raises(ValueError, match="epoch must be >= 0"):
        loader.epoch(-1)
    with pytest.raises(ValueError, match="transform changed the batch size from 3 to 1"):
        collect(DataLoader(np.zeros((10, 1)), batch_size=3, transform=lambda a: a[:1]))
