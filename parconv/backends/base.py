"""The Backend protocol.

Shape legend used by every backend:
``N`` batch, ``C`` in-channels, ``O`` out-channels (filters), ``H, W`` input
height/width, ``P, Q`` output height/width, ``K`` kernel size (``kH, kW``),
``F`` in-features, ``G`` out-features.

Backend arrays are opaque to the rest of the library: layers, losses and
optimizers only read ``.shape`` and ``.dtype`` and hand them back to the
backend, so a backend is free to keep them on a device. Float arrays are
float32 and C-contiguous; labels are int32. Inputs reaching these methods have
been validated by :mod:`parconv.functional`; backends trust them.

Every ``*_backward`` returns freshly written gradients (they overwrite, never
accumulate). Optimizer updates work in place.

A backend implements every method below. A method it lacks raises
``NotImplementedError`` naming the backend and the op. The fused
``conv2d_relu_maxpool2d_*`` pair has a default built from the unfused ops;
backends override it to avoid writing the full-size convolution output. So
has the ``conv2d_relu_maxpool2d_linear_*`` pair, which also takes the
``flatten -> linear`` classifier head that follows; a backend overrides it
and says where through :meth:`Backend.fuses_linear_head`.
"""

from __future__ import annotations

import numpy as np

from .._shapes import out_size


class Backend:
    """Base class of every backend. Subclasses set :attr:`name`."""

    #: registry name
    name: str = "base"
    #: whether arrays live on the host as NumPy arrays
    host_arrays: bool = False

    def _missing(self, op: str):
        return NotImplementedError(f"backend {self.name!r} does not implement {op}")

    def __repr__(self) -> str:
        return f"<parconv backend {self.name!r}>"

    # ------------------------------------------------------------------ arrays
    def asarray(self, x, dtype=np.float32):
        """Host array-like -> backend array of ``dtype`` (float32 or int32), C-contiguous.

        Host backends may return ``x`` itself when it already qualifies, so
        callers that update in place copy first.
        """
        raise self._missing("asarray")

    def to_numpy(self, a) -> np.ndarray:
        """Backend array -> NumPy array (a copy when the data is on a device)."""
        raise self._missing("to_numpy")

    def is_array(self, a) -> bool:
        """Whether ``a`` is an array of this backend."""
        raise self._missing("is_array")

    def empty(self, shape, dtype=np.float32):
        """Uninitialised array."""
        raise self._missing("empty")

    def zeros(self, shape, dtype=np.float32):
        """Zero-filled array."""
        raise self._missing("zeros")

    def reshape(self, a, shape):
        """View (or copy) of contiguous ``a`` with a new shape."""
        raise self._missing("reshape")

    def copy(self, a):
        """New array with the contents of ``a``."""
        raise self._missing("copy")

    def copy_into(self, dst, src) -> None:
        """``dst[...] = src`` for two arrays of this backend with equal shapes. A write into a
        parameter or buffer: implementations call :func:`parconv.weights_changed` so that caches
        derived from the weights (eval-mode BatchNorm folds) rebuild."""
        raise self._missing("copy_into")

    def synchronize(self) -> None:
        """Wait for queued work to finish (no-op for synchronous backends)."""

    # ------------------------------------------------------------------ conv2d
    def conv2d_forward(self, x, w, b, stride: int, padding: int):
        """Cross-correlation ``y = x * w + b``.

        x (N, C, H, W), w (O, C, K, K), b (O,) or None -> y (N, O, P, Q) with
        ``P = (H + 2 padding - K) // stride + 1`` (Q likewise).
        """
        raise self._missing("conv2d_forward")

    def conv2d_backward(self, x, w, dy, stride: int, padding: int, need_dx: bool = True, need_db: bool = True):
        """Gradients of :meth:`conv2d_forward`.

        Returns ``(dx, dw, db)``: dx (N, C, H, W) or None when not
        ``need_dx``, dw (O, C, K, K), db (O,) or None when not ``need_db``.
        All overwritten.
        """
        raise self._missing("conv2d_backward")

    # --------------------------------------------------------------- maxpool2d
    def maxpool2d_forward(self, x, kernel_size: int, stride: int):
        """Max pooling over K x K windows, no padding, floor mode.

        x (N, C, H, W) -> ``(y, argmax)``: y (N, C, P, Q) and argmax (N, C, P, Q),
        the flat index ``h * W + w`` of the maximum inside its (H, W) plane
        (the first one on ties), cached for the backward. argmax is int32, or
        uint16 where the plane has at most 65,536 positions and the backend
        stores it compactly; every backend's backward takes either.
        """
        raise self._missing("maxpool2d_forward")

    def maxpool2d_backward(self, dy, argmax, x_shape):
        """Route dy (N, C, P, Q) to the argmax (int32 or uint16) positions; returns dx of ``x_shape``
        (overwritten)."""
        raise self._missing("maxpool2d_backward")

    # ------------------------------------------------------------------ linear
    def linear_forward(self, x, w, b):
        """``y = x @ w.T + b``: x (N, F), w (G, F), b (G,) or None -> y (N, G)."""
        raise self._missing("linear_forward")

    def linear_backward(self, x, w, dy, need_dx: bool = True, need_db: bool = True):
        """Returns ``(dx, dw, db)``: dx (N, F) or None, dw (G, F), db (G,) or None; overwritten."""
        raise self._missing("linear_backward")

    def linear_relu_forward(self, x, w, b):
        """``max(x @ w.T + b, 0)``: a linear layer followed by a ReLU (b may be None).

        The default composes the unfused ops; backends override it to apply the
        ReLU as the linear layer stores its output.
        """
        return self.relu_forward(self.linear_forward(x, w, b))

    def linear_relu_backward(self, x, w, y, dy, need_dx: bool = True, need_db: bool = True):
        """Gradients of :meth:`linear_relu_forward` from its output y; returns ``(dx, dw, db)``
        as :meth:`linear_backward` (dy is masked by ``y > 0``)."""
        return self.linear_backward(x, w, self.relu_backward(y, dy), need_dx, need_db)

    # ------------------------------------------------------------- activations
    def relu_forward(self, x):
        """``y = max(x, 0)`` elementwise, any shape."""
        raise self._missing("relu_forward")

    def relu_backward(self, y, dy):
        """``dx = dy * (y > 0)`` from the forward *output* y."""
        raise self._missing("relu_backward")

    def sigmoid_forward(self, x):
        """``y = 1 / (1 + exp(-x))``, computed without overflow."""
        raise self._missing("sigmoid_forward")

    def sigmoid_backward(self, y, dy):
        """``dx = dy * y * (1 - y)`` from the forward output y."""
        raise self._missing("sigmoid_backward")

    # ------------------------------------------------------------------ losses
    def softmax_cross_entropy_forward(self, logits, labels):
        """Mean softmax cross-entropy with a stable log-sum-exp.

        logits (N, G) float32, labels (N,) int32 in ``[0, G)`` -> ``(loss, probs)``:
        loss a Python float (the only value that comes back to the host),
        probs (N, G) the softmax, kept for the backward. Probabilities below
        the smallest normal float (``FLT_MIN``, 1.2e-38 in float32) are
        flushed to zero: denormal numbers in a gradient slow every kernel
        below it on many CPUs.
        """
        raise self._missing("softmax_cross_entropy_forward")

    def softmax_cross_entropy_backward(self, probs, labels):
        """``dlogits = (probs - onehot(labels)) / N`` (overwritten), denormal entries flushed to zero."""
        raise self._missing("softmax_cross_entropy_backward")

    def bce_forward(self, p, t, eps: float):
        """Mean binary cross-entropy of probabilities p and 0/1 targets t (same shape).

        p is clipped to ``[eps, 1 - eps]``; returns a Python float.
        """
        raise self._missing("bce_forward")

    def bce_backward(self, p, t, eps: float):
        """``dp = (p - t) / (p (1 - p)) / numel`` with p clipped as in the forward."""
        raise self._missing("bce_backward")

    def count_correct(self, logits, labels) -> int:
        """Number of rows whose argmax equals the label (one scalar comes back)."""
        raise self._missing("count_correct")

    # --------------------------------------------------------------- optimizer
    def sgd_update(self, p, g, v, lr: float, momentum: float, weight_decay: float, nesterov: bool) -> None:
        """In-place SGD step, PyTorch's formulation.

        ``g' = g + weight_decay * p``; with momentum ``v = momentum * v + g'``
        (v is None when momentum == 0) and the step direction is
        ``g' + momentum * v`` (nesterov) or ``v``; ``p -= lr * direction``.
        """
        raise self._missing("sgd_update")

    def sgd_update_many(self, ps, gs, vs, lr: float, momentum: float, weight_decay: float, nesterov: bool) -> None:
        """:meth:`sgd_update` of every ``(ps[i], gs[i], vs[i])`` (``vs`` None when momentum == 0).

        A backend may run them as one operation; the default updates them one by one.
        """
        for i, (p, g) in enumerate(zip(ps, gs)):
            self.sgd_update(p, g, None if vs is None else vs[i], lr, momentum, weight_decay, nesterov)

    def adam_update(self, p, g, m, v, lr: float, beta1: float, beta2: float, eps: float,
                    weight_decay: float, step: int, decoupled: bool = False) -> None:
        """In-place Adam step (PyTorch's formulation, ``step`` counts from 1).

        ``decoupled=False`` (Adam): ``g' = g + weight_decay * p``. ``decoupled=True`` (AdamW):
        ``p *= 1 - lr * weight_decay`` first and ``g' = g``. Then ``m = beta1 m + (1 - beta1) g'``,
        ``v = beta2 v + (1 - beta2) g'^2`` and
        ``p -= lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)``.
        """
        raise self._missing("adam_update")

    def adam_update_many(self, ps, gs, ms, vs, lr: float, beta1: float, beta2: float, eps: float,
                         weight_decay: float, step: int, decoupled: bool = False) -> None:
        """:meth:`adam_update` of every ``(ps[i], gs[i], ms[i], vs[i])``.

        A backend may run them as one operation; the default updates them one by one.
        """
        for p, g, m, v in zip(ps, gs, ms, vs):
            self.adam_update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, decoupled)

    def rmsprop_update(self, p, g, sq, buf, lr: float, alpha: float, eps: float, weight_decay: float,
                       momentum: float) -> None:
        """In-place RMSprop step, PyTorch's formulation with ``centered=False``.

        ``g' = g + weight_decay * p``; ``sq = alpha sq + (1 - alpha) g'^2``;
        ``a = sqrt(sq) + eps``; with momentum (``buf`` None when momentum == 0)
        ``buf = momentum buf + g' / a`` and ``p -= lr * buf``, else ``p -= lr * (g' / a)``.
        """
        raise self._missing("rmsprop_update")

    def rmsprop_update_many(self, ps, gs, sqs, bufs, lr: float, alpha: float, eps: float, weight_decay: float,
                            momentum: float) -> None:
        """:meth:`rmsprop_update` of every parameter (``bufs`` None when momentum == 0)."""
        for i, (p, g, sq) in enumerate(zip(ps, gs, sqs)):
            self.rmsprop_update(p, g, sq, None if bufs is None else bufs[i], lr, alpha, eps, weight_decay, momentum)

    def norm_many(self, xs, norm_type: float) -> float:
        """The ``norm_type``-norm (``> 0`` or ``inf``) of all the arrays ``xs`` taken as one vector.

        Returns a Python float (the one value that leaves a device backend); NaN in any array
        gives NaN.
        """
        raise self._missing("norm_many")

    def scale_many(self, xs, factor: float) -> None:
        """``x *= factor`` in place for every array of ``xs`` (factor rounded to float32)."""
        raise self._missing("scale_many")

    # ------------------------------------------------- fused conv+relu+maxpool
    def conv2d_relu_maxpool2d_forward(self, x, w, b, stride: int, padding: int, pool_kernel: int, pool_stride: int):
        """``maxpool2d(relu(conv2d(x)))`` -> ``(y, argmax)`` with argmax indexing the (P, Q) conv plane
        (int32 or uint16, as :meth:`maxpool2d_forward`).

        The default composes the unfused ops; backends override it so the
        full-size convolution output is never written.
        """
        z = self.conv2d_forward(x, w, b, stride, padding)
        y, argmax = self.maxpool2d_forward(z, pool_kernel, pool_stride)
        return self.relu_forward(y), argmax

    def conv2d_relu_maxpool2d_backward(self, x, w, y, argmax, dy, stride: int, padding: int,
                                       need_dx: bool = True, need_db: bool = True):
        """Gradients of the fused op from its output y and argmax; returns ``(dx, dw, db)``."""
        N, O = x.shape[0], w.shape[0]
        K = w.shape[2]
        P, Q = out_size(x.shape[2], K, stride, padding), out_size(x.shape[3], K, stride, padding)
        dz = self.maxpool2d_backward(self.relu_backward(y, dy), argmax, (N, O, P, Q))
        return self.conv2d_backward(x, w, dz, stride, padding, need_dx, need_db)

    # ------------------------------------------ fused conv + eval-mode batch norm
    def conv2d_batch_norm_eval_forward(self, x, w, b, weight, bias, running_mean, running_var, eps: float,
                                       stride: int, padding: int, relu: bool):
        """``batch_norm_forward_eval(conv2d_forward(x, w, b), ...)``, then ``max(., 0)`` when ``relu``.

        Eval-mode batch norm is a per-channel affine map, so a backend may fold
        it into the convolution: ``conv(x, w) * scale + shift`` with ``scale =
        weight / sqrt(running_var + eps)`` and ``shift = bias + (b - running_mean)
        * scale`` (weight 1, bias 0 and b 0 where None), applied as the output is
        stored. The default composes the unfused ops.
        """
        z = self.conv2d_forward(x, w, b, stride, padding)
        y, _, _ = self.batch_norm_forward_eval(z, weight, bias, running_mean, running_var, eps, relu)
        return y

    def conv2d_scale_shift_forward(self, x, w, scale, shift, stride: int, padding: int, relu: bool):
        """``conv2d_forward(x, w, None) * scale + shift`` per filter, then ``max(., 0)`` when ``relu``:
        :meth:`conv2d_batch_norm_eval_forward` with the batch norm already folded into ``scale`` and
        ``shift`` (O,) (what an eval-mode ``Sequential`` keeps between calls). The default composes
        the convolution and an eval-mode batch norm of mean 0, variance 1 and eps 0 (exact)."""
        z = self.conv2d_forward(x, w, None, stride, padding)
        O = w.shape[0]
        y, _, _ = self.batch_norm_forward_eval(z, scale, shift, self.zeros((O,)),
                                               self.asarray(np.ones(O, np.float32)), 0.0, relu)
        return y

    # ------------------------------- fused conv+relu+maxpool -> flatten -> linear
    def fuses_linear_head(self, in_features: int, out_features: int) -> bool:
        """Whether the ``conv2d_relu_maxpool2d_linear_*`` pair beats the composition here.

        ``Sequential`` runs ``Conv2d -> ReLU -> MaxPool2d -> Flatten -> Linear``
        through that pair only where this returns True. The default pair
        composes the unfused ops (correct everywhere, never faster), so the
        base class says False.
        """
        return False

    def conv2d_relu_maxpool2d_linear_forward(self, x, w, b, stride: int, padding: int, pool_kernel: int,
                                             pool_stride: int, wl, bl):
        """The fused op followed by ``flatten -> linear``: returns ``(y, argmax, logits)``.

        y and argmax as :meth:`conv2d_relu_maxpool2d_forward`; logits (N, G) is
        ``reshape(y, (N, F)) @ wl.T + bl`` with wl (G, F) and bl (G,) or None.
        """
        y, argmax = self.conv2d_relu_maxpool2d_forward(x, w, b, stride, padding, pool_kernel, pool_stride)
        logits = self.linear_forward(self.reshape(y, (y.shape[0], wl.shape[1])), wl, bl)
        return y, argmax, logits

    def conv2d_relu_maxpool2d_linear_backward(self, x, w, y, argmax, wl, dlogits, stride: int, padding: int,
                                              need_dx: bool = True, need_db: bool = True,
                                              need_head_db: bool = True):
        """Gradients when the pooled output y fed ``flatten -> linear(wl)``: returns
        ``(dx, dw, db, dwl, dbl)``, the convolution's and then the head's (``dbl`` None unless
        ``need_head_db``).

        The pooled gradient is ``reshape(dlogits @ wl, y.shape)``; a backend
        that fuses never stores it whole.
        """
        yf = self.reshape(y, (y.shape[0], wl.shape[1]))
        dyf, dwl, dbl = self.linear_backward(yf, wl, dlogits, True, need_head_db)
        dx, dw, db = self.conv2d_relu_maxpool2d_backward(x, w, y, argmax, self.reshape(dyf, y.shape), stride,
                                                         padding, need_dx, need_db)
        return dx, dw, db, dwl, dbl

    # -------------------------------------------------------------- bfloat16
    # Convolution and linear with bf16 inputs and float32 accumulation (``parconv.autocast``).
    # Every input of a product is rounded to bf16 (nearest, ties to even; NaN stays NaN), products
    # and sums are float32, the bias is added in float32 and db is the float32 sum of the
    # *unrounded* dy. The defaults emulate that on any backend (round, then the float32 op);
    # a backend with bf16 kernels overrides them. Arguments and results as the float32 ops.
    def round_to_bf16(self, a):
        """A new float32 array of this backend: ``a`` rounded to bf16 (the low 16 bits zero).

        The default rounds on the host (:func:`parconv.amp.round_to_bf16`).
        """
        from ..amp import round_to_bf16

        return self.asarray(round_to_bf16(self.to_numpy(a)))

    def _sum_for_bias(self, dy, axes: tuple):
        """``db``: the float32 sum of dy over ``axes`` (every axis but the channel one), on the host."""
        host = np.asarray(self.to_numpy(dy), dtype=np.float32)
        return self.asarray(host.sum(axis=axes, dtype=np.float32))

    def conv2d_forward_bf16(self, x, w, b, stride: int, padding: int):
        """:meth:`conv2d_forward` with x and w rounded to bf16, float32 accumulation."""
        return self.conv2d_forward(self.round_to_bf16(x), self.round_to_bf16(w), b, stride, padding)

    def conv2d_backward_bf16(self, x, w, dy, stride: int, padding: int, need_dx: bool = True,
                             need_db: bool = True):
        """:meth:`conv2d_backward` in bf16: dx from bf16(dy), bf16(w); dw from bf16(x), bf16(dy);
        db the float32 sum of the unrounded dy. Overwritten."""
        dx, dw, _ = self.conv2d_backward(self.round_to_bf16(x), self.round_to_bf16(w), self.round_to_bf16(dy),
                                         stride, padding, need_dx, False)
        return dx, dw, (self._sum_for_bias(dy, (0, 2, 3)) if need_db else None)

    def conv2d_general_forward_bf16(self, x, w, b, stride: tuple, pads: tuple, dilation: tuple, groups: int):
        """:meth:`conv2d_general_forward` with x and w rounded to bf16, float32 accumulation."""
        return self.conv2d_general_forward(self.round_to_bf16(x), self.round_to_bf16(w), b, stride, pads,
                                           dilation, groups)

    def conv2d_general_backward_bf16(self, x, w, dy, stride: tuple, pads: tuple, dilation: tuple, groups: int,
                                     need_dx: bool = True, need_db: bool = True):
        """:meth:`conv2d_general_backward` in bf16 (rounding as :meth:`conv2d_backward_bf16`)."""
        dx, dw, _ = self.conv2d_general_backward(self.round_to_bf16(x), self.round_to_bf16(w),
                                                 self.round_to_bf16(dy), stride, pads, dilation, groups,
                                                 need_dx, False)
        return dx, dw, (self._sum_for_bias(dy, (0, 2, 3)) if need_db else None)

    def linear_forward_bf16(self, x, w, b):
        """:meth:`linear_forward` with x and w rounded to bf16, float32 accumulation."""
        return self.linear_forward(self.round_to_bf16(x), self.round_to_bf16(w), b)

    def linear_backward_bf16(self, x, w, dy, need_dx: bool = True, need_db: bool = True):
        """:meth:`linear_backward` in bf16 (rounding as :meth:`conv2d_backward_bf16`)."""
        dx, dw, _ = self.linear_backward(self.round_to_bf16(x), self.round_to_bf16(w), self.round_to_bf16(dy),
                                         need_dx, False)
        return dx, dw, (self._sum_for_bias(dy, (0,)) if need_db else None)

    def conv2d_relu_maxpool2d_forward_bf16(self, x, w, b, stride: int, padding: int, pool_kernel: int,
                                           pool_stride: int):
        """:meth:`conv2d_relu_maxpool2d_forward` around the bf16 convolution: ``(y, argmax)``.
        The default composes the bf16 convolution, pooling and ReLU."""
        z = self.conv2d_forward_bf16(x, w, b, stride, padding)
        y, argmax = self.maxpool2d_forward(z, pool_kernel, pool_stride)
        return self.relu_forward(y), argmax

    def conv2d_relu_maxpool2d_backward_bf16(self, x, w, y, argmax, dy, stride: int, padding: int,
                                            need_dx: bool = True, need_db: bool = True,
                                            pool_overlaps: bool = True):
        """Gradients of :meth:`conv2d_relu_maxpool2d_forward_bf16`: the convolution's gradient dz
        (dy through ReLU and pooling) into :meth:`conv2d_backward_bf16`. ``pool_overlaps``: whether
        the pooling windows overlapped (then dz sums several dy); False lets a backend round dy
        instead of dz, which is the same then."""
        N, O, K = x.shape[0], w.shape[0], w.shape[2]
        P, Q = out_size(x.shape[2], K, stride, padding), out_size(x.shape[3], K, stride, padding)
        dz = self.maxpool2d_backward(self.relu_backward(y, dy), argmax, (N, O, P, Q))
        return self.conv2d_backward_bf16(x, w, dz, stride, padding, need_dx, need_db)

    # ------------------------------------------------------------ batch norm
    # x is (N, C), (N, C, L) or (N, C, H, W); the statistics run over every dim but 1
    # (M = N * L or N * H * W values per channel). weight/bias (C,) or None (no affine);
    # mean/invstd (C,) float32 are what the forward normalised with, kept for the backward.
    def batch_norm_forward_train(self, x, weight, bias, running_mean, running_var, momentum: float,
                                 eps: float, relu: bool, residual=None):
        """Batch-statistics normalisation: returns ``(y, mean, invstd)``.

        ``mean`` and the biased variance ``var`` are per channel over the batch;
        ``invstd = 1 / sqrt(var + eps)``; ``y = (x - mean) * (invstd * weight) + bias``,
        plus ``residual`` (an array of x's shape: a residual block's shortcut) when
        given, then ``max(y, 0)`` when ``relu``. Where ``running_mean``/``running_var`` are not
        None they are updated in place: ``running = (1 - momentum) * running +
        momentum * batch``, the variance from the unbiased ``var * M / (M - 1)``.
        Needs ``M > 1``.
        """
        raise self._missing("batch_norm_forward_train")

    def batch_norm_forward_eval(self, x, weight, bias, running_mean, running_var, eps: float, relu: bool,
                                residual=None):
        """Running-statistics normalisation: returns ``(y, mean, invstd)`` with ``mean`` a copy of
        ``running_mean`` and ``invstd = 1 / sqrt(running_var + eps)``; y as the training forward."""
        raise self._missing("batch_norm_forward_eval")

    def batch_norm_backward(self, x, weight, dy, mean, invstd, y, training: bool, need_dx: bool = True):
        """Gradients of a batch-norm forward; returns ``(dx, dweight, dbias)`` (overwritten).

        ``y`` is the forward's output when it fused a ReLU (the gradient is
        masked by ``y > 0`` first), else None. ``training``: the statistics
        were the batch's (their gradient flows into dx); otherwise they were
        constants. dx None unless ``need_dx``; dweight/dbias (C,) None when
        ``weight`` is None.
        """
        raise self._missing("batch_norm_backward")

    # --------------------------------------------------------------- dropout
    def dropout_forward(self, x, p: float, seed: int):
        """Inverted dropout: ``y = x * keep / (1 - p)``, any shape.

        ``keep`` is a counter-based hash of ``(seed, flat index)``
        (:func:`parconv.backends.numpy_ref.dropout_keep`), the same on every
        backend, so nothing is stored for the backward. ``p`` in ``[0, 1]``
        (1 gives zeros).
        """
        raise self._missing("dropout_forward")

    def dropout_backward(self, dy, p: float, seed: int):
        """``dx = dy * keep / (1 - p)`` with the forward's mask, recomputed from ``seed``."""
        raise self._missing("dropout_backward")

    # ------------------------------------------------------ more activations
    def leaky_relu_forward(self, x, negative_slope: float):
        """``y = x if x > 0 else negative_slope * x`` elementwise."""
        raise self._missing("leaky_relu_forward")

    def leaky_relu_backward(self, x, dy, negative_slope: float):
        """``dx = dy if x > 0 else negative_slope * dy`` from the forward *input* x."""
        raise self._missing("leaky_relu_backward")

    def tanh_forward(self, x):
        """``y = tanh(x)`` elementwise."""
        raise self._missing("tanh_forward")

    def tanh_backward(self, y, dy):
        """``dx = dy * (1 - y * y)`` from the forward output y."""
        raise self._missing("tanh_backward")

    def softmax_forward(self, x, dim: int):
        """Stable softmax along axis ``dim`` (``0 <= dim < x.ndim``) of x of any rank."""
        raise self._missing("softmax_forward")

    def softmax_backward(self, y, dy, dim: int):
        """``dx = y * (dy - sum(dy * y, dim))`` from the forward output y."""
        raise self._missing("softmax_backward")

    # ------------------------------------------------- elementwise ops by name
    # An elementwise op ``name`` is a pair ``{name}_forward(x, *params) -> y`` and
    # ``{name}_backward(saved, dy, *params) -> dx`` (``saved`` is the forward's input or
    # output, whichever the gradient needs). Compiled backends find their kernels by those
    # names (openmp: ``parconv._ext._activations``; opencl: ``kernels_cl/activations.cl``),
    # so a new elementwise op needs no edit of the backend classes.
    def elementwise_forward(self, op: str, x, params: tuple = ()):
        """``{op}_forward(x, *params)``: a new array of x's shape."""
        method = getattr(self, f"{op}_forward", None)
        if method is None:
            raise self._missing(f"{op}_forward")
        return method(x, *params)

    def elementwise_backward(self, op: str, saved, dy, params: tuple = ()):
        """``{op}_backward(saved, dy, *params)``: dx of dy's shape (overwritten)."""
        method = getattr(self, f"{op}_backward", None)
        if method is None:
            raise self._missing(f"{op}_backward")
        return method(saved, dy, *params)

    def add(self, a, b):
        """``a + b`` for two arrays of equal shape, as a new array."""
        raise self._missing("add")

    def add_relu(self, a, b):
        """``max(a + b, 0)`` (NaN passes) for two arrays of equal shape, as a new array: a residual
        block's output in eval mode. This default runs :meth:`add` then :meth:`relu_forward`; a
        backend may do both in one pass, with the same result."""
        return self.relu_forward(self.add(a, b))

    # ------------------------------------------------------------ more losses
    def mse_forward(self, pred, target) -> float:
        """``mean((pred - target) ** 2)`` over every element (equal shapes); a Python float."""
        raise self._missing("mse_forward")

    def mse_backward(self, pred, target):
        """``2 * (pred - target) / numel`` (overwritten)."""
        raise self._missing("mse_backward")

    def softmax_cross_entropy_smoothed_forward(self, logits, labels, label_smoothing: float):
        """Mean softmax cross-entropy against smoothed targets ``(1 - s) onehot + s / G``.

        Returns ``(loss, probs)`` as :meth:`softmax_cross_entropy_forward`; the
        loss per row is ``-(1 - s) logp[label] - (s / G) sum_j logp[j]``
        (PyTorch's ``label_smoothing``), ``0 < s <= 1``.
        """
        raise self._missing("softmax_cross_entropy_smoothed_forward")

    def softmax_cross_entropy_smoothed_backward(self, probs, labels, label_smoothing: float):
        """``dlogits = (probs - (1 - s) onehot(labels) - s / G) / N`` (overwritten)."""
        raise self._missing("softmax_cross_entropy_smoothed_backward")

    # ------------------------------------ general convolution and pooling ops
    # functional sends the square-kernel, int-argument cases to the methods above
    # (their outputs stay bit for bit), everything else here. Pads are
    # (top, bottom, left, right) for convolutions and symmetric (ph, pw) for pooling.
    def conv2d_general_forward(self, x, w, b, stride: tuple, pads: tuple, dilation: tuple, groups: int):
        """Grouped, dilated, strided cross-correlation with a rectangular kernel and asymmetric padding.

        x (N, C, H, W), w (O, C/groups, kH, kW), b (O,) or None -> y (N, O, P, Q) with
        ``P = (H + top + bottom - dh (kH - 1) - 1) // sh + 1`` (Q likewise,
        :func:`parconv._shapes.out_size`). Filter ``o`` reads the channels of its group
        ``o // (O / groups)``. ``stride=(sh, sw)``, ``pads=(top, bottom, left, right)``,
        ``dilation=(dh, dw)``.
        """
        raise self._missing("conv2d_general_forward")

    def conv2d_general_backward(self, x, w, dy, stride: tuple, pads: tuple, dilation: tuple, groups: int,
                                need_dx: bool = True, need_db: bool = True):
        """Gradients of :meth:`conv2d_general_forward`: ``(dx, dw, db)``, all overwritten.

        dx (N, C, H, W) or None when not ``need_dx``, dw (O, C/groups, kH, kW), db (O,)
        or None when not ``need_db``.
        """
        raise self._missing("conv2d_general_backward")

    def conv2d_general_relu_forward(self, x, w, b, stride: tuple, pads: tuple, dilation: tuple, groups: int):
        """``max(conv2d_general_forward(x, w, b, ...), 0)``: what an eval-mode ``Conv2d -> BatchNorm2d
        -> ReLU`` runs once the batch norm is folded into ``w`` and ``b``. A backend may apply the ReLU
        as the convolution stores; the default composes the two ops."""
        return self.relu_forward(self.conv2d_general_forward(x, w, b, stride, pads, dilation, groups))

    def maxpool2d_general_forward(self, x, kernel: tuple, stride: tuple, pads: tuple):
        """Max pooling with ``kernel=(kh, kw)``, ``stride=(sh, sw)`` and symmetric ``pads=(ph, pw)``.

        Padded positions count as -inf (never selected; ``ph <= kh // 2`` so every window
        holds an input). Returns ``(y, argmax)`` as :meth:`maxpool2d_forward` (argmax the
        flat index ``h * W + w`` in the unpadded plane, first maximum on ties);
        :meth:`maxpool2d_backward` takes it.
        """
        raise self._missing("maxpool2d_general_forward")

    def avgpool2d_forward(self, x, kernel: tuple, stride: tuple, pads: tuple):
        """Average pooling, zero padding counted (each window divided by ``kh * kw``), floor mode.

        x (N, C, H, W) -> y (N, C, P, Q); arguments as :meth:`maxpool2d_general_forward`.
        """
        raise self._missing("avgpool2d_forward")

    def avgpool2d_backward(self, dy, x_shape, kernel: tuple, stride: tuple, pads: tuple):
        """Gradient of :meth:`avgpool2d_forward`: dx of ``x_shape`` (overwritten)."""
        raise self._missing("avgpool2d_backward")

    def adaptive_avgpool2d_forward(self, x, output_size: tuple):
        """Adaptive average pooling to ``output_size=(P, Q)``.

        Output ``(i, j)`` averages rows ``floor(i H / P)`` to ``ceil((i + 1) H / P)``
        (exclusive) and the columns likewise, as PyTorch. x (N, C, H, W) -> y (N, C, P, Q).
        """
        raise self._missing("adaptive_avgpool2d_forward")

    def adaptive_avgpool2d_backward(self, dy, x_shape, output_size: tuple):
        """Gradient of :meth:`adaptive_avgpool2d_forward`: dx of ``x_shape`` (overwritten)."""
        raise self._missing("adaptive_avgpool2d_backward")
