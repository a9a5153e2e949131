"""The OpenMP backend: the Cython kernels of :mod:`parconv._ext` on host NumPy arrays.

Arrays are C-contiguous float32 NumPy arrays (labels int32), like the NumPy
reference backend; every op reads :func:`parconv._config.get_num_threads` when
it is called and hands that thread count to its kernel, which caps it by the
number of chunks it has and runs small inputs on one thread.

Stride-1 convolutions run on register-blocked micro-kernels (``pc_conv.h``).
Linear layers with few outputs over many inputs (a classifier head) stream
their input once through the narrow kernels (``pc_dense.h``); other linear
layers run on the register-blocked GEMM of ``pc_gemm.h`` (at the AVX-512 and
AVX2 levels, see ``gemm_linear``). The strided convolution backward, and
linear layers at the portable level, call the BLAS ``sgemm`` of SciPy from
inside OpenMP parallel regions. A BLAS that spawned its own
threads there would oversubscribe the cores, so every such call runs with
SciPy's BLAS limited to one thread (:class:`_BlasOneThread`), per call, so
the user's BLAS setting outside parconv is left alone. With OpenBLAS (SciPy's
wheels) that is two direct C calls; with another BLAS it goes through
threadpoolctl, ten times dearer per op (figures in docs/performance-internals.md).

Shapes: N batch, C in-channels, O filters, H, W input, P, Q output, K kernel,
F in-features, G out-features.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading

import numpy as np

from .. import _ext as _ext_dispatch
from .._config import get_conv_precision, get_num_threads
from .._grad import is_grad_enabled
from .._ext import _activations, _bf16, _conv, _conv_general, _dense, _losses, _norm, _optim, _pool, _threads
from .._shapes import out_size as _out_size
from ..amp import round_to_bf16_numpy as _round_to_bf16_numpy
from .base import Backend
from .numpy_ref import HostArrays, dropout_scale, dropout_threshold, smoothed_targets

__all__ = ["OpenMPBackend", "openmp_enabled", "omp_max_threads"]

#: im2col scratch per thread of the strided conv forward (bytes): about one L2 cache
CONV_FORWARD_TILE_BYTES = 1 << 20
#: im2col scratch per thread of the strided conv backward (bytes); big tiles keep the dw GEMM's k long
CONV_BACKWARD_TILE_BYTES = 1 << 22

#: The fused conv+ReLU+maxpool backward runs only for layers with at most this many input
#: channels whose dx is not wanted (a network's first layer); the unfused ops compose
#: otherwise: with more channels, or with dx, the composed ops (Winograd dx among them) win.
FUSED_BWD_MAX_CHANNELS = 2

#: ``Conv2d -> ReLU -> MaxPool2d -> Flatten -> Linear`` runs as one op (the fused layer computes
#: the logits of each thread's pooled images four at a time, and the backward computes each image's pooled
#: gradient from the logits' gradient where it is used) when the head is narrow (at most
#: ``_dense.NARROW_MAX_G`` outputs over at least ``NARROW_MIN_FEATURES`` inputs) and its weights
#: fit this many bytes: every four images a thread pools read all of them (from a core's L2 where
#: they fit next to the convolution's scratch; larger heads stream from L3).
HEAD_MAX_WEIGHT_BYTES = 1 << 22


def openmp_enabled() -> bool:
    """Whether the kernels were built with OpenMP (else they run on one thread)."""
    return _threads.openmp_enabled()


def omp_max_threads() -> int:
    """``omp_get_max_threads()`` of the OpenMP runtime the kernels use."""
    return _threads.omp_max_threads()


class _BlasOneThread:
    """Context manager limiting SciPy's BLAS to one thread while a kernel runs.

    The threadpoolctl controller is created once, on first use (it scans the
    loaded libraries, which takes milliseconds). Re-entrant and thread-safe:
    the first entrant saves and sets the limit, the last one to leave
    restores it.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._libs = None
        self._saved = []
        self._depth = 0
        self._fast = None  # None: not decided yet; True: C hooks in _threads

    def _controllers(self):
        if self._libs is None:
            from threadpoolctl import ThreadpoolController

            import scipy.linalg.cython_blas  # noqa: F401 - make sure SciPy's BLAS is loaded

            blas = [lib for lib in ThreadpoolController().lib_controllers if lib.user_api == "blas"]
            scipy_dir = os.path.dirname(os.path.dirname(os.path.abspath(scipy.linalg.cython_blas.__file__)))
            scipy_root = os.path.dirname(scipy_dir)
            # the BLAS SciPy links against: inside scipy/ or its wheel's scipy.libs/; else every BLAS
            own = [
                lib for lib in blas
                if os.path.abspath(lib.filepath).startswith((scipy_dir + os.sep, os.path.join(scipy_root, "scipy.libs")))
            ]
            self._libs = own or blas
        return self._libs

    def _install_fast_path(self):
        """Hand OpenBLAS's own get/set functions to ``_threads`` when that is safe.

        Only for OpenBLAS with its pthreads pool (one process-wide count that
        ``openblas_set_num_threads`` changes); any other BLAS or threading
        layer keeps the threadpoolctl path.
        """
        import ctypes

        libs = self._controllers()
        self._fast = False
        if len(libs) != 1 or libs[0].internal_api != "openblas" or getattr(libs[0], "threading_layer", "") != "pthreads":
            return
        dynlib = libs[0].dynlib
        for affix in (("", ""), ("", "64_"), ("", "_64"), ("scipy_", ""), ("scipy_", "64_"), ("scipy_", "_64")):
            get = getattr(dynlib, "{}openblas_get_num_threads{}".format(*affix), None)
            set_ = getattr(dynlib, "{}openblas_set_num_threads{}".format(*affix), None)
            if get is not None and set_ is not None:
                _threads.blas_hooks(ctypes.cast(get, ctypes.c_void_p).value, ctypes.cast(set_, ctypes.c_void_p).value)
                self._fast = True
                return

    def __enter__(self):
        if self._fast is None:
            with self._lock:
                if self._fast is None:
                    self._install_fast_path()
        if self._fast:
            _threads.blas_limit_enter()
            return self
        with self._lock:
            if self._depth == 0:
                libs = self._controllers()
                self._saved = [lib.get_num_threads() for lib in libs]
                for lib, n in zip(libs, self._saved):
                    if n != 1:
                        lib.set_num_threads(1)
            self._depth += 1
        return self

    def __exit__(self, *exc):
        if self._fast:
            _threads.blas_limit_exit()
            return False
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                for lib, n in zip(self._libs, self._saved):
                    if n != 1:
                        lib.set_num_threads(n)
        return False

    def info(self):
        """Name, version and path of each BLAS library that gets limited."""
        return [
            {"internal_api": lib.internal_api, "version": lib.version, "filepath": lib.filepath}
            for lib in self._controllers()
        ]


_blas_one_thread = _BlasOneThread()

#: GEMMs below this many multiply-adds skip the limit: the kernels run them on the
#: calling thread, and no BLAS splits work that small (OpenBLAS stays on one thread
#: below 65536 * 4), so the two library calls would be the only cost that grows
#: with the thread setting
BLAS_LIMIT_MIN_MACS = 1 << 16


#: A linear layer with at most ``_dense.NARROW_MAX_G`` (16) outputs and at least this many
#: inputs runs on the narrow kernels of pc_dense.h, which stream x once (and compute dx and dw
#: in one pass): faster than the general product from about 2048 features up; below it the
#: general path keeps the layer (the own GEMM or sgemm, see ``gemm_linear``).
NARROW_MIN_FEATURES = 2048


def _blas_limit(macs: int):
    return _blas_one_thread if macs >= BLAS_LIMIT_MIN_MACS else contextlib.nullcontext()


def _bf16_forward_native(C, K):
    """Whether the native bf16 forward beats rounding and the float32 direct kernel on this layer."""
    # a reduction of under 32 terms (a first layer on RGB): building the block's bf16 input views
    # costs more than the products it feeds; the tiles' masked gathers make up for it from 16
    # channels (a pointwise layer)
    return C * K * K >= 32 or (C >= 16 and _bf16.amx())


def _bf16_dw_native(K, stride, padding):
    """Whether the native bf16 weight gradient beats the float32 direct one on the rounded tensors."""
    # strided layers (other than a 1x1 without padding) build im2col panels for their VDPBF16PS dw;
    # the AMX tiles read them as flat views of phase images instead, which pays from 3 channels up
    return stride == 1 or (K == 1 and padding == 0) or _bf16.amx()


def _flipped_transposed(w):
    """(O, C, K, K) filters as the (C, O, K, K) filters of the transposed convolution, each
    kernel rotated by 180 degrees: dx = conv2d(dy, _flipped_transposed(w), padding=K - 1 - padding)
    for a stride-1 layer."""
    return np.ascontiguousarray(w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3))


def _f32(a):
    """a as C-contiguous float32 (no copy when it already is)."""
    return np.ascontiguousarray(a, dtype=np.float32)



def _i32(a):
    return np.ascontiguousarray(a, dtype=np.int32)


def _index_dtype(positions: int):
    """The argmax dtype of a pooled plane of ``positions`` inputs: uint16 where every index fits
    (half the bytes of int32 to write in the forward and read back in the backward), else int32."""
    return np.uint16 if positions <= _pool.POOL_U16_MAX else np.int32


def _index(a):
    """An argmax as the kernels take it: C-contiguous uint16 or int32 (other dtypes become int32)."""
    a = np.asarray(a)
    return np.ascontiguousarray(a) if a.dtype in (np.uint16, np.int32) else _i32(a)


#: Outputs of at least this many bytes come from the backend's buffer pool (:class:`_BufferPool`):
#: glibc's default ``mmap`` threshold, above which every allocation is a fresh mapping
POOL_MIN_BYTES = 128 << 10


def _refcount_when_free() -> int:
    """What ``sys.getrefcount`` reports for a pooled buffer that only the pool holds (calibrated
    here, through the very code path :meth:`_BufferPool.empty` checks with, so it holds on every
    CPython version)."""
    probe = [np.empty(1, np.uint8)]
    return _BufferPool._refs(probe, 0)


_F32 = np.dtype(np.float32)


class _BufferPool:
    """Large output buffers kept for reuse once nothing references them any more.

    A fresh large NumPy array is a fresh ``mmap``: the kernel zeroes and maps every page on
    first touch, which costs about as much as the op that writes it, and a training step makes
    several of them. Arrays of a few hundred KB to a few MB pay it too wherever malloc has not
    raised its ``mmap`` threshold past their size (glibc maps anything at or above the
    threshold, and raises it only when a larger mapping is freed). The pool hands out views of
    byte buffers it owns. A buffer is free again when its reference count is back to the pool's
    own reference: every view of it (and every view of a view) holds a reference to it, so a
    buffer that anyone can still read is never handed out twice.

    ``max_bytes`` bounds what the pool keeps; beyond it, the least recently used buffers are
    forgotten (freed once their last view goes). :meth:`clear` forgets all of them.
    """

    def __init__(self, min_bytes: int = POOL_MIN_BYTES, max_bytes: int = 1 << 30):
        self.min_bytes, self.max_bytes = int(min_bytes), int(max_bytes)
        self._bufs: list[np.ndarray] = []  # least recently used first
        self._lock = threading.Lock()
        self._free_refs = None

    @staticmethod
    def _refs(bufs, i) -> int:
        return sys.getrefcount(bufs[i])

    def empty(self, shape, dtype=np.float32, any_size: bool = False) -> np.ndarray:
        """An uninitialised array, from the pool when it has ``min_bytes`` or more (or ``any_size``)."""
        dtype = _F32 if dtype is np.float32 else np.dtype(dtype)
        # small arrays, the common case of small batches, leave before any conversion; NumPy
        # checks their shape (numpy integers could wrap here, but then NumPy sees the true size)
        nbytes = math.prod(shape) * dtype.itemsize
        if (nbytes < self.min_bytes and not any_size) or nbytes > self.max_bytes:
            return np.empty(shape, dtype=dtype)
        shape = tuple(map(int, shape))
        nbytes = math.prod(shape) * dtype.itemsize  # Python ints: exact
        if nbytes > self.max_bytes:
            return np.empty(shape, dtype=dtype)
        with self._lock:
            if self._free_refs is None:
                self._free_refs = _refcount_when_free()
            bufs = self._bufs
            for i in range(len(bufs) - 1, -1, -1):
                if bufs[i].nbytes == nbytes and self._refs(bufs, i) <= self._free_refs:
                    buf = bufs.pop(i)
                    bufs.append(buf)
                    return buf.view(dtype).reshape(shape)
            buf = np.empty(nbytes, dtype=np.uint8)
            bufs.append(buf)
            total = sum(b.nbytes for b in bufs)
            while total > self.max_bytes:
                total -= bufs.pop(0).nbytes
            return buf.view(dtype).reshape(shape)

    def clear(self) -> None:
        with self._lock:
            self._bufs = []

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds (free or in use)."""
        with self._lock:
            return sum(b.nbytes for b in self._bufs)


class OpenMPBackend(HostArrays, Backend):
    """Cython + OpenMP kernels on host float32 arrays; see the module docstring."""

    name = "openmp"

    #: Run 3x3 stride-1 forward convolutions (and the dx of such layers) as Winograd:
    #: F(4x4, 3x3) in a batch of at least 4 images with 16 channels and filters over
    #: maps from 8x8 (``_conv.winograd4_applies``), F(2x2, 3x3) on other wide layers
    #: (``_conv.winograd_applies``), as far as ``parconv.get_conv_precision()`` allows
    #: (see :meth:`_winograd4`). Set to False on an instance to use the direct kernels
    #: everywhere, as ``parconv.set_conv_precision("highest")`` does for every instance.
    winograd: bool = True

    #: Run linear layers with few outputs over many inputs on the narrow kernels (see
    #: ``NARROW_MIN_FEATURES``). False keeps every linear layer on the general path (``gemm_linear``).
    narrow_linear: bool = True

    #: Run the other linear layers on the register-blocked GEMM of ``pc_gemm.h`` (bias and a
    #: fused ReLU applied as it stores) instead of the BLAS sgemm. None: where the kernels of the
    #: ISA level in use beat the BLAS (``_dense.GEMM_PREFERRED``: the AVX-512 and AVX2 levels; the
    #: AVX2 level's backward from ``_dense.GEMM_BACKWARD_MIN_ROWS`` rows).
    gemm_linear: bool | None = None

    def __init__(self):
        self._ref = None
        self._pool = _BufferPool()

    def release_memory(self) -> None:
        """Let go of the large output buffers kept for reuse (see :class:`_BufferPool`).

        Outputs of ``POOL_MIN_BYTES`` (128 KiB) and up, at most 1 GiB in all, are recycled
        between training steps instead of being mapped afresh every time; the memory of those
        that nothing references any more goes back to the system here.
        """
        self._pool.clear()

    def _empty(self, shape, dtype=np.float32):
        return self._pool.empty(shape, dtype)

    def _winograd(self, C, O, K, stride, P, Q, N, grad=False) -> bool:
        """Whether this convolution (a forward, or with ``grad`` a gradient's transposed one) runs Winograd."""
        f4 = self._winograd4(grad) and _conv.winograd4_applies(C, O, K, stride, P, Q, N)
        return self._winograd_allowed() and (f4 or _conv.winograd_applies(C, O, K, stride, P, Q, N))

    def _winograd_allowed(self) -> bool:
        return bool(self.winograd) and get_conv_precision() != "highest"

    @staticmethod
    def _winograd4(grad) -> bool:
        """Whether F(4x4, 3x3) may run: at "medium" everywhere; at "high" for the gradients and
        for forwards under ``no_grad``. Its forward error flips ReLUs whose input lies within it
        of zero, which BatchNorm in training mode spreads over every gradient; dx and dw reach
        no such decision, and an inference forward has no gradient to spread it into."""
        precision = get_conv_precision()
        return precision == "medium" or (precision == "high" and (grad or not is_grad_enabled()))

    @property
    def openmp_enabled(self) -> bool:
        """Whether the kernels were compiled with OpenMP."""
        return openmp_enabled()

    def info(self) -> dict:
        """Build and runtime facts for ``parconv info``."""
        return {
            "openmp_enabled": openmp_enabled(),
            "omp_max_threads": omp_max_threads(),
            "num_threads": get_num_threads(),
            "conv_kernels": _conv.kernel_isa(),
            "isa_level": _ext_dispatch.STATE.get("level"),
            "isa_levels_built": list(_ext_dispatch.STATE.get("built", [])),
            "blas": _blas_one_thread.info(),
        }

    def _reference(self):
        # degenerate shapes (a zero-sized dimension) go to the NumPy reference
        if self._ref is None:
            from .numpy_ref import NumpyBackend

            self._ref = NumpyBackend()
        return self._ref

    # ------------------------------------------------------------------ conv2d
    def conv2d_forward(self, x, w, b, stride, padding):
        return self._conv_forward("conv2d_forward", x, w, b, stride, padding,
                                  lambda x, w, b, y: self._conv2d_forward_into(x, w, b, y, stride, padding))

    def _conv_forward(self, op, x, w, b, stride, padding, compute):
        """``compute(x, w, b, y)`` into a pooled (N, O, P, Q) output, on float32 inputs; a zero-sized
        dimension goes to the NumPy reference's ``op``."""
        x, w = _f32(x), _f32(w)
        b = None if b is None else _f32(b)
        N, C, H, W = x.shape
        O, _, K, _ = w.shape
        P, Q = _out_size(H, K, stride, padding), _out_size(W, K, stride, padding)
        if min(N, C, O, P, Q) <= 0:
            return getattr(self._reference(), op)(x, w, b, stride, padding)
        y = self._empty((N, O, P, Q))
        compute(x, w, b, y)
        return y

    def _conv2d_forward_into(self, x, w, b, y, stride, padding, grad=False):
        # Winograd where _winograd says so (the kernel checks the same rule); micro-kernels only, no BLAS.
        # ``grad``: y is dx, the transposed convolution of a backward
        if w.shape[2] == 1 and stride == 1 and padding == 0:
            _conv_general.pointwise_forward(x, w, b, y, get_num_threads())
            return
        _conv.conv2d_forward(x, w, b, y, stride, padding, get_num_threads(), CONV_FORWARD_TILE_BYTES,
                             winograd=self._winograd_allowed(), winograd4=self._winograd4(grad))

    def conv2d_batch_norm_eval_forward(self, x, w, b, weight, bias, running_mean, running_var, eps, stride,
                                       padding, relu):
        """The batch norm folded into the convolution's store (``_conv.conv2d_forward`` with ``scale``):
        one pass over y instead of three."""
        x, w = _f32(x), _f32(w)
        N, C, H, W = x.shape
        O, _, K, _ = w.shape
        P, Q = _out_size(H, K, stride, padding), _out_size(W, K, stride, padding)
        if min(N, C, O, P, Q) <= 0:
            return super().conv2d_batch_norm_eval_forward(x, w, b, weight, bias, running_mean, running_var, eps,
                                                          stride, padding, relu)
        scale, shift = np.empty(O, np.float32), np.empty(O, np.float32)
        _conv.fold_batch_norm(self._opt32(b), self._opt32(weight), self._opt32(bias), _f32(running_mean),
                              _f32(running_var), float(eps), scale, shift)
        return self._conv_scale_shift(x, w, scale, shift, stride, padding, relu, (N, O, P, Q))

    def conv2d_scale_shift_forward(self, x, w, scale, shift, stride, padding, relu):
        x, w = _f32(x), _f32(w)
        N, C, H, W = x.shape
        O, _, K, _ = w.shape
        P, Q = _out_size(H, K, stride, padding), _out_size(W, K, stride, padding)
        if min(N, C, O, P, Q) <= 0:
            return super().conv2d_scale_shift_forward(x, w, scale, shift, stride, padding, relu)
        return self._conv_scale_shift(x, w, _f32(scale), _f32(shift), stride, padding, relu, (N, O, P, Q))

    def _conv_scale_shift(self, x, w, scale, shift, stride, padding, relu, out_shape):
        """The scale, shift and ReLU applied as the convolution stores (1x1: the pointwise GEMM)."""
        y = self._empty(out_shape)
        if w.shape[2] == 1 and stride == 1 and padding == 0:
            _conv_general.pointwise_forward(x, w, shift, y, get_num_threads(), scale=scale, relu=bool(relu))
            return y
        _conv.conv2d_forward(x, w, shift, y, stride, padding, get_num_threads(), CONV_FORWARD_TILE_BYTES,
                             winograd=self._winograd_allowed(), scale=scale, relu=bool(relu),
                             winograd4=self._winograd4(False))
        return y

    def conv2d_backward(self, x, w, dy, stride, padding, need_dx=True, need_db=True):
        x, w, dy = _f32(x), _f32(w), _f32(dy)
        O = w.shape[0]
        if min(x.shape + w.shape + dy.shape) <= 0:
            return self._reference().conv2d_backward(x, w, dy, stride, padding, need_dx, need_db)
        dx = self._empty(x.shape) if need_dx else None
        dw = self._empty(w.shape)
        db = np.empty(O, dtype=np.float32) if need_db else None
        K = w.shape[2]
        if K == 1 and stride == 1 and padding == 0:
            # 1x1: dx on the pointwise GEMM (_conv_general), dw and db on the micro-kernels
            _conv.conv2d_backward(x, w, dy, None, dw, db, 1, 0, get_num_threads(), CONV_BACKWARD_TILE_BYTES)
            if need_dx:
                _conv_general.pointwise_backward_input(dy, w, dx, get_num_threads())
            return dx, dw, db
        shape = (x.shape[0], x.shape[1], O, K, stride, dy.shape[2], dy.shape[3])
        f4 = self._winograd4(True)
        winograd_dw = (self._winograd_allowed() and padding <= K - 1
                       and ((f4 and _conv.winograd4_dw_applies(*shape)) or _conv.winograd_dw_applies(*shape)))
        if winograd_dw or (need_dx and self._winograd_dx(x.shape, w.shape, stride, padding)):
            # Winograd where the layer (for dw) or its transposed convolution (for dx) qualifies,
            # F(4x4, 3x3) before F(2x2, 3x3); the micro-kernels otherwise
            if winograd_dw:
                with _blas_one_thread:
                    _conv.conv2d_backward_weights_winograd(x, dy, dw, db, padding, get_num_threads(), f4)
            else:
                _conv.conv2d_backward(x, w, dy, None, dw, db, stride, padding, get_num_threads(),
                                      CONV_BACKWARD_TILE_BYTES)
            if need_dx:
                # the stride-1 convolution of dy with the flipped, transposed filters (C outputs
                # from O inputs, padding K - 1 - padding); Winograd where _winograd_dx says so
                self._conv2d_forward_into(dy, _flipped_transposed(w), None, dx, 1, K - 1 - padding, grad=True)
            return dx, dw, db
        # stride 1 runs on micro-kernels only; im2col + sgemm otherwise (see _conv.conv2d_backward)
        uses_blas = stride != 1 or (need_dx and padding > K - 1)
        with _blas_one_thread if uses_blas else contextlib.nullcontext():
            _conv.conv2d_backward(x, w, dy, dx, dw, db, stride, padding, get_num_threads(),
                                  CONV_BACKWARD_TILE_BYTES)
        return dx, dw, db

    def _winograd_dx(self, x_shape, w_shape, stride, padding) -> bool:
        """Whether the backward computes dx by Winograd: a stride-1 3x3 layer whose transposed
        convolution (O in-channels, C out-channels, H x W outputs) Winograd takes
        (``_conv.winograd4_applies`` or ``_conv.winograd_applies``)."""
        N, C, H, W = x_shape
        O, _, K, _ = w_shape
        return stride == 1 and K == 3 and padding <= K - 1 and self._winograd(O, C, K, 1, H, W, N, grad=True)

    def conv2d_relu_maxpool2d_forward(self, x, w, b, stride, padding, pool_kernel, pool_stride):
        """Fused: each thread convolves whole images into private scratch and writes only the pooled maxima.

        Composes convolution, pooling and ReLU instead where the fused kernel does not apply
        (stride > 1, or images that do not split evenly over the threads while the busiest
        thread's extra work would exceed ``FUSED_FWD_UNEVEN_MACS``, see ``_conv.pyx``) and where
        the convolution runs Winograd (``_conv.winograd4_applies``, ``_conv.winograd_applies``): there the
        composition beats the fused direct kernel, whose saved memory pass is worth less than
        Winograd's saved multiplies. The composed convolution output is a pooled scratch buffer
        whatever its size: a fresh one every call lets malloc return its pages to the system and
        fault them in again, which cost more than the op at batch 1.
        """
        x, w = _f32(x), _f32(w)
        b = None if b is None else _f32(b)
        N, C, H, W = x.shape
        O, _, K, _ = w.shape
        P, Q = _out_size(H, K, stride, padding), _out_size(W, K, stride, padding)
        PP, QQ = _out_size(P, pool_kernel, pool_stride), _out_size(Q, pool_kernel, pool_stride)
        if min(N, C, O, PP, QQ) <= 0:
            return super().conv2d_relu_maxpool2d_forward(x, w, b, stride, padding, pool_kernel, pool_stride)
        fused = self._fused_forward_kernel(x, w, b, stride, padding, pool_kernel, pool_stride)
        if fused is not None:
            return fused[:2]
        y = self._empty((N, O, PP, QQ))
        argmax = self._empty((N, O, PP, QQ), _index_dtype(P * Q))
        z = self._pool.empty((N, O, P, Q), any_size=True)
        self._conv2d_forward_into(x, w, b, z, stride, padding)
        _pool.maxpool2d_forward(z, y, argmax, pool_kernel, pool_stride, get_num_threads())
        del z  # back to the pool before ReLU asks for its output
        return self.relu_forward(y), argmax

    def _fused_forward_kernel(self, x, w, b, stride, padding, pool_kernel, pool_stride, wl=None, bl=None):
        """``(y, argmax, logits)`` from the fused forward kernel (logits None without a head ``wl``),
        or None where that kernel does not run: stride > 1, a Winograd convolution, an empty
        output, or images that do not split evenly enough (see ``conv2d_relu_maxpool2d_forward``)."""
        N, C, H, W = x.shape
        O, _, K, _ = w.shape
        P, Q = _out_size(H, K, stride, padding), _out_size(W, K, stride, padding)
        PP, QQ = _out_size(P, pool_kernel, pool_stride), _out_size(Q, pool_kernel, pool_stride)
        if min(N, C, O, PP, QQ) <= 0 or stride != 1 or self._winograd(C, O, K, stride, P, Q, N):
            return None
        y = self._empty((N, O, PP, QQ))
        argmax = self._empty((N, O, PP, QQ), _index_dtype(P * Q))
        args = (x, w, b, y, argmax, stride, padding, pool_kernel, pool_stride, get_num_threads())
        logits = None
        if wl is not None:
            logits = self._empty((N, wl.shape[0]))
            args += (wl, bl, logits)
        if not _conv.conv2d_relu_maxpool2d_forward(*args):
            return None
        return y, argmax, logits

    def _fused_backward_runs(self, x, w, y, stride, need_dx) -> bool:
        """Whether the fused backward kernel takes these gradients (see ``FUSED_BWD_MAX_CHANNELS``)."""
        N, C, H, W = x.shape
        return (stride == 1 and min(N, C, w.shape[0], H, W) > 0 and y.size > 0 and not need_dx
                and C <= FUSED_BWD_MAX_CHANNELS)

    def conv2d_relu_maxpool2d_backward(self, x, w, y, argmax, dy, stride, padding, need_dx=True, need_db=True):
        """Fused for a network's first layer: each (image, filter) plane of the convolution's
        gradient is built in L1 scratch from the pooled gradient and consumed at once (``pc_fused.h``).

        The fused kernel runs where it pays: stride 1, no dx wanted and at most
        ``FUSED_BWD_MAX_CHANNELS`` input channels. Elsewhere the unfused ops compose (their
        convolution backward takes Winograd for dx where it applies): the fused kernel
        has no register blocking across channels or filters, and its dx pass was the slower
        one at every shape measured (see ``FUSED_BWD_MAX_CHANNELS``).
        """
        x, w, y, dy = _f32(x), _f32(w), _f32(y), _f32(dy)
        argmax = _index(argmax)
        if not self._fused_backward_runs(x, w, y, stride, need_dx):
            return super().conv2d_relu_maxpool2d_backward(x, w, y, argmax, dy, stride, padding, need_dx, need_db)
        dw = self._empty(w.shape)
        db = np.empty(w.shape[0], dtype=np.float32) if need_db else None
        _conv.conv2d_relu_maxpool2d_backward(x, w, y, argmax, dy, None, dw, db, padding, get_num_threads())
        return None, dw, db

    def fuses_linear_head(self, in_features, out_features):
        """Narrow heads (see ``NARROW_MIN_FEATURES``) whose weights fit ``HEAD_MAX_WEIGHT_BYTES``."""
        return (self.narrow_linear and 1 <= out_features <= _dense.NARROW_MAX_G
                and in_features >= NARROW_MIN_FEATURES and 4 * in_features * out_features <= HEAD_MAX_WEIGHT_BYTES)

    def conv2d_relu_maxpool2d_linear_forward(self, x, w, b, stride, padding, pool_kernel, pool_stride, wl, bl):
        """Fused through the head: each thread computes the logits of the images it pools, four at
        a time, while their pooled planes are still in cache (the same bits as the composition).

        Composes where the fused forward does not apply (see :meth:`conv2d_relu_maxpool2d_forward`)
        or the head is not one :meth:`fuses_linear_head` takes.
        """
        x, w, wl = _f32(x), _f32(w), _f32(wl)
        b = None if b is None else _f32(b)
        bl = None if bl is None else _f32(bl)
        if self.fuses_linear_head(wl.shape[1], wl.shape[0]):
            fused = self._fused_forward_kernel(x, w, b, stride, padding, pool_kernel, pool_stride, wl, bl)
            if fused is not None:
                return fused
        return super().conv2d_relu_maxpool2d_linear_forward(x, w, b, stride, padding, pool_kernel, pool_stride,
                                                            wl, bl)

    def conv2d_relu_maxpool2d_linear_backward(self, x, w, y, argmax, wl, dlogits, stride, padding,
                                              need_dx=True, need_db=True, need_head_db=True):
        """Fused where :meth:`conv2d_relu_maxpool2d_backward` is: each image's pooled gradient
        (its row of ``dlogits @ wl``, four images at a time) is computed into scratch as the image
        comes up, so the head's full-size dx is neither written nor read back, and the head's
        weight gradient runs in the same parallel loop (the bits of :meth:`linear_backward`)."""
        x, w, y, wl, dlogits = _f32(x), _f32(w), _f32(y), _f32(wl), _f32(dlogits)
        argmax = _index(argmax)
        G, F = wl.shape
        if not (self._fused_backward_runs(x, w, y, stride, need_dx) and self.fuses_linear_head(F, G)):
            return super().conv2d_relu_maxpool2d_linear_backward(x, w, y, argmax, wl, dlogits, stride, padding,
                                                                 need_dx, need_db, need_head_db)
        dw = self._empty(w.shape)
        db = np.empty(w.shape[0], dtype=np.float32) if need_db else None
        dwl = self._empty(wl.shape)
        dbl = np.empty(G, dtype=np.float32) if need_head_db else None
        _conv.conv2d_relu_maxpool2d_backward(x, w, y, argmax, None, None, dw, db, padding, get_num_threads(),
                                             wl, dlogits, dwl, dbl)
        return None, dw, db, dwl, dbl

    # --------------------------------------------------------------- maxpool2d
    def maxpool2d_forward(self, x, kernel_size, stride):
        x = _f32(x)
        N, C, H, W = x.shape
        P, Q = _out_size(H, kernel_size, stride), _out_size(W, kernel_size, stride)
        if min(N, C, P, Q) <= 0:
            return self._reference().maxpool2d_forward(x, kernel_size, stride)
        y = self._empty((N, C, P, Q))
        argmax = self._empty((N, C, P, Q), _index_dtype(H * W))
        _pool.maxpool2d_forward(x, y, argmax, kernel_size, stride, get_num_threads())
        return y, argmax

    def maxpool2d_backward(self, dy, argmax, x_shape):
        dy, argmax = _f32(dy), _index(argmax)
        x_shape = tuple(int(s) for s in x_shape)
        if min(x_shape) <= 0 or dy.size == 0:
            return np.zeros(x_shape, dtype=np.float32)
        dx = self._empty(x_shape)
        _pool.maxpool2d_backward(dy, argmax, dx, get_num_threads())
        return dx

    # ------------------------------------------------------------------ linear
    def linear_forward(self, x, w, b):
        return self._linear_forward(x, w, b, False)

    def linear_relu_forward(self, x, w, b):
        """The bias and the ReLU applied as the product is stored: one pass over y."""
        return self._linear_forward(x, w, b, True)

    def _linear_forward(self, x, w, b, relu):
        if self._gemm():
            # C-contiguous float32 arrays at a small batch: one call that checks, allocates and runs
            y = _dense.gemm_linear(x, w, b, get_num_threads(), relu,
                                   NARROW_MIN_FEATURES if self.narrow_linear else -1)
            if y is not None:
                return y
        x, w = _f32(x), _f32(w)
        b = None if b is None else _f32(b)
        (N, F), G = x.shape, w.shape[0]
        if N <= 0 or F <= 0 or G <= 0:
            y = self._reference().linear_forward(x, w, b)
            return np.maximum(y, 0, out=y) if relu else y
        y = self._empty((N, G))
        if self._narrow(x, w):
            _dense.linear_forward(x, w, b, y, get_num_threads(), True)
            return self.relu_forward(y) if relu else y
        if self._gemm():
            shape = _dense.gemm_scratch_shape(N, G, F)
            _dense.gemm_linear_forward(x, w, b, y, get_num_threads(), relu, None if shape is None else self._empty(shape))
            return y
        with _blas_limit(x.shape[0] * x.shape[1] * w.shape[0]):
            _dense.linear_forward(x, w, b, y, get_num_threads(), relu=relu)
        return y

    def linear_backward(self, x, w, dy, need_dx=True, need_db=True):
        return self._linear_backward(x, w, None, dy, need_dx, need_db)

    def linear_relu_backward(self, x, w, y, dy, need_dx=True, need_db=True):
        """dy masked by ``y > 0`` in one pass that also sums db, then dx and dw."""
        return self._linear_backward(x, w, _f32(y), dy, need_dx, need_db)

    def _linear_backward(self, x, w, y, dy, need_dx, need_db):
        x, w, dy = _f32(x), _f32(w), _f32(dy)
        if min(x.shape + w.shape) <= 0:
            if y is not None:
                dy = np.where(y > 0, dy, np.float32(0))
            return self._reference().linear_backward(x, w, dy, need_dx, need_db)
        dx = self._empty(x.shape) if need_dx else None
        dw = self._empty(w.shape)
        db = np.empty(w.shape[0], dtype=np.float32) if need_db else None
        dym = self._empty(dy.shape) if y is not None else None
        nt = get_num_threads()
        if self._narrow(x, w):
            _dense.linear_backward(x, w, dy, dx, dw, db, nt, True, y=y, dym=dym)
        elif self._gemm(x.shape[0]):
            _dense.linear_backward(x, w, dy, dx, dw, db, nt, y=y, dym=dym, gemm=True)
        else:
            with _blas_limit(x.shape[0] * x.shape[1] * w.shape[0]):
                _dense.linear_backward(x, w, dy, dx, dw, db, nt, y=y, dym=dym)
        return dx, dw, db

    def _gemm(self, backward_rows: int | None = None) -> bool:
        """Whether the other linear layers run on the own GEMM (see ``gemm_linear``); ``backward_rows``:
        the batch of a backward, which the AVX2 level leaves to the sgemm below a few rows."""
        if self.gemm_linear is not None:
            return bool(self.gemm_linear)
        return _dense.GEMM_PREFERRED and (backward_rows is None or backward_rows >= _dense.GEMM_BACKWARD_MIN_ROWS)

    def _narrow(self, x, w) -> bool:
        """Whether a linear layer takes the narrow kernels (few outputs, wide inputs) over sgemm."""
        return self.narrow_linear and w.shape[0] <= _dense.NARROW_MAX_G and x.shape[1] >= NARROW_MIN_FEATURES

    # ------------------------------------------------------------- activations
    def _unary(self, kernel, x):
        x = _f32(x)
        y = self._empty(x.shape)
        if x.size:
            kernel(x.reshape(-1), y.reshape(-1), get_num_threads())
        return y

    def _binary(self, kernel, y, dy):
        y, dy = _f32(y), _f32(dy)
        dx = self._empty(dy.shape)
        if dy.size:
            kernel(y.reshape(-1), dy.reshape(-1), dx.reshape(-1), get_num_threads())
        return dx

    def elementwise_forward(self, op, x, params=()):
        # kernels follow one signature: {op}_forward(x, y, *params, threads)
        kernel = getattr(_activations, f"{op}_forward", None)
        if kernel is None:
            return super().elementwise_forward(op, x, params)
        x = _f32(x)
        y = self._empty(x.shape)
        if x.size:
            kernel(x.reshape(-1), y.reshape(-1), *params, get_num_threads())
        return y

    def elementwise_backward(self, op, saved, dy, params=()):
        # {op}_backward(saved, dy, dx, *params, threads)
        kernel = getattr(_activations, f"{op}_backward", None)
        if kernel is None:
            return super().elementwise_backward(op, saved, dy, params)
        saved, dy = _f32(saved), _f32(dy)
        dx = self._empty(dy.shape)
        if dy.size:
            kernel(saved.reshape(-1), dy.reshape(-1), dx.reshape(-1), *params, get_num_threads())
        return dx

    def relu_forward(self, x):
        return self._unary(_activations.relu_forward, x)

    def relu_backward(self, y, dy):
        return self._binary(_activations.relu_backward, y, dy)

    def sigmoid_forward(self, x):
        return self._unary(_activations.sigmoid_forward, x)

    def sigmoid_backward(self, y, dy):
        return self._binary(_activations.sigmoid_backward, y, dy)

    # ------------------------------------------------------------------ losses
    def softmax_cross_entropy_forward(self, logits, labels):
        logits, labels = _f32(logits), _i32(labels)
        if logits.size == 0:
            return self._reference().softmax_cross_entropy_forward(logits, labels)
        probs = np.empty_like(logits)
        loss = _losses.softmax_cross_entropy_forward(logits, labels, probs, get_num_threads())
        return float(loss), probs

    def softmax_cross_entropy_backward(self, probs, labels):
        probs, labels = _f32(probs), _i32(labels)
        d = np.empty_like(probs)
        if probs.size:
            _losses.softmax_cross_entropy_backward(probs, labels, d, get_num_threads())
        return d

    def bce_forward(self, p, t, eps):
        p, t = _f32(p), _f32(t)
        if p.size == 0:
            return self._reference().bce_forward(p, t, eps)
        return float(_losses.bce_forward(p.reshape(-1), t.reshape(-1), float(eps), get_num_threads()))

    def bce_backward(self, p, t, eps):
        p, t = _f32(p), _f32(t)
        d = np.empty_like(p)
        if p.size:
            _losses.bce_backward(p.reshape(-1), t.reshape(-1), d.reshape(-1), float(eps), get_num_threads())
        return d

    def count_correct(self, logits, labels):
        logits, labels = _f32(logits), _i32(labels)
        if logits.size == 0:
            return 0
        return int(_losses.count_correct(logits, labels, get_num_threads()))

    def argmax_rows(self, logits):
        logits = _f32(logits)
        out = np.empty(logits.shape[0], dtype=np.int32)
        if logits.size:
            _losses.argmax_rows(logits, out, get_num_threads())
        return out

    # --------------------------------------------------------------- optimizer
    def sgd_update(self, p, g, v, lr, momentum, weight_decay, nesterov):
        if p.size == 0:
            return
        _optim.sgd_update(p.reshape(-1), _f32(g).reshape(-1), None if v is None else v.reshape(-1),
                          float(lr), float(momentum), float(weight_decay), bool(nesterov), get_num_threads())

    def sgd_update_many(self, ps, gs, vs, lr, momentum, weight_decay, nesterov):
        """One parallel loop over the elements of every parameter: one call, and small parameters
        share threads with large ones."""
        _optim.sgd_update_many([p.reshape(-1) for p in ps], [_f32(g).reshape(-1) for g in gs],
                               None if vs is None else [v.reshape(-1) for v in vs], float(lr), float(momentum),
                               float(weight_decay), bool(nesterov), get_num_threads())

    def adam_update(self, p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, decoupled=False):
        self.adam_update_many([p], [g], [m], [v], lr, beta1, beta2, eps, weight_decay, step, decoupled)

    def adam_update_many(self, ps, gs, ms, vs, lr, beta1, beta2, eps, weight_decay, step, decoupled=False):
        """One parallel loop over the elements of every parameter (as :meth:`sgd_update_many`)."""
        _optim.adam_update_many([p.reshape(-1) for p in ps], [_f32(g).reshape(-1) for g in gs],
                                [m.reshape(-1) for m in ms], [v.reshape(-1) for v in vs], float(lr), float(beta1),
                                float(beta2), float(eps), float(weight_decay), bool(decoupled), int(step),
                                get_num_threads())

    def rmsprop_update(self, p, g, sq, buf, lr, alpha, eps, weight_decay, momentum):
        self.rmsprop_update_many([p], [g], [sq], None if buf is None else [buf], lr, alpha, eps, weight_decay,
                                 momentum)

    def rmsprop_update_many(self, ps, gs, sqs, bufs, lr, alpha, eps, weight_decay, momentum):
        """One parallel loop over the elements of every parameter (as :meth:`sgd_update_many`)."""
        _optim.rmsprop_update_many([p.reshape(-1) for p in ps], [_f32(g).reshape(-1) for g in gs],
                                   [s.reshape(-1) for s in sqs], None if bufs is None else [b.reshape(-1) for b in bufs],
                                   float(lr), float(alpha), float(eps), float(weight_decay), float(momentum),
                                   get_num_threads())

    def norm_many(self, xs, norm_type):
        return float(_optim.norm_many([_f32(x).reshape(-1) for x in xs], float(norm_type), get_num_threads()))

    def scale_many(self, xs, factor):
        _optim.scale_many([x.reshape(-1) for x in xs], float(factor), get_num_threads())

    # ------------------------------------------------------------ batch norm
    # Kernels take x as (N, C, L): L = H * W, L, or 1 for (N, C) input.
    @staticmethod
    def _bn3(a):
        return a.reshape(a.shape[0], a.shape[1], -1)

    @staticmethod
    def _opt32(a):
        return None if a is None else _f32(a)

    def batch_norm_forward_train(self, x, weight, bias, running_mean, running_var, momentum, eps, relu,
                                 residual=None):
        x = _f32(x)
        C = x.shape[1]
        y = self._empty(x.shape)
        mean, invstd = np.empty(C, np.float32), np.empty(C, np.float32)
        _norm.batch_norm_forward_train(self._bn3(x), self._opt32(weight), self._opt32(bias), running_mean,
                                       running_var, self._bn3(y), mean, invstd, float(momentum), float(eps),
                                       bool(relu), get_num_threads(),
                                       None if residual is None else self._bn3(_f32(residual)))
        return y, mean, invstd

    def batch_norm_forward_eval(self, x, weight, bias, running_mean, running_var, eps, relu, residual=None):
        x = _f32(x)
        C = x.shape[1]
        y = self._empty(x.shape)
        mean, invstd = np.empty(C, np.float32), np.empty(C, np.float32)
        _norm.batch_norm_forward_eval(self._bn3(x), self._opt32(weight), self._opt32(bias), _f32(running_mean),
                                      _f32(running_var), self._bn3(y), mean, invstd, float(eps), bool(relu),
                                      get_num_threads(), None if residual is None else self._bn3(_f32(residual)))
        return y, mean, invstd

    def batch_norm_backward(self, x, weight, dy, mean, invstd, y, training, need_dx=True):
        x, dy = _f32(x), _f32(dy)
        C = x.shape[1]
        dx = self._empty(x.shape) if need_dx else None
        dweight = np.empty(C, np.float32) if weight is not None else None
        dbias = np.empty(C, np.float32) if weight is not None else None
        _norm.batch_norm_backward(self._bn3(x), self._opt32(weight), self._bn3(dy), _f32(mean), _f32(invstd),
                                  None if dx is None else self._bn3(dx), dweight, dbias, bool(training),
                                  get_num_threads(), None if y is None else self._bn3(_f32(y)))
        return dx, dweight, dbias

    # --------------------------------------------------------------- dropout
    def _dropout(self, a, p, seed):
        a = _f32(a)
        out = self._empty(a.shape)
        _norm.dropout_apply(a.reshape(-1), out.reshape(-1), int(seed), dropout_threshold(p), dropout_scale(p),
                            get_num_threads())
        return out

    def dropout_forward(self, x, p, seed):
        return self._dropout(x, p, seed)

    def dropout_backward(self, dy, p, seed):
        return self._dropout(dy, p, seed)

    # ------------------------------------------------------ more activations
    def leaky_relu_forward(self, x, negative_slope):
        x = _f32(x)
        y = self._empty(x.shape)
        _activations.leaky_relu_forward(x.reshape(-1), y.reshape(-1), float(negative_slope), get_num_threads())
        return y

    def leaky_relu_backward(self, x, dy, negative_slope):
        x, dy = _f32(x), _f32(dy)
        dx = self._empty(dy.shape)
        _activations.leaky_relu_backward(x.reshape(-1), dy.reshape(-1), dx.reshape(-1), float(negative_slope),
                                         get_num_threads())
        return dx

    def tanh_forward(self, x):
        return self._unary(_activations.tanh_forward, x)

    def tanh_backward(self, y, dy):
        return self._binary(_activations.tanh_backward, y, dy)

    @staticmethod
    def _lines(shape, dim):
        """(outer, D, inner) of a softmax along ``dim``."""
        return math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1:])

    def softmax_forward(self, x, dim):
        x = _f32(x)
        y = self._empty(x.shape)
        lines = self._lines(x.shape, dim)
        _activations.softmax_forward(x.reshape(lines), y.reshape(lines), get_num_threads())
        return y

    def softmax_backward(self, y, dy, dim):
        y, dy = _f32(y), _f32(dy)
        dx = self._empty(y.shape)
        lines = self._lines(y.shape, dim)
        _activations.softmax_backward(y.reshape(lines), dy.reshape(lines), dx.reshape(lines), get_num_threads())
        return dx

    def add(self, a, b):
        return self._binary(_activations.add, a, b)

    def add_relu(self, a, b):
        return self._binary(_activations.add_relu, a, b)

    # ------------------------------------------------------------ more losses
    def mse_forward(self, pred, target):
        return float(_losses.mse_forward(_f32(pred).reshape(-1), _f32(target).reshape(-1), get_num_threads()))

    def mse_backward(self, pred, target):
        pred = _f32(pred)
        d = self._empty(pred.shape)
        _losses.mse_backward(pred.reshape(-1), _f32(target).reshape(-1), d.reshape(-1), get_num_threads())
        return d

    def softmax_cross_entropy_smoothed_forward(self, logits, labels, label_smoothing):
        logits, labels = _f32(logits), _i32(labels)
        on, off = smoothed_targets(label_smoothing, logits.shape[1])
        probs = np.empty_like(logits)
        loss = _losses.softmax_cross_entropy_smoothed_forward(logits, labels, probs, on, off, get_num_threads())
        return float(loss), probs

    def softmax_cross_entropy_smoothed_backward(self, probs, labels, label_smoothing):
        probs, labels = _f32(probs), _i32(labels)
        on, off = smoothed_targets(label_smoothing, probs.shape[1])
        d = np.empty_like(probs)
        _losses.softmax_cross_entropy_smoothed_backward(probs, labels, d, on, off, get_num_threads())
        return d

    # ------------------------------------ general convolution and pooling ops
    def conv2d_general_forward(self, x, w, b, stride, pads, dilation, groups):
        """Depthwise (one channel per filter) on the direct kernels, the rest im2col + sgemm per
        (image, group) (``_conv_general``)."""
        return self._conv_general_forward(x, w, b, stride, pads, dilation, groups, False)

    def conv2d_general_relu_forward(self, x, w, b, stride, pads, dilation, groups):
        """Depthwise: the ReLU applied by the kernel as it stores (no second pass over y)."""
        if w.shape[1] != 1:
            return super().conv2d_general_relu_forward(x, w, b, stride, pads, dilation, groups)
        return self._conv_general_forward(x, w, b, stride, pads, dilation, groups, True)

    def _conv_general_forward(self, x, w, b, stride, pads, dilation, groups, relu):
        x, w = _f32(x), _f32(w)
        b = None if b is None else _f32(b)
        N, C, H, W = x.shape
        O, Cg, KH, KW = w.shape
        P = _out_size(H, KH, stride[0], pads[0], pads[1], dilation[0])
        Q = _out_size(W, KW, stride[1], pads[2], pads[3], dilation[1])
        y = self._empty((N, O, P, Q))
        args = (stride[0], stride[1], pads[0], pads[2], dilation[0], dilation[1])
        if Cg == 1:
            _conv_general.depthwise_forward(x, w, b, y, *args, get_num_threads(), relu=relu)
        else:  # relu is False here: the general kernels store no ReLU
            with _blas_limit(N * O * P * Q * Cg * KH * KW):
                _conv_general.conv2d_general_forward(x, w, b, y, *args, groups, get_num_threads())
        return y

    def conv2d_general_backward(self, x, w, dy, stride, pads, dilation, groups, need_dx=True, need_db=True):
        x, w, dy = _f32(x), _f32(w), _f32(dy)
        O, Cg, KH, KW = w.shape
        dx = self._empty(x.shape) if need_dx else None
        dw = self._empty(w.shape)
        db = np.empty(O, dtype=np.float32) if need_db else None
        args = (stride[0], stride[1], pads[0], pads[2], dilation[0], dilation[1])
        if Cg == 1:
            _conv_general.depthwise_backward(x, w, dy, dx, dw, db, *args, get_num_threads())
        else:
            with _blas_limit(dy.size * Cg * KH * KW):
                _conv_general.conv2d_general_backward(x, w, dy, dx, dw, db, *args, groups, get_num_threads())
        return dx, dw, db

    def maxpool2d_general_forward(self, x, kernel, stride, pads):
        x = _f32(x)
        N, C, H, W = x.shape
        P = _out_size(H, kernel[0], stride[0], pads[0])
        Q = _out_size(W, kernel[1], stride[1], pads[1])
        y = self._empty((N, C, P, Q))
        argmax = self._empty((N, C, P, Q), np.int32)
        _pool.maxpool2d_general_forward(x, y, argmax, kernel[0], kernel[1], stride[0], stride[1], pads[0], pads[1],
                                        get_num_threads())
        return y, argmax

    def avgpool2d_forward(self, x, kernel, stride, pads):
        x = _f32(x)
        N, C, H, W = x.shape
        y = self._empty((N, C, _out_size(H, kernel[0], stride[0], pads[0]), _out_size(W, kernel[1], stride[1], pads[1])))
        _pool.avgpool2d_forward(x, y, kernel[0], kernel[1], stride[0], stride[1], pads[0], pads[1], get_num_threads())
        return y

    def avgpool2d_backward(self, dy, x_shape, kernel, stride, pads):
        dy = _f32(dy)
        dx = self._empty(tuple(x_shape))
        _pool.avgpool2d_backward(dy, dx, kernel[0], kernel[1], stride[0], stride[1], pads[0], pads[1],
                                 get_num_threads())
        return dx

    def adaptive_avgpool2d_forward(self, x, output_size):
        x = _f32(x)
        y = self._empty(x.shape[:2] + tuple(output_size))
        _pool.adaptive_avgpool2d_forward(x, y, get_num_threads())
        return y

    def adaptive_avgpool2d_backward(self, dy, x_shape, output_size):
        dy = _f32(dy)
        dx = self._empty(tuple(x_shape))
        _pool.adaptive_avgpool2d_backward(dy, dx, get_num_threads())
        return dx

    # ------------------------------------------------------------ bfloat16
    # Native AVX512_BF16 kernels (``parconv._ext._bf16``) where ``_bf16.native()`` says this level
    # and CPU run them; elsewhere the emulation: inputs rounded to bf16, then the float32 *direct*
    # kernels (Winograd's transforms would lose more bits than bf16 keeps). Per layer, the native path
    # still emulates where that is faster (_bf16_forward_native, _bf16_dw_native).
    def round_to_bf16(self, a):
        """``a`` rounded to bf16 (RNE, NaN stays NaN) as a new float32 array (``_bf16.round_to_bf16``)."""
        a = _f32(a)
        kernel = getattr(_bf16, "round_to_bf16", None)
        if kernel is None or a.size == 0:
            return _round_to_bf16_numpy(a)
        out = self._empty(a.shape)
        kernel(a.reshape(-1), out.reshape(-1), get_num_threads())
        return out

    def _sum_for_bias(self, dy, axes):
        return np.asarray(_f32(dy).sum(axis=axes, dtype=np.float32), dtype=np.float32)

    def conv2d_forward_bf16(self, x, w, b, stride, padding):
        def compute(x, w, b, y):
            if _bf16.native() and _bf16_forward_native(w.shape[1], w.shape[2]):
                _bf16.conv2d_forward(x, w, b, y, stride, padding, get_num_threads())
            elif w.shape[2] == 1 and padding == 0 and stride > 1:
                # a strided 1x1 reads every stride-th pixel: round only those, then convolve at stride 1
                _conv_general.pointwise_forward(self.round_to_bf16(x[:, :, ::stride, ::stride]), self.round_to_bf16(w),
                                                b, y, get_num_threads())
            else:
                _conv.conv2d_forward(self.round_to_bf16(x), self.round_to_bf16(w), b, y, stride, padding,
                                     get_num_threads(), CONV_FORWARD_TILE_BYTES, winograd=False, winograd4=False)

        return self._conv_forward("conv2d_forward_bf16", x, w, b, stride, padding, compute)

    def conv2d_backward_bf16(self, x, w, dy, stride, padding, need_dx=True, need_db=True):
        x, w, dy = _f32(x), _f32(w), _f32(dy)
        if min(x.shape + w.shape + dy.shape) <= 0:
            return self._reference().conv2d_backward_bf16(x, w, dy, stride, padding, need_dx, need_db)
        dx = self._empty(x.shape) if need_dx else None
        dw = self._empty(w.shape)
        if _bf16.native():
            db = np.empty(w.shape[0], dtype=np.float32) if need_db else None
            if _bf16_dw_native(w.shape[2], stride, padding):
                _bf16.conv2d_backward(x, w, dy, dx, dw, db, stride, padding, get_num_threads())
                return dx, dw, db
            if dx is not None or db is not None:
                _bf16.conv2d_backward(x, w, dy, dx, None, db, stride, padding, get_num_threads())
            # the float32 weight gradient of the rounded tensors: the same exact products, fp32 sums
            with _blas_one_thread:
                _conv.conv2d_backward(self.round_to_bf16(x), w, self.round_to_bf16(dy), None, dw, None, stride,
                                      padding, get_num_threads(), CONV_BACKWARD_TILE_BYTES)
            return dx, dw, db
        K = w.shape[2]
        uses_blas = stride != 1 or (need_dx and padding > K - 1)
        with _blas_one_thread if uses_blas else contextlib.nullcontext():
            _conv.conv2d_backward(self.round_to_bf16(x), self.round_to_bf16(w), self.round_to_bf16(dy), dx, dw,
                                  None, stride, padding, get_num_threads(), CONV_BACKWARD_TILE_BYTES)
        return dx, dw, (self._sum_for_bias(dy, (0, 2, 3)) if need_db else None)

    def conv2d_relu_maxpool2d_forward_bf16(self, x, w, b, stride, padding, pool_kernel, pool_stride):
        """The fused float32 kernel on the rounded x and w where it runs: its products are exact and
        its sums float32, which is the bf16 convolution; the composition elsewhere."""
        x, w = _f32(x), _f32(w)
        if min(x.shape + w.shape) > 0:
            fused = self._fused_forward_kernel(self.round_to_bf16(x), self.round_to_bf16(w),
                                               None if b is None else _f32(b), stride, padding, pool_kernel,
                                               pool_stride)
            if fused is not None:
                return fused[:2]
        return super().conv2d_relu_maxpool2d_forward_bf16(x, w, b, stride, padding, pool_kernel, pool_stride)

    def conv2d_relu_maxpool2d_backward_bf16(self, x, w, y, argmax, dy, stride, padding, need_dx=True,
                                            need_db=True, pool_overlaps=True):
        """The fused float32 gradient of the rounded x and dy where it runs and the pooling windows did
        not overlap: each dz value is then one dy value or zero, so rounding dy rounds dz. db is the
        float32 sum of the unrounded dz (dy where ReLU passed it), as the contract says."""
        x, w, y, dy = _f32(x), _f32(w), _f32(y), _f32(dy)
        if pool_overlaps or not self._fused_backward_runs(x, w, y, stride, need_dx):
            return super().conv2d_relu_maxpool2d_backward_bf16(x, w, y, argmax, dy, stride, padding, need_dx,
                                                               need_db, pool_overlaps)
        _, dw, _ = self.conv2d_relu_maxpool2d_backward(self.round_to_bf16(x), w, y, argmax, self.round_to_bf16(dy),
                                                       stride, padding, False, False)
        db = self._sum_for_bias(self.relu_backward(y, dy), (0, 2, 3)) if need_db else None
        return None, dw, db

    def linear_forward_bf16(self, x, w, b):
        x, w = _f32(x), _f32(w)
        if not _bf16.native() or self._narrow(x, w):
            # a narrow head (few outputs, wide inputs): the float32 narrow kernels on the rounded
            # tensors stream the wide operand once, where the bf16 GEMM repacks it
            return super().linear_forward_bf16(x, w, b)
        y = self._empty((x.shape[0], w.shape[0]))
        _bf16.linear_forward(x, w, None if b is None else _f32(b), y, get_num_threads())
        return y

    def linear_backward_bf16(self, x, w, dy, need_dx=True, need_db=True):
        x, w, dy = _f32(x), _f32(w), _f32(dy)
        if not _bf16.native() or self._narrow(x, w):
            return super().linear_backward_bf16(x, w, dy, need_dx, need_db)
        dx = self._empty(x.shape) if need_dx else None
        dw = self._empty(w.shape)
        db = np.empty(w.shape[0], dtype=np.float32) if need_db else None
        _bf16.linear_backward(x, w, dy, dx, dw, db, get_num_threads())
        return dx, dw, db
