"""Scale out over MPI (mpi4py): data-parallel training and filter-parallel convolution.

This module imports :mod:`mpi4py` (and so initialises MPI) when it is first
used; ``import parconv`` never does. Run programs that use it with
``mpiexec -n N python script.py`` (or ``mpiexec -n N parconv train --distributed``).

Shapes: ``N`` batch, ``C`` in-channels, ``O`` filters, ``H, W`` input,
``P, Q`` output, ``K`` kernel; ``R`` ranks.

Failure behaviour: every collective entry point here runs under
:func:`abort_on_error`, so an exception on one rank -- or an exit, even
``sys.exit(0)`` -- prints its traceback with the rank and calls
``comm.Abort(1)``: the other ranks, which would otherwise wait forever in a
collective, are ended too. Importing this module under more than one rank
installs :func:`install_excepthook`, which does the same for exceptions raised
in user code (``python -m mpi4py script.py`` is equivalent). A distributed
``fit`` first compares its arguments over the ranks (sample count, batch size,
epochs, resuming, ...) and raises :class:`DistributedArgumentError` on every
rank alike when they differ.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback

import numpy as np

try:
    from mpi4py import MPI
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"parconv.distributed needs mpi4py and an MPI library ({exc}); "
        'install them with: pip install "parconv[mpi]"'
    ) from exc

from . import _config
from .amp import current_precision
from .layers import Conv2d, Layer, Parameter
from .training import register_reducer_factory
from ._validation import check_float, check_int, shape_of, state_array

__all__ = [
    "MPI",
    "DataParallel",
    "FilterParallelConv2d",
    "abort_on_error",
    "install_excepthook",
    "DistributedArgumentError",
    "configure_threads",
    "default_threads",
    "shard_bounds",
    "split_sizes",
]


# --------------------------------------------------------------- helpers
class DistributedArgumentError(ValueError):
    """The ranks of a distributed call were given different arguments (raised on every rank alike)."""


def _comm(comm, where: str):
    if comm is None:
        return MPI.COMM_WORLD
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"{where}: comm must be an mpi4py communicator (e.g. MPI.COMM_WORLD) or None, "
                        f"got {type(comm).__name__}")
    return comm


def split_sizes(n: int, parts: int) -> list[int]:
    """Sizes of ``n`` items split into ``parts`` contiguous pieces, the first ``n % parts`` one larger.

    >>> split_sizes(5, 2)
    [3, 2]
    """
    base, rem = divmod(int(n), int(parts))
    return [base + (1 if r < rem else 0) for r in range(parts)]


def shard_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, stop)`` of piece ``index`` of :func:`split_sizes` ``(n, parts)``.

    >>> [shard_bounds(5, 2, r) for r in range(2)]
    [(0, 3), (3, 5)]
    """
    base, rem = divmod(int(n), int(parts))
    start = index * base + min(index, rem)
    return start, start + base + (1 if index < rem else 0)


def _rank_prefix(comm) -> str:
    try:
        return f"rank {comm.Get_rank()} of {comm.Get_size()}"
    except Exception:  # noqa: BLE001 - MPI may be half torn down
        return "rank ?"


def _report_and_abort(comm, exc_type, exc, tb, where: str) -> None:
    """Print the traceback naming the rank, then end every rank of ``comm``."""
    prefix = _rank_prefix(comm)
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    lines = [f"parconv.distributed: {prefix} failed in {where}; aborting all ranks\n"]
    lines += [f"[{prefix}] {line}\n" for line in text.rstrip("\n").split("\n")]
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001
        pass
    # one write per line: a pipe keeps short writes whole, so ranks failing together never split a line
    for line in lines:
        sys.stderr.write(line)
        sys.stderr.flush()
    # give mpiexec a moment to forward this output: the abort tears down the forwarding too
    time.sleep(0.3)
    _abort(comm, 1)


def _abort(comm, code: int) -> None:
    """``comm.Abort(code)``, and never return: some MPI builds return from it while the job is torn down."""
    try:
        comm.Abort(code)
    finally:
        os._exit(code)


@contextlib.contextmanager
def abort_on_error(comm=None, where: str = "a distributed call", passthrough: tuple = ()):
    """Context manager: an exception inside aborts every rank of ``comm`` instead of hanging them.

    The traceback is printed to stderr with the rank, then ``comm.Abort(1)``
    ends the whole job (``mpiexec`` exits non-zero). Exceptions of the types
    in ``passthrough`` -- errors every rank raises at the same point, such as
    :class:`parconv.TrainingDivergedError` in ``fit`` -- propagate normally.
    Any ``SystemExit`` inside aborts too: the other ranks would otherwise
    wait for this one forever. With one rank nothing is aborted.

    Examples
    --------
    >>> from parconv import distributed as dist
    >>> with dist.abort_on_error(where="my step"):
    ...     pass
    """
    comm = _comm(comm, "abort_on_error")
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - any failure must end the job
        if comm.Get_size() == 1 or isinstance(exc, passthrough):
            raise
        # an exit of one rank, even a clean one, would leave the others waiting in a collective
        _report_and_abort(comm, type(exc), exc, exc.__traceback__, where)


_hooked_comms: set = set()


def install_excepthook(comm=None) -> None:
    """Make an uncaught exception on any rank print its traceback with the rank and abort the job.

    Chains the previous ``sys.excepthook``; installing twice is harmless.
    """
    comm = _comm(comm, "install_excepthook")
    key = id(comm)
    if key in _hooked_comms:
        return
    _hooked_comms.add(key)
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if comm.Get_size() == 1:
            previous(exc_type, exc, tb)
        elif issubclass(exc_type, KeyboardInterrupt):
            _abort(comm, 130)
        else:
            _report_and_abort(comm, exc_type, exc, tb, "the program (uncaught exception)")

    sys.excepthook = hook


# ------------------------------------------------------------- a rank that exits
_EXIT_TAG = 7303  # tag of the "this rank is exiting" notice (point-to-point: never matches a collective)
#: seconds a rank's main thread may stay at one instruction after a peer exited before the job is aborted
EXIT_STALL_S = 4.0
_POLL_S = 0.05


class _ExitWatch:
    """Ends the job when a rank exits (``sys.exit``, the end of the program) while another waits for it.

    At exit every rank sends a notice to the others and waits for theirs:
    when all ranks end together the job finishes normally. A non-zero exit
    status aborts at once. On every rank a watchdog thread receives the
    notices; when a peer has exited and this rank's main thread stays at
    the same instruction for :data:`EXIT_STALL_S` seconds -- blocked in a
    collective that can never complete -- it prints which rank exited, how,
    and where this one waits, then calls ``comm.Abort``. A rank still
    computing (say, rank 0 saving the model) is left to finish.
    """

    def __init__(self, comm):
        import atexit
        import threading

        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.how: str | None = None  # "sys.exit(0)", recorded by the sys.exit wrapper
        self.status = 0
        self.exited: dict[int, str] = {}
        self.exiting = False
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.main_ident = threading.main_thread().ident
        self.thread = None
        self._original_exit = sys.exit
        sys.exit = self._recording_exit
        atexit.register(self._at_exit)
        if MPI.Query_thread() >= MPI.THREAD_MULTIPLE:
            self.thread = threading.Thread(target=self._watch, name="parconv-exit-watch", daemon=True)
            self.thread.start()

    def _recording_exit(self, status=None):
        self.how = "sys.exit()" if status is None else f"sys.exit({status!r})"
        self.status = 0 if status is None else (status if isinstance(status, int) else 1)
        self._original_exit(status)

    def _poll(self) -> None:
        """Receive the exit notices that have arrived."""
        status = MPI.Status()
        with self.lock:
            while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_EXIT_TAG, status=status):
                source = status.Get_source()
                self.exited[source] = self.comm.recv(source=source, tag=_EXIT_TAG)

    def _say_and_abort(self, text: str, code: int) -> None:
        prefix = _rank_prefix(self.comm)
        try:
            sys.stdout.flush()
        except Exception:  # noqa: BLE001
            pass
        sys.stderr.write(f"[{prefix}] parconv.distributed: {text}; aborting all ranks\n")
        sys.stderr.flush()
        time.sleep(0.3)  # let mpiexec forward the line before the abort tears it down
        _abort(self.comm, code)

    def _watch(self) -> None:
        last, since = None, None
        while not self.stop.wait(_POLL_S):
            if MPI.Is_finalized():
                return
            self._poll()
            if not self.exited or self.exiting:
                continue
            frame = sys._current_frames().get(self.main_ident)
            if frame is None:
                return
            here = (id(frame), frame.f_lasti)
            now = time.monotonic()
            if here != last:
                last, since = here, now
                continue
            if now - since >= EXIT_STALL_S and not self.exiting:
                peers = ", ".join(f"rank {r} of {self.size} exited ({how})" for r, how in sorted(self.exited.items()))
                where = f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"
                self._say_and_abort(f"{peers} outside a collective, while rank {self.rank} waits at {where}", 1)

    def _at_exit(self) -> None:
        if MPI.Is_finalized() or not MPI.Is_initialized():
            return
        self.exiting = True
        how = self.how or "at the end of the program"
        if self.status:
            self._say_and_abort(f"rank {self.rank} of {self.size} exited ({how})", self.status)
        if self.thread is not None:
            self.stop.set()
            self.thread.join()
        requests = [self.comm.isend(how, dest=r, tag=_EXIT_TAG) for r in range(self.size) if r != self.rank]
        waited = 0.0
        while True:
            self._poll()
            if len(self.exited) >= self.size - 1:
                break
            if self.thread is None and waited > 2 * EXIT_STALL_S:
                # without a watchdog on the others, nobody else can tell that they wait for this rank
                self._say_and_abort(f"rank {self.rank} of {self.size} exited ({how}) while ranks "
                                    f"{sorted(set(range(self.size)) - set(self.exited) - {self.rank})} go on", 1)
            time.sleep(_POLL_S)
            waited += _POLL_S
        MPI.Request.Waitall(requests)


_exit_watch: _ExitWatch | None = None


def _watch_exits(comm) -> None:
    """Install :class:`_ExitWatch` once (under more than one rank)."""
    global _exit_watch
    if _exit_watch is None and comm.Get_size() > 1:
        _exit_watch = _ExitWatch(comm)


def default_threads(comm=None) -> int:
    """Threads per rank by default: the cores this process may use // the ranks on this node.

    Collective over ``comm`` (it counts the ranks sharing this node).
    """
    comm = _comm(comm, "default_threads")
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        local = node.Get_size()
    finally:
        node.Free()
    return max(1, _config._cpu_count() // local)


def configure_threads(comm=None, threads: int | None = None) -> int:
    """Set this rank's thread count (``pc.set_num_threads``) and cap BLAS to the same number.

    ``threads=None`` keeps an explicit choice (``pc.set_num_threads`` or
    ``OMP_NUM_THREADS``) and otherwise uses :func:`default_threads`, so ranks
    sharing a node do not oversubscribe its cores. Collective over ``comm``.
    Returns the thread count.
    """
    comm = _comm(comm, "configure_threads")
    auto = default_threads(comm)  # collective: every rank calls it whatever it decides
    if threads is None:
        explicit = _config._num_threads if _config._num_threads is not None else _config._threads_from_env()
        threads = explicit if explicit is not None else auto
    threads = check_int(threads, "threads", "configure_threads", 1)
    _config.set_num_threads(threads)
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(threads, user_api="blas")
    except ImportError:  # pragma: no cover - threadpoolctl is a dependency
        pass
    return threads


_BLOCK_TAG = 7301  # tag of FilterParallelConv2d's pairwise output exchange


def _plane_column_type(n: int, plane: int, stride_planes: int):
    """MPI type of one filter's output planes over a batch: ``n`` blocks of ``plane`` floats,
    ``stride_planes * plane`` apart, with an extent of one plane so consecutive filters follow."""
    vector = MPI.FLOAT.Create_vector(n, plane, stride_planes * plane)
    try:
        column = vector.Create_resized(0, plane * MPI.FLOAT.Get_size())
    finally:
        vector.Free()
    column.Commit()
    return column


def _host_copy(backend, a) -> np.ndarray:
    """Contiguous float32 host array with the contents of backend array ``a`` (no copy when possible)."""
    return np.ascontiguousarray(backend.to_numpy(a), dtype=np.float32)


# ---------------------------------------------------------- data parallel
_PROGRESS_TAG = 7304  # a tag no message carries: Iprobe on it only drives the progress engine
_PROGRESS_INTERVAL_S = 5e-4


class _ProgressThread:
    """Drives MPI's progress engine while gradient reductions are in flight.

    MPI promises progress on a started ``Iallreduce`` only inside MPI calls;
    the backward's own calls come once per layer of the model, and a long
    layer leaves the reduction waiting. While :meth:`start` .. :meth:`stop`,
    this thread calls ``Iprobe`` (on a tag nobody sends) every
    ``_PROGRESS_INTERVAL_S``: it touches no request, so the main thread may
    start, test and wait on its requests meanwhile. The kernels release the
    GIL, so it runs beside them; it sleeps between backward passes.
    """

    def __init__(self, comm):
        import threading

        self.comm = comm
        self.polls = 0
        self._go = threading.Event()
        self._thread = threading.Thread(target=self._run, name="parconv-mpi-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._go.wait()
            while self._go.is_set():
                if MPI.Is_finalized():
                    return
                self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_PROGRESS_TAG)
                self.polls += 1
                time.sleep(_PROGRESS_INTERVAL_S)

    def start(self) -> None:
        self._go.set()

    def stop(self) -> None:
        self._go.clear()


class _Bucket:
    """A contiguous host buffer holding the gradients of a run of layers, reduced together."""

    __slots__ = ("layers", "params", "offsets", "sizes", "shapes", "buffer", "pending", "request")

    def __init__(self):
        self.layers: list[int] = []
        self.params: list = []
        self.offsets: list[int] = []
        self.sizes: list[int] = []
        self.shapes: list[tuple] = []
        self.buffer = None
        self.pending = 0
        self.request = None


class DataParallel:
    """Data-parallel training of a :class:`parconv.Sequential` over the ranks of an MPI communicator.

    Every rank holds a full replica of the model. At construction rank 0's
    parameters are broadcast, so all replicas start equal. Each rank runs the
    forward and backward on its shard of the global batch; :meth:`backward`
    averages every gradient over the ranks with buffer ``Iallreduce`` calls on
    a few contiguous buckets, each started as soon as the backward pass has
    written the gradients of its layers, and completes them before it
    returns -- so ``optimizer.step()`` then applies the global-batch gradient
    and the replicas stay identical.

    Parameters
    ----------
    model : Sequential
    comm : mpi4py communicator, optional
        Default ``MPI.COMM_WORLD``.
    bucket_cap_mb : float, default 1.0
        Largest bucket in MiB (a layer larger than this gets a bucket of its
        own). Smaller buckets start reducing earlier; larger ones pay the
        per-message latency fewer times.
    threads : int, optional
        Threads for this rank; default: an explicit ``pc.set_num_threads`` /
        ``OMP_NUM_THREADS`` setting, else cores // ranks on this node.
    abort_on_error : bool, default True
        An exception on any rank aborts the whole job (see :func:`abort_on_error`).
    progress : {"hooks", "thread"}, default "hooks"
        How the started reductions progress while the backward runs (MPI
        promises no progress outside its calls): through the MPI calls made
        after each layer's backward, or also from a thread that calls into
        MPI every 0.5 ms (needs ``MPI_THREAD_MULTIPLE``, else "hooks") -- for
        models whose layers are few and long. On resnet20 both hide 95% of
        the gradient reduction (2 ranks, batch 128), so the default spares
        the thread's wake-ups.
    broadcast_buffers : bool, default True
        As PyTorch's DDP: rank 0's buffers (BatchNorm running statistics and
        counters) are copied to every rank before every forward, and ``fit``
        copies them again at the end of every epoch, so every rank holds --
        evaluates and saves -- the same model. Broadcasting rather than
        averaging keeps a model that one rank actually computed; with
        :class:`parconv.SyncBatchNorm` the statistics are global anyway.

    Attributes
    ----------
    rank, size : int
    timings : dict
        Seconds spent in ``backward`` (``"backward"``) and the part of it spent
        on gradient reduction -- copies, starting and waiting for the
        allreduces (``"allreduce"``) -- summed over calls (``reset_timings()``).
    reduce_window : tuple of float or None
        ``(ready, done)``: the ``time.perf_counter()`` readings at which the
        last :meth:`backward` had handed every gradient to its reduction and
        at which the reductions completed. The reduction cannot finish before
        the slowest rank is ready, so on one node (one clock) comparing
        ``ready`` across ranks splits ``"allreduce"`` into waiting for the
        slowest rank and the reduction itself (``bench/mpi_bench.py`` does).
    reduce_started : float or None
        The ``time.perf_counter()`` reading at which the last :meth:`backward`
        started its first bucket's reduction: from then until ``ready`` the
        reductions can progress behind the rest of the backward.
    hidden_share : float or None
        The share of the gradient floats whose reduction had completed when
        the last :meth:`backward` finished computing: hidden behind it.
    bucket_sizes : list of int
        Floats per bucket, in launch order.

    Examples
    --------
    Under ``mpiexec -n 2``::

        dp = pc.distributed.DataParallel(model)
        out = dp(x_local)                       # forward on this rank's shard
        loss_fn(out, y_local)
        dp.backward(loss_fn.backward())         # grads = mean over all ranks
        opt.step(); opt.zero_grad()
    """

    def __init__(self, model, comm=None, *, bucket_cap_mb: float = 1.0, threads: int | None = None,
                 abort_on_error: bool = True, broadcast_buffers: bool = True, progress: str = "hooks"):
        from .model import Sequential

        if not isinstance(model, Sequential):
            raise TypeError(f"DataParallel: model must be a parconv Sequential, got {type(model).__name__}")
        self.model = model
        self.comm = _comm(comm, "DataParallel")
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.bucket_cap_bytes = int(check_float(bucket_cap_mb, "bucket_cap_mb", "DataParallel", 0.0,
                                                min_inclusive=False) * 2**20)
        self.abort_on_error = bool(abort_on_error)
        if not isinstance(broadcast_buffers, (bool, np.bool_)):
            raise TypeError(f"DataParallel: broadcast_buffers must be a bool, got {type(broadcast_buffers).__name__}")
        self.sync_buffers = bool(broadcast_buffers)
        if progress not in ("thread", "hooks"):
            raise ValueError(f"DataParallel: progress must be 'thread' or 'hooks', got {progress!r}")
        if progress == "thread" and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            progress = "hooks"  # a second thread may not call MPI
        self.progress = progress
        self._progress = None
        self._buckets: list[_Bucket] = []
        self._layer_bucket: dict[int, int] = {}
        self._slot: dict[int, tuple] = {}  # id(param) -> (offset in its bucket, size, shape)
        self._plan_key = None
        self._active = False
        self._reported: set = set()
        self._next_launch = 0
        self._weight = 1.0
        self._placeholder = False
        self._sync_norms: list = []
        self.timings = {"backward": 0.0, "allreduce": 0.0}
        self.reduce_window = None
        self.reduce_started = None
        self.hidden_share = None
        self.bind_sync_batchnorm()
        with self._guard("DataParallel()"):
            self.threads = configure_threads(self.comm, threads)
            if self.size > 1:
                install_excepthook(self.comm)
            self.broadcast_parameters()
            self.broadcast_buffers()
        model.register_grad_hook(self._on_grads)

    # -------------------------------------------------------------- basics
    def _guard(self, where: str, passthrough: tuple = ()):
        if not self.abort_on_error:
            return contextlib.nullcontext()
        return abort_on_error(self.comm, f"DataParallel: {where}", passthrough)

    def __repr__(self):
        return (f"DataParallel(rank {self.rank} of {self.size}, {self.threads} threads, "
                f"model on {self.model.backend.name!r})")

    def parameters(self) -> list:
        return self.model.parameters()

    def __call__(self, x):
        return self.forward(x)

    def forward(self, x):
        """The model's forward on this rank's shard ``x``; in training mode rank 0's buffers are first
        copied to every rank (``broadcast_buffers``; no communication for a model without buffers), and
        the call is then collective. In eval mode the buffers do not move: no communication."""
        with self._guard("forward"):
            if self.sync_buffers and self.model.training:
                self.broadcast_buffers()
            return self.model.forward(x)

    def reset_timings(self) -> None:
        self.timings = {"backward": 0.0, "allreduce": 0.0}

    def broadcast_parameters(self, root: int = 0) -> None:
        """Copy rank ``root``'s parameters to every rank (one ``Bcast`` of a flat buffer). Collective."""
        params = self.model.parameters()
        if self.size == 1 or not params:
            return
        with self._guard("broadcast_parameters"):
            self._broadcast(params, root)

    def bind_sync_batchnorm(self) -> int:
        """Make the model's :class:`parconv.SyncBatchNorm` layers reduce over this comm (those given no
        ``comm`` of their own) and weight their gradients as this reducer does. Done at construction and
        by every ``fit``; call it after converting a model already wrapped. Returns how many there are."""
        from .layers import SyncBatchNorm

        self._sync_norms = [m for m in self.model.modules() if isinstance(m, SyncBatchNorm)]
        for m in self._sync_norms:
            m._dp = self
        return len(self._sync_norms)

    @property
    def needs_every_rank(self) -> bool:
        """Whether every rank must run every forward and backward (the model reduces inside them)."""
        return self.size > 1 and bool(self._sync_norms)

    @contextlib.contextmanager
    def placeholder(self):
        """Run a forward on data this rank holds no share of: SyncBatchNorm layers then add nothing to the
        statistics (and ``backward(..., weight=0)`` adds nothing to the gradients)."""
        self._placeholder = True
        try:
            yield
        finally:
            self._placeholder = False

    def broadcast_buffers(self, root: int = 0) -> None:
        """Copy rank ``root``'s buffers (running statistics, counters) to every rank: one ``Bcast``. Collective.

        Float buffers are written in place (a backend array keeps its
        identity); integer counters travel exactly (float64 holds them).
        """
        if self.size == 1:
            return
        entries = [(owner, attr) for _, owner, attr, kind in self.model._state_entries() if kind == "buffer"]
        if not entries:
            return
        with self._guard("broadcast_buffers"):
            values = [getattr(owner, attr) for owner, attr in entries]
            sizes = [int(np.prod(shape_of(v))) for v in values]
            flat = np.empty(sum(sizes), dtype=np.float64)
            if self.rank == root:
                off = 0
                for (owner, _), v, size in zip(entries, values, sizes):
                    host = v if isinstance(v, np.ndarray) and v.dtype != np.float32 else owner.backend.to_numpy(v)
                    flat[off:off + size] = np.asarray(host).reshape(-1)
                    off += size
            self.comm.Bcast([flat, MPI.DOUBLE], root=root)
            if self.rank != root:
                off = 0
                for (owner, attr), v, size in zip(entries, values, sizes):
                    part = flat[off:off + size]
                    off += size
                    if isinstance(v, np.ndarray) and v.dtype != np.float32:
                        setattr(owner, attr, part.astype(v.dtype).reshape(v.shape))
                    else:
                        be = owner.backend
                        be.copy_into(v, be.asarray(part.astype(np.float32).reshape(shape_of(v))))

    def _broadcast(self, params, root):
        be = self.model.backend
        flat = np.empty(sum(p.size for p in params), dtype=np.float32)
        if self.rank == root:
            off = 0
            for p in params:
                flat[off:off + p.size] = _host_copy(p.backend, p.data).reshape(-1)
                off += p.size
        self.comm.Bcast([flat, MPI.FLOAT], root=root)
        if self.rank != root:
            off = 0
            for p in params:
                p.backend.copy_into(p.data, p.backend.asarray(flat[off:off + p.size].reshape(p.shape)))
                off += p.size
        be.synchronize()

    # ----------------------------------------------------------- buckets
    def _plan_buckets(self) -> None:
        """Group the layers, last first (the order backward writes them), into contiguous buckets."""
        layers = self.model.layers
        # checked on every backward: the arrays' own shape tuples, no conversions
        key = tuple((i, id(p), p.data.shape) for i, layer in enumerate(layers) for p in layer.parameters())
        if key == self._plan_key:
            return
        buckets, current, nbytes = [], _Bucket(), 0
        for i in reversed(range(len(layers))):
            params = layers[i].parameters()
            if not params:
                continue
            size = sum(p.size for p in params) * 4
            if current.layers and nbytes + size > self.bucket_cap_bytes:
                buckets.append(current)
                current, nbytes = _Bucket(), 0
            current.layers.append(i)
            for p in params:
                current.params.append(p)
            nbytes += size
        if current.layers:
            buckets.append(current)
        self._layer_bucket, self._slot = {}, {}
        for b, bucket in enumerate(buckets):
            off = 0
            for p in bucket.params:
                shape, size = p.shape, p.size
                self._slot[id(p)] = (off, size, shape)
                bucket.offsets.append(off)
                bucket.sizes.append(size)
                bucket.shapes.append(shape)
                off += size
            bucket.buffer = np.empty(off, dtype=np.float32)
            for i in bucket.layers:
                self._layer_bucket[i] = b
        self._buckets = buckets
        self._plan_key = key

    @property
    def num_buckets(self) -> int:
        self._plan_buckets()
        return len(self._buckets)

    @property
    def bucket_sizes(self) -> list[int]:
        self._plan_buckets()
        return [b.buffer.size for b in self._buckets]

    def _on_grads(self, layer_index: int, params) -> None:
        """Grad hook: copy (scaled) gradients into their bucket; start every bucket that is complete."""
        if not self._active or layer_index in self._reported:
            return
        self._reported.add(layer_index)
        t0 = time.perf_counter()
        bucket = self._buckets[self._layer_bucket[layer_index]]
        weight = np.float32(self._weight)
        for p in params:
            off, size, shape = self._slot[id(p)]
            view = bucket.buffer[off:off + size]
            grad = p.backend.zeros(shape) if p.grad is None else p.grad
            np.multiply(_host_copy(p.backend, grad).reshape(-1), weight, out=view)
            bucket.pending -= 1
        self._launch_ready()
        # MPI makes progress on started reductions only inside MPI calls: poke it while backward runs
        pending = [b.request for b in self._buckets if b.request is not None]
        if pending:
            MPI.Request.Testall(pending)
        self.timings["allreduce"] += time.perf_counter() - t0

    def _launch_ready(self) -> None:
        # start strictly in bucket order, so every rank issues the same sequence of collectives
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].pending == 0:
            if self._next_launch == 0:
                self.reduce_started = time.perf_counter()
                if self.progress == "thread":
                    if self._progress is None:
                        self._progress = _ProgressThread(self.comm)
                    self._progress.start()
            bucket = self._buckets[self._next_launch]
            bucket.request = self.comm.Iallreduce(MPI.IN_PLACE, [bucket.buffer, MPI.FLOAT], op=MPI.SUM)
            self._next_launch += 1

    def backward(self, dy, need_dx: bool = False, weight: float | None = None):
        """Backward on this rank's shard, then average every gradient over the ranks.

        Parameters
        ----------
        dy : backend array or array-like, or None
            Gradient of the loss w.r.t. the model output on this rank's
            shard. ``None`` means this rank holds no samples of the batch: it
            contributes zero gradients (and still takes part in the reduction).
        need_dx : bool, default False
            Return dx w.r.t. this rank's input shard.
        weight : float, optional
            This rank's share of the global batch, ``n_local / n_global``; the
            reduced gradient is ``sum_r weight_r * grad_r``. Default
            ``1 / size``, the mean for equal shards (losses are means over the
            local batch).

        Returns
        -------
        dx or None
            When the call returns, every parameter's ``grad`` (overwritten) holds
            the global-batch gradient, identical on all ranks.
        """
        with self._guard("backward"):
            t0 = time.perf_counter()
            self._weight = 1.0 / self.size if weight is None else check_float(weight, "weight",
                                                                              "DataParallel.backward", 0.0)
            if self.size == 1 and self._weight == 1.0:
                dx = None if dy is None else self.model.backward(dy, need_dx=need_dx)
                if dy is None:
                    self._zero_grads()
                self.timings["backward"] += time.perf_counter() - t0
                return dx
            self._plan_buckets()
            for bucket in self._buckets:
                bucket.pending = len(bucket.params)
                bucket.request = None
            self._next_launch = 0
            self._reported = set()
            dx = None
            self._active = True
            try:
                if dy is None:
                    self._zero_grads(notify=True)
                else:
                    dx = self.model.backward(dy, need_dx=need_dx)
                t1 = time.perf_counter()
                # a layer the backward did not report (none in a Sequential) sends what its grads hold
                for i in sorted(self._layer_bucket, reverse=True):
                    if i not in self._reported:
                        self._on_grads(i, self.model.layers[i].parameters())
            finally:
                self._active = False
                if self._progress is not None:
                    self._progress.stop()  # Waitall progresses by itself
            ready = time.perf_counter()
            # what the backward hid: the gradient floats whose reduction is complete already
            finished = sum(b.buffer.size for b in self._buckets if b.request.Test())
            self.hidden_share = finished / max(1, sum(b.buffer.size for b in self._buckets))
            MPI.Request.Waitall([b.request for b in self._buckets])
            for bucket in self._buckets:
                bucket.request = None
                for p, off, size, shape in zip(bucket.params, bucket.offsets, bucket.sizes, bucket.shapes):
                    # host backends: the grad becomes a view of the bucket (no copy)
                    p.grad = p.backend.asarray(bucket.buffer[off:off + size].reshape(shape))
            t2 = time.perf_counter()
            self.timings["allreduce"] += t2 - t1
            self.timings["backward"] += t2 - t0
            self.reduce_window = (ready, t2)
            return dx

    def _zero_grads(self, notify: bool = False) -> None:
        layers = self.model.layers
        for i in reversed(range(len(layers))):
            params = layers[i].parameters()
            for p in params:
                p.grad = p.backend.zeros(p.shape)
            if notify and params:
                self._on_grads(i, params)

    # ---------------------------------------------------------- collectives used by fit
    def shard(self, n: int) -> tuple[int, int]:
        """``(start, stop)`` of this rank's contiguous share of ``n`` samples."""
        return shard_bounds(n, self.size, self.rank)

    def shared_seed(self, seed: int | None) -> int:
        """Rank 0's ``seed`` (drawn fresh when None) on every rank. Collective."""
        if seed is None and self.rank == 0:
            seed = int(np.random.SeedSequence().entropy)
        return self.comm.bcast(seed, root=0)

    def allreduce_sum(self, values) -> np.ndarray:
        """Element-wise sum over ranks of a small float64 vector. Collective."""
        buf = np.array(values, dtype=np.float64)
        self.comm.Allreduce(MPI.IN_PLACE, [buf, MPI.DOUBLE], op=MPI.SUM)
        return buf

    def iallreduce_sum(self, values):
        """Start summing a small float64 vector over ranks; returns ``(request, buffer)``."""
        buf = np.array(values, dtype=np.float64)
        return self.comm.Iallreduce(MPI.IN_PLACE, [buf, MPI.DOUBLE], op=MPI.SUM), buf

    def bcast_object(self, obj, root: int = 0):
        return self.comm.bcast(obj, root=root)

    #: what :meth:`check_same_arguments` raises on every rank alike (``fit`` lets it through without aborting)
    argument_error = DistributedArgumentError

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (e.g. a callback stopping training on rank 0). Collective."""
        return bool(self.comm.allreduce(bool(flag), op=MPI.LOR))

    def check_same_arguments(self, args: dict, where: str) -> None:
        """Raise :class:`DistributedArgumentError` on every rank when ranks pass different ``args``. Collective.

        Ranks that disagree on the sample count or the batch size would run
        different numbers of collectives and wait for each other forever.
        """
        everyone = self.comm.allgather(args)
        diffs = []
        for key in args:
            values = [a.get(key) for a in everyone]
            if any(v != values[0] for v in values[1:]):
                shown = ", ".join(f"rank {r} has {v!r}" for r, v in enumerate(values))
                diffs.append(f"{key}: {shown}")
        if diffs:
            raise DistributedArgumentError(f"{where}: every rank must pass the same training arguments and data "
                                           f"shapes; they differ in " + "; ".join(diffs))

    # ------------------------------------------------------------ training
    def fit(self, x, y=None, **kwargs):
        """:meth:`parconv.Sequential.fit` over all ranks; every rank passes the full ``x, y`` (or a DataLoader).

        ``batch_size`` is the global batch: each epoch's shuffled order is the
        same on every rank and each rank trains on its contiguous share of
        every batch, so the run follows the serial one with the same seed. A
        :class:`parconv.data.DataLoader` (the same seed on every rank) is
        sharded the same way: each rank reads and transforms only its share.
        """
        return self.model.fit(x, y, distributed=self, **kwargs)

    def evaluate(self, x, y=None, batch_size: int = 256, loss=None) -> dict:
        """Mean loss and accuracy over ``(x, y)`` in eval mode, each rank evaluating its share. Collective.

        As :meth:`parconv.Sequential.evaluate`: BatchNorm uses its running
        statistics (rank 0's, copied to every rank first with
        ``broadcast_buffers``), Dropout is off, and the previous mode is
        restored -- the result is the serial evaluation of the saved model.
        """
        from .losses import SoftmaxCrossEntropy
        from .training import _eval_mode

        with self._guard("evaluate"):
            if self.sync_buffers:
                self.broadcast_buffers()
            with _eval_mode(self.model):
                return self._evaluate(x, y, batch_size, loss if loss is not None else SoftmaxCrossEntropy())

    def _evaluate(self, x, y, batch_size, loss) -> dict:
        from .training import _is_loader, as_host_float as _as_host_float, evaluate_host, host_targets

        if _is_loader(x):
            return self._evaluate_loader(x, loss)
        batch_size = check_int(batch_size, "batch_size", "DataParallel.evaluate", 1)
        x = _as_host_float(x, "x", "DataParallel.evaluate")
        y = host_targets(y, x.shape[0], loss, "y", "DataParallel.evaluate")
        lo, hi = self.shard(x.shape[0])
        if hi > lo:
            ev = evaluate_host(self.model, x[lo:hi], y[lo:hi], loss, batch_size)
            local = [ev["loss"] * (hi - lo), ev.get("accuracy", 0.0) * (hi - lo)]
        else:
            local = [0.0, 0.0]
        total = self.allreduce_sum(local)
        n = x.shape[0]
        if not getattr(loss, "reports_accuracy", True):
            return {"loss": float(total[0] / n)}
        return {"loss": float(total[0] / n), "accuracy": float(round(total[1]) / n)}


    def _evaluate_loader(self, loader, loss) -> dict:
        """Each rank evaluates its share of every batch of a DataLoader's epoch 0; the sums are reduced."""
        from .training import _metrics, _prepare_target, _release, host_targets

        if getattr(loader, "num_samples", None) is None or not hasattr(loader, "_shard_epoch"):
            raise TypeError("DataParallel.evaluate: a DataLoader over arrays is sharded over the ranks; a batch "
                            "source is not (evaluate its batches with the model on each rank)")
        be = self.model.backend
        total = np.zeros(3)
        for xb, yb in loader._shard_epoch(0, 0, self.rank, self.size):
            if len(xb) == 0:
                continue
            yb = host_targets(yb, len(xb), loss, "y", "DataParallel.evaluate")
            out = self.model.forward(be.asarray(xb))
            target = _prepare_target(loss, yb, be)
            total += (loss.forward(out, target, backend=be) * len(yb), loss.count_correct(out, target), len(yb))
        _release(self.model)
        total = self.allreduce_sum(total)
        n = max(total[2], 1.0)
        return _metrics(loss, float(total[0] / n), float(round(total[1]) / n))


# ------------------------------------------------------- filter parallel
class FilterParallelConv2d(Layer):
    """A 2-D convolution whose output filters are split over the ranks of ``comm``.

    The filter decomposition of the convolution study: every rank holds the
    same input, computes the outputs of its own contiguous slice of filters
    with its own threads, and ``Allgatherv`` assembles the full output on every
    rank (straight into place, through strided MPI datatypes). Any number of
    ranks works; with ``O`` filters over ``R`` ranks the first ``O % R`` ranks
    get one filter more (a rank may get none).

    The backward takes the full dy (N, O, P, Q) on every rank, computes the
    gradients of its slice -- ``weight.grad``/``bias.grad`` keep only this
    rank's filters -- and returns the full dx, summed over ranks with
    ``Allreduce``. :meth:`state_dict` gathers the full, unsplit weights and
    :meth:`load_state_dict` takes them.

    Parameters
    ----------
    in_channels, out_channels, kernel_size : int
    stride : int, default 1
    padding : int, default 0
    bias : bool, default True
    comm : mpi4py communicator, optional
        Default ``MPI.COMM_WORLD``.
    backend : str or Backend, optional
    rng : numpy Generator or int seed, optional
        Initialisation as :class:`parconv.Conv2d`; rank 0's draw is broadcast.
    threads : int, optional
        Threads for this rank (default: as :class:`DataParallel`).
    abort_on_error : bool, default True
    assemble : {"allgatherv", "p2p"}, default "allgatherv"
        How the output is assembled: one ``Allgatherv``, or the same exchange
        as pairwise ``Isend``/``Irecv`` -- both write every block straight into
        place through strided datatypes. With MPICH on one node ``"p2p"`` is
        the faster for large outputs: its point-to-point path uses single-copy
        transfers, its Allgatherv does not (figures in the docs' performance
        internals).

    Attributes
    ----------
    weight, bias : Parameter
        This rank's slice, (O_r, C, K, K) and (O_r,).
    timings : dict
        Seconds spent computing (``"compute"``) and communicating
        (``"comm"``: ``Allgatherv`` and reassembly, ``Allreduce`` of dx), summed over calls.
    filter_counts, filter_offsets : list of int
        Filters per rank and where each rank's slice starts.

    Examples
    --------
    Under ``mpiexec -n 2``::

        conv = pc.distributed.FilterParallelConv2d(128, 64, kernel_size=3, padding=1)
        y = conv(x)            # (N, 64, P, Q) on every rank
        dx = conv.backward(dy)
    """

    param_names = ("weight", "bias")

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, padding: int = 0,
                 bias: bool = True, comm=None, backend=None, rng=None, threads: int | None = None,
                 abort_on_error: bool = True, assemble: str = "allgatherv"):
        super().__init__(backend)
        if assemble not in ("allgatherv", "p2p"):
            raise ValueError(f"FilterParallelConv2d: assemble must be 'allgatherv' or 'p2p', got {assemble!r}")
        self.assemble = assemble
        self._p2p_comm = None
        self.comm = _comm(comm, "FilterParallelConv2d")
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.abort_on_error = bool(abort_on_error)
        # validation and initialisation exactly as Conv2d (weights drawn on the host)
        for name, value in (("kernel_size", kernel_size), ("stride", stride), ("padding", padding)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise TypeError(f"FilterParallelConv2d: {name} must be an int, got {type(value).__name__} {value!r}")
        full = Conv2d(in_channels, out_channels, kernel_size, stride, padding, bias=bias, backend="numpy", rng=rng)
        self.in_channels, self.out_channels = full.in_channels, full.out_channels
        self.kernel_size, self.stride, self.padding = full.kernel_size[0], full.stride[0], full.padding[0]
        self.filter_counts = split_sizes(self.out_channels, self.size)
        self.filter_offsets = [shard_bounds(self.out_channels, self.size, r)[0] for r in range(self.size)]
        lo, hi = shard_bounds(self.out_channels, self.size, self.rank)
        self._slice = slice(lo, hi)
        self.timings = {"compute": 0.0, "comm": 0.0}
        with self._guard("FilterParallelConv2d()"):
            self.threads = configure_threads(self.comm, threads)
            if self.size > 1:
                install_excepthook(self.comm)
            if assemble == "p2p" and self.size > 1:
                self._p2p_comm = self.comm.Dup()  # its own context: our messages never meet the user's
            w = np.ascontiguousarray(full.weight.data)
            self.comm.Bcast([w, MPI.FLOAT], root=0)
            self.weight = Parameter(w[lo:hi], self.backend)
            self.bias = None
            if full.bias is not None:
                b = np.ascontiguousarray(full.bias.data)
                self.comm.Bcast([b, MPI.FLOAT], root=0)
                self.bias = Parameter(b[lo:hi], self.backend)

    def _guard(self, where: str):
        if not self.abort_on_error:
            return contextlib.nullcontext()
        return abort_on_error(self.comm, f"FilterParallelConv2d: {where}")

    def config(self):
        return dict(in_channels=self.in_channels, out_channels=self.out_channels, kernel_size=self.kernel_size,
                    stride=self.stride, padding=self.padding, bias=self.bias is not None)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"FilterParallelConv2d({args}; filters {self._slice.start}:{self._slice.stop} on rank {self.rank})"

    @property
    def full_weight_shape(self) -> tuple:
        return (self.out_channels, self.in_channels, self.kernel_size, self.kernel_size)

    def output_shape(self, x_shape) -> tuple:
        from . import functional as F

        return F.conv2d_output_shape(x_shape, self.full_weight_shape, self.stride, self.padding, repr(self))

    @property
    def _local_filters(self) -> int:
        return self._slice.stop - self._slice.start

    def forward(self, x):
        """y (N, O, P, Q) on every rank; ``x`` (N, C, H, W) must be the same on every rank. Collective."""
        with self._guard("forward"):
            x = self._input(x)
            N, O, P, Q = self.output_shape(shape_of(x))
            be = self.backend
            plane = P * Q
            precision = current_precision()
            t0 = time.perf_counter()
            self._check_same_shape(shape_of(x))
            self.timings["comm"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            if self._local_filters:
                b = self.bias.data if self.bias is not None else None
                conv = be.conv2d_forward_bf16 if precision == "bf16" else be.conv2d_forward
                y_local = _host_copy(be, conv(x, self.weight.data, b, self.stride, self.padding))
            else:
                y_local = np.empty((N, 0, P, Q), dtype=np.float32)
            t1 = time.perf_counter()
            y = np.empty((N, O, P, Q), dtype=np.float32)
            c = self._local_filters
            # Gather straight into place: one receive element is a filter's (P, Q) plane for every
            # sample (N planes O*P*Q apart); a rank's block is its O_r consecutive filters. The send
            # side walks the local (N, O_r, P, Q) output in the same filter-major order.
            if self.assemble == "allgatherv":
                recv_t = _plane_column_type(N, plane, O)
                send_t = _plane_column_type(N, plane, max(c, 1))
                try:
                    self.comm.Allgatherv([y_local, c, send_t],
                                         [y, (self.filter_counts, self.filter_offsets), recv_t])
                finally:
                    recv_t.Free()
                    send_t.Free()
            else:
                self._exchange_blocks(y_local, y, N, plane)
            self.timings["compute"] += t1 - t0
            self.timings["comm"] += time.perf_counter() - t1
            self._cache = (x, precision)  # the backward runs in the forward's precision
            return be.asarray(y)

    def _check_same_shape(self, shape) -> None:
        """Raise on every rank alike unless ``x`` has the same shape on every rank (one small Allreduce).

        Blocks of different sizes would be gathered into a partly unwritten output, silently.
        """
        if self.size == 1:
            return
        bounds = np.array([*shape, *(-d for d in shape)], dtype=np.int64)  # max of -d is -min
        self.comm.Allreduce(MPI.IN_PLACE, [bounds, MPI.INT64_T], op=MPI.MAX)
        largest, smallest = tuple(int(d) for d in bounds[:4]), tuple(int(-d) for d in bounds[4:])
        if largest != smallest:
            raise DistributedArgumentError(
                f"FilterParallelConv2d.forward: x must be the same on every rank; its shape is {tuple(shape)} on "
                f"rank {self.rank}, and over the ranks ranges from {smallest} to {largest}")

    def _exchange_blocks(self, y_local, y, N, plane) -> None:
        """The Allgatherv done pairwise: ``Isend`` the local block to every rank, ``Irecv`` each
        rank's block straight into place (one strided datatype per peer), copy the own block."""
        O, c, lo = self.out_channels, self._local_filters, self._slice.start
        comm = self._p2p_comm or self.comm
        reqs, types = [], []
        flat = y.reshape(-1)
        try:
            for r, (count, off) in enumerate(zip(self.filter_counts, self.filter_offsets)):
                if r == self.rank or count == 0:
                    continue
                block = MPI.FLOAT.Create_vector(N, count * plane, O * plane)
                block.Commit()
                types.append(block)
                reqs.append(comm.Irecv([flat[off * plane:], 1, block], source=r, tag=_BLOCK_TAG))
            if c:
                for r in range(self.size):
                    if r != self.rank:
                        reqs.append(comm.Isend([y_local, MPI.FLOAT], dest=r, tag=_BLOCK_TAG))
                y[:, lo:lo + c] = y_local
            MPI.Request.Waitall(reqs)
        finally:
            for block in types:
                block.Free()

    def backward(self, dy, need_dx: bool = True):
        """Fills this rank's ``weight.grad``/``bias.grad`` (overwritten); returns the full dx. Collective.

        ``dy`` (N, O, P, Q) must be the same on every rank; dx (N, C, H, W) is
        the sum of every rank's contribution (``Allreduce``), None unless
        ``need_dx`` (which must then be the same on every rank).
        """
        with self._guard("backward"):
            x, precision = self._cached()
            be = self.backend
            dy = self._check_dy(dy, self.output_shape(shape_of(x)))
            t0 = time.perf_counter()
            if self._local_filters:
                dy_local = be.asarray(np.ascontiguousarray(_host_copy(be, dy)[:, self._slice]))
                conv_backward = be.conv2d_backward_bf16 if precision == "bf16" else be.conv2d_backward
                dx, dw, db = conv_backward(x, self.weight.data, dy_local, self.stride, self.padding,
                                           bool(need_dx), self.bias is not None)
                self.weight.grad = dw
                if self.bias is not None:
                    self.bias.grad = db
                dx_host = _host_copy(be, dx) if need_dx else None  # fresh from the backend: reduced in place
            else:
                self.weight.grad = be.zeros(self.weight.shape)
                if self.bias is not None:
                    self.bias.grad = be.zeros(self.bias.shape)
                dx_host = np.zeros(shape_of(x), dtype=np.float32) if need_dx else None
            t1 = time.perf_counter()
            self.timings["compute"] += t1 - t0
            if not need_dx:
                return None
            self.comm.Allreduce(MPI.IN_PLACE, [dx_host, MPI.FLOAT], op=MPI.SUM)
            self.timings["comm"] += time.perf_counter() - t1
            return be.asarray(dx_host)

    # ---------------------------------------------------------- state
    def _gather_filters(self, p, per_filter: int) -> np.ndarray:
        local = _host_copy(self.backend, p.data)
        full = np.empty((self.out_channels * per_filter,), dtype=np.float32)
        counts = [c * per_filter for c in self.filter_counts]
        displs = [o * per_filter for o in self.filter_offsets]
        self.comm.Allgatherv([local, MPI.FLOAT], [full, counts, displs, MPI.FLOAT])
        return full

    def spec(self) -> dict:
        """Saved as the plain :class:`parconv.Conv2d` it computes (``pc.load`` needs no MPI)."""
        return {"type": "Conv2d", "config": self.config()}

    # inside a container, state entries go through these: full shapes in, full arrays out
    def _state_shape(self, attr: str) -> tuple:
        return self.full_weight_shape if attr == "weight" else (self.out_channels,)

    def _state_value(self, attr: str) -> np.ndarray:
        with self._guard("state_dict"):
            if attr == "weight":
                per = self.in_channels * self.kernel_size**2
                return self._gather_filters(self.weight, per).reshape(self.full_weight_shape)
            return self._gather_filters(self.bias, 1)

    def _set_state(self, attr: str, value: np.ndarray) -> None:
        p = getattr(self, attr)
        p.data = self.backend.asarray(np.array(value[self._slice], dtype=np.float32, order="C", copy=True))
        p.grad = None

    def state_dict(self) -> dict:
        """The full, unsplit ``{"weight": (O, C, K, K), "bias": (O,)}`` as host arrays on every rank. Collective."""
        with self._guard("state_dict"):
            per = self.in_channels * self.kernel_size**2
            out = {"weight": self._gather_filters(self.weight, per).reshape(self.full_weight_shape)}
            if self.bias is not None:
                out["bias"] = self._gather_filters(self.bias, 1)
            return out

    def load_state_dict(self, state: dict) -> None:
        """Take full, unsplit weights (as :meth:`state_dict` returns) and keep this rank's slice.

        Shapes are checked before anything is written. Not collective, but
        every rank must load the same values.
        """
        where = "FilterParallelConv2d.load_state_dict"
        if not hasattr(state, "keys"):
            raise TypeError(f"{where}: state must be a mapping of name -> array, got {type(state).__name__}")
        expected = {"weight": self.full_weight_shape}
        if self.bias is not None:
            expected["bias"] = (self.out_channels,)
        missing = [k for k in expected if k not in state]
        unexpected = [k for k in state if k not in expected]
        if missing or unexpected:
            raise ValueError(f"{where}: expected keys {list(expected)}, missing {missing}, unexpected {unexpected}")
        staged = {}
        for k, shape in expected.items():
            value = state_array(state[k], k, shape, where, what="the full ")
            staged[k] = np.array(value[self._slice], dtype=np.float32, order="C", copy=True)
        self.weight.data = self.backend.asarray(staged["weight"])
        self.weight.grad = None
        if self.bias is not None:
            self.bias.data = self.backend.asarray(staged["bias"])
            self.bias.grad = None


def _reducer_for(model, distributed):
    """``fit(distributed=...)``'s gradient reducer: a DataParallel over ``model`` (cached per model and comm)."""
    if isinstance(distributed, DataParallel):
        if distributed.model is not model:
            raise ValueError("fit: distributed= is a DataParallel wrapping another model")
        dp = distributed
    else:
        if distributed is not True and not isinstance(distributed, MPI.Comm):
            return None  # fit then names what it accepts
        comm = MPI.COMM_WORLD if distributed is True else distributed
        dp = getattr(model, "_dp_cache", None)
        if dp is None or dp.comm is not comm:
            model._dp_cache = dp = DataParallel(model, comm)  # reused by later fits (one grad hook)
            return dp
    dp.bind_sync_batchnorm()
    dp.broadcast_parameters()
    return dp


register_reducer_factory(_reducer_for)
if MPI.COMM_WORLD.Get_size() > 1:
    # an uncaught exception on one rank before any parconv collective must still end the job,
    # and so must a rank's exit while the others wait for it
    install_excepthook(MPI.COMM_WORLD)
    _watch_exits(MPI.COMM_WORLD)
