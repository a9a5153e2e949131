"""DataLoader: seeded, resumable mini-batches with background prefetch."""

from __future__ import annotations

import math
import numbers
import queue
import threading
import weakref

import numpy as np

from ..layers import _rng as _global_rng
from .transforms import Transform

__all__ = ["DataLoader"]

_ITEM, _END, _ERROR = 0, 1, 2
_POLL_S = 0.05  # how often a blocked worker looks at its stop flag


def _check_bool(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"DataLoader: {name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def _check_int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"DataLoader: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"DataLoader: {name} must be >= {minimum}, got {value}")
    return int(value)


def _as_array(a, name: str) -> np.ndarray:
    """A numeric host array without reading it (a memmap stays a memmap)."""
    if not isinstance(a, np.ndarray):
        if hasattr(a, "get") and hasattr(a, "dtype"):
            raise TypeError(f"DataLoader: {name} must be host data, got a device array {type(a).__name__}; "
                            f"use parconv.to_numpy(...)")
        try:
            a = np.asarray(a)
        except Exception as exc:  # ragged lists and the like
            raise TypeError(f"DataLoader: {name} must be a numeric array-like: {exc}") from None
    if a.dtype.kind not in "biuf":
        raise TypeError(f"DataLoader: {name} must be a numeric array, got dtype {a.dtype}")
    if a.ndim == 0:
        raise ValueError(f"DataLoader: {name} must have a sample axis, got a 0-d array")
    return a


def _float_batch(x, where: str) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        try:
            x = np.asarray(x)
        except Exception as exc:
            raise TypeError(f"{where}: x must be a numeric array-like: {exc}") from None
    if x.dtype.kind not in "biuf" or x.ndim == 0:
        raise TypeError(f"{where}: x must be a numeric (N, ...) array, got dtype {x.dtype} shape {x.shape}")
    return np.ascontiguousarray(x, dtype=np.float32)


def _worker(produce, q: queue.Queue, stop: threading.Event) -> None:
    """Run ``produce()`` into ``q`` until it ends, fails or ``stop`` is set."""

    def put(msg) -> bool:
        while not stop.is_set():
            try:
                q.put(msg, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    try:
        for item in produce():
            if not put((_ITEM, item)):
                return
        put((_END, None))
    except BaseException as exc:  # handed to the consumer, which re-raises it
        put((_ERROR, exc))


def _shutdown(stop: threading.Event, q: queue.Queue) -> None:
    stop.set()
    try:
        while True:
            q.get_nowait()
    except queue.Empty:
        pass


class _BatchIterator:
    """Iterator over one epoch; batches are made ``prefetch`` ahead on a worker thread.

    The worker holds no reference to this object, so dropping the iterator
    (or :meth:`close`) stops the thread.
    """

    def __init__(self, produce, prefetch: int):
        self._done = False
        self._thread = None
        if prefetch == 0:
            self._gen = produce()
            return
        self._gen = None
        self._queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=_worker, args=(produce, self._queue, self._stop),
                                        name="parconv-DataLoader", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, _shutdown, self._stop, self._queue)

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        if self._thread is None:
            try:
                return next(self._gen)
            except StopIteration:
                self._done = True
                raise
        while True:
            try:
                kind, item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self.close()
                    raise RuntimeError("DataLoader: the worker thread ended without a result") from None
        if kind == _ITEM:
            return item
        self.close()
        if kind == _ERROR:
            raise item
        raise StopIteration

    def close(self) -> None:
        """Stop the worker thread (waits for it) and end the iteration."""
        self._done = True
        if self._thread is not None:
            self._finalizer()
            self._thread.join()
        elif self._gen is not None:
            self._gen.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class DataLoader:
    """Mini-batches of arrays, memmaps or a batch generator, seeded and resumable.

    Every batch is a pair ``(x, y)``: ``x`` a float32 C-contiguous
    ``(B, ...)`` array (after ``transform``), ``y`` the labels' rows as given
    (int labels stay ints) or ``None`` without labels. Gathering, conversion
    and the transform run on a background thread ``prefetch`` batches ahead
    of the consumer.

    The order of an epoch depends only on ``(seed, epoch)`` and each batch's
    transform draws from a generator seeded by ``(seed, epoch, batch index)``,
    so :meth:`epoch` can restart a run in the middle of an epoch and produce
    the same batches bit for bit.

    Parameters
    ----------
    x : array-like (N, ...), numpy.memmap, or iterable of batches
        Samples. A ``numpy.memmap`` (or any array) bigger than memory is
        fine: each batch reads only its rows. Anything else that is iterable
        but not a list, a tuple or an object with ``shape`` and ``dtype`` is
        a *batch source*: it yields ``(x, y)`` pairs (or ``x`` alone); then
        ``y`` must be ``None``, ``shuffle``, ``drop_last`` and ``batch_size``
        do not apply, and a one-shot generator serves one epoch only (pass
        an object whose ``__iter__`` starts afresh for several).
    y : array-like (N, ...), optional
        Labels or targets, row ``i`` belonging to ``x[i]``.
    batch_size : int, default 32
    shuffle : bool, default True
        Draw a new permutation for every epoch.
    transform : callable, optional
        Applied to each ``x`` batch. A :class:`~parconv.data.transforms.Transform`
        is called ``transform(x, rng)`` with the batch's own generator; any
        other callable as ``transform(x)``.
    drop_last : bool, default False
        Leave out the last, smaller batch.
    seed : int, optional
        Seed of the order and the augmentation. ``None`` draws one from the
        global generator (:func:`parconv.manual_seed`) here, once.
    prefetch : int, default 2
        Batches made ahead on the worker thread; 0 makes them in the
        consumer's thread.
    num_replicas, rank : int, optional
        Shard the batches over ``num_replicas`` data-parallel ranks, as PyTorch's
        ``DistributedSampler``: every rank draws the same order (give every
        rank the same ``seed``; it changes with the epoch), and this ``rank``
        yields its contiguous share of every batch -- ``batch_size`` stays
        the global batch, every rank has ``len(loader)`` batches, and over an
        epoch the ranks' shares are disjoint and cover the data once. A share
        may be empty (``(0, ...)`` arrays) in a last batch smaller than the
        ranks. Transforms draw per rank. ``fit(loader, distributed=...)``
        shards an unsharded loader over its ranks this way by itself.

    Attributes
    ----------
    num_samples : int or None
        ``N`` (``None`` for a batch source).
    seed : int

    Examples
    --------
    >>> import numpy as np
    >>> from parconv.data import DataLoader
    >>> x, y = np.arange(10.0).reshape(10, 1), np.arange(10)
    >>> loader = DataLoader(x, y, batch_size=4, shuffle=False)
    >>> len(loader), loader.num_samples
    (3, 10)
    >>> [yb.tolist() for xb, yb in loader]
    [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    >>> xb, yb = next(iter(DataLoader(x, y, batch_size=4, seed=0)))
    >>> xb.dtype, xb.shape
    (dtype('float32'), (4, 1))
    """

    def __init__(self, x, y=None, batch_size: int = 32, shuffle: bool = True, transform=None,
                 drop_last: bool = False, seed: int | None = None, prefetch: int = 2, num_replicas: int | None = None,
                 rank: int | None = None):
        self.batch_size = _check_int(batch_size, "batch_size", 1)
        if (num_replicas is None) != (rank is None):
            raise ValueError(f"DataLoader: num_replicas and rank must be given together (a shard of the data), "
                             f"got num_replicas={num_replicas!r}, rank={rank!r}")
        self.num_replicas = None if num_replicas is None else _check_int(num_replicas, "num_replicas", 1)
        self.rank = None if rank is None else _check_int(rank, "rank", 0)
        if self.rank is not None and self.rank >= self.num_replicas:
            raise ValueError(f"DataLoader: rank must be < num_replicas={self.num_replicas}, got {self.rank}")
        self.shuffle = _check_bool(shuffle, "shuffle")
        self.drop_last = _check_bool(drop_last, "drop_last")
        self.prefetch = _check_int(prefetch, "prefetch", 0)
        if transform is not None and not callable(transform):
            raise TypeError(f"DataLoader: transform must be callable or None, got {type(transform).__name__}")
        self.transform = transform
        if seed is None:
            seed = int(_global_rng(None).integers(2**63))  # pc.manual_seed makes this reproducible
        self.seed = _check_int(seed, "seed", 0)
        self._next_epoch = 0
        self._source = None
        self._source_started = False
        array_like = isinstance(x, (np.ndarray, list, tuple)) or (hasattr(x, "shape") and hasattr(x, "dtype"))
        if not array_like and hasattr(x, "__iter__"):
            if y is not None:
                raise ValueError("DataLoader: y must be None when x is an iterable of (x, y) batches")
            if self.num_replicas is not None:
                raise ValueError("DataLoader: num_replicas/rank shard arrays; a batch source cannot be sharded "
                                 "(let each rank's source yield its own batches)")
            self._source = x
            self.x = self.y = None
            self.num_samples = None
            return
        self.x = _as_array(x, "x")
        self.num_samples = int(self.x.shape[0])
        if self.num_samples == 0:
            raise ValueError(f"DataLoader: x must hold at least one sample, got shape {self.x.shape}")
        self.y = None
        if y is not None:
            self.y = _as_array(y, "y")
            if self.y.shape[0] != self.num_samples:
                raise ValueError(f"DataLoader: x and y must have the same number of samples, got "
                                 f"{self.num_samples} and {self.y.shape[0]}")
        if self.drop_last and self.num_samples < self.batch_size:
            raise ValueError(f"DataLoader: drop_last=True with {self.num_samples} samples and batch_size="
                             f"{self.batch_size} leaves no batch")

    def __len__(self) -> int:
        """Batches per epoch."""
        if self._source is not None:
            if hasattr(self._source, "__len__"):
                return len(self._source)
            raise TypeError("DataLoader: the number of batches of a generator source is unknown")
        if self.drop_last:
            return self.num_samples // self.batch_size
        return math.ceil(self.num_samples / self.batch_size)

    def __repr__(self) -> str:
        what = f"num_samples={self.num_samples}" if self._source is None else f"source={type(self._source).__name__}"
        shard = "" if self.num_replicas is None else f", num_replicas={self.num_replicas}, rank={self.rank}"
        return (f"DataLoader({what}, batch_size={self.batch_size}, shuffle={self.shuffle}, "
                f"transform={self.transform!r}, seed={self.seed}{shard})")

    def order(self, epoch: int) -> np.ndarray:
        """The sample indices of ``epoch`` in the order they are batched (int64, length N).

        Depends only on ``(seed, epoch)``.
        """
        epoch = _check_int(epoch, "epoch", 0)
        if self._source is not None:
            raise TypeError("DataLoader.order: a batch source has no sample order")
        if not self.shuffle:
            return np.arange(self.num_samples, dtype=np.int64)
        return np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(0, epoch))).permutation(
            self.num_samples)

    def _batch_rng(self, epoch: int, index: int, rank=None) -> np.random.Generator:
        key = (1, epoch, index) if rank is None else (2, epoch, index, rank)  # a shard draws its own stream
        return np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=key))

    def _finish(self, xb: np.ndarray, epoch: int, index: int, rank=None) -> np.ndarray:
        t = self.transform
        if t is None or xb.shape[0] == 0:
            return xb
        out = t(xb, self._batch_rng(epoch, index, rank)) if isinstance(t, Transform) else t(xb)
        out = _float_batch(out, "DataLoader: transform output")
        if out.shape[0] != xb.shape[0]:
            raise ValueError(f"DataLoader: the transform changed the batch size from {xb.shape[0]} to "
                             f"{out.shape[0]}")
        return out

    def _take(self, a: np.ndarray, idx: np.ndarray) -> np.ndarray:
        if isinstance(a, np.memmap):
            # read the rows in file order (sequential pages), then put them back in batch order
            perm = np.argsort(idx, kind="stable")
            rows = np.asarray(a[idx[perm]])
            out = np.empty_like(rows)
            out[perm] = rows
            return out
        return a[idx]

    def epoch(self, epoch: int, start_batch: int = 0) -> _BatchIterator:
        """Iterator over the batches of ``epoch``, from batch ``start_batch`` on.

        The skipped batches are not computed (for a batch source they are
        read and dropped). Closing the iterator, or dropping it, stops its
        worker thread.

        Parameters
        ----------
        epoch : int >= 0
        start_batch : int >= 0, default 0

        Returns
        -------
        iterator of (x, y) pairs
        """
        epoch = _check_int(epoch, "epoch", 0)
        start_batch = _check_int(start_batch, "start_batch", 0)
        if self._source is not None:
            if iter(self._source) is self._source:  # a generator or other one-shot iterator
                if self._source_started:
                    raise RuntimeError("DataLoader: the batch source is a one-shot iterator (e.g. a generator) "
                                       "and served its epoch already; pass an object whose __iter__ starts "
                                       "afresh to run several epochs")
                self._source_started = True
            return _BatchIterator(lambda: self._source_batches(epoch, start_batch), self.prefetch)
        n_batches = len(self)
        if start_batch > n_batches:
            raise ValueError(f"DataLoader.epoch: start_batch must be <= {n_batches} (batches per epoch), "
                             f"got {start_batch}")
        if self.num_replicas is not None:
            return self._shard_epoch(epoch, start_batch, self.rank, self.num_replicas)
        order = self.order(epoch)
        return _BatchIterator(lambda: self._array_batches(order, epoch, start_batch, n_batches), self.prefetch)

    def _shard_epoch(self, epoch: int, start_batch: int, rank: int, size: int, placeholder: bool = False):
        """Rank ``rank`` of ``size``'s share of every batch of ``epoch``: ``(x, y, global batch size)``
        triples with ``placeholder``, else ``(x, y)`` pairs. With ``placeholder`` an empty share is the
        batch's first sample instead (the caller weights it 0)."""
        n_batches = len(self)
        if start_batch > n_batches:
            raise ValueError(f"DataLoader.epoch: start_batch must be <= {n_batches} (batches per epoch), "
                             f"got {start_batch}")
        order = self.order(epoch)
        return _BatchIterator(lambda: self._shard_batches(order, epoch, start_batch, n_batches, rank, size,
                                                          placeholder), self.prefetch)

    def _shard_batches(self, order, epoch, start_batch, n_batches, rank, size, placeholder):
        bs = self.batch_size
        for b in range(start_batch, n_batches):
            batch = order[b * bs:(b + 1) * bs]
            count = len(batch)
            # the split of parconv.distributed.shard_bounds: the first count % size ranks take one more
            base, rem = divmod(count, size)
            lo = rank * base + min(rank, rem)
            idx = batch[lo:lo + base + (1 if rank < rem else 0)]
            if placeholder and len(idx) == 0:
                idx = batch[:1]
            xb = np.ascontiguousarray(self._take(self.x, idx), dtype=np.float32)
            yb = None if self.y is None else self._take(self.y, idx)
            xb = self._finish(xb, epoch, b, rank)
            yield (xb, yb, count) if placeholder else (xb, yb)

    def _array_batches(self, order, epoch, start_batch, n_batches):
        bs = self.batch_size
        for b in range(start_batch, n_batches):
            idx = order[b * bs:(b + 1) * bs]
            xb = np.ascontiguousarray(self._take(self.x, idx), dtype=np.float32)
            yb = None if self.y is None else self._take(self.y, idx)
            yield self._finish(xb, epoch, b), yb

    def _source_batches(self, epoch, start_batch):
        for b, item in enumerate(self._source):
            if b < start_batch:
                continue
            where = f"DataLoader: batch {b} of the source"
            if isinstance(item, (tuple, list)) and len(item) == 2:
                xb, yb = item
            elif isinstance(item, (tuple, list)) and len(item) == 1:
                xb, yb = item[0], None
            elif isinstance(item, np.ndarray):
                xb, yb = item, None
            else:
                raise TypeError(f"{where} must be an (x, y) pair or an array, got {type(item).__name__}")
            xb = _float_batch(xb, where)
            if yb is not None:
                yb = np.asarray(yb)
                if yb.ndim == 0 or yb.shape[0] != xb.shape[0]:
                    raise ValueError(f"{where}: x has {xb.shape[0]} samples but y has shape {yb.shape}")
            yield self._finish(xb, epoch, b), yb

    def __iter__(self) -> _BatchIterator:
        """Epoch 0 on the first call, then epoch 1, 2, ..."""
        it = self.epoch(self._next_epoch)
        self._next_epoch += 1
        return it
