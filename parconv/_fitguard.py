"""The device check ``fit`` runs before training: the ops of this run, at this run's sizes.

A backend that can be wrong on a device (``OpenCLBackend``) offers ``verify(probe, key)``.
The probe here runs what training will run -- one forward pass, loss and backward pass
of the model in training mode at each batch size the epochs will use (the full batch
and the last, smaller one), and eval-mode forward passes at the validation batch sizes
(else at the training batch) -- on random data, so every kernel variant and tiling of the run is compared with the NumPy
reference before a step is taken. Kernels and tiles depend on shapes, not values: a
device that is right at the selftest's sizes can still be wrong at the batch size of
the run. The model is left as it was (buffers, dropout generators and gradient hooks
are restored); the check is kept per device, configuration, model and sizes.
"""

from __future__ import annotations

import numpy as np

from ._weights import weights_changed
from .losses import BCELoss, MSELoss, SoftmaxCrossEntropy


def batch_sizes(n: int | None, batch_size: int, drop_last: bool = False, dp=None) -> tuple:
    """The distinct sizes of the batches an epoch over ``n`` samples feeds this process (``dp``: its shard)."""
    if not n:
        return ()
    sizes = {min(batch_size, n)}
    if n % batch_size and n > batch_size and not drop_last:
        sizes.add(n % batch_size)
    if dp is not None:
        sizes = {hi - lo for lo, hi in (dp.shard(s) for s in sizes)}
    return tuple(sorted(s for s in sizes if s > 0))


def sample_shape(x, loader):
    """The shape of one training sample, or None when it is known only from the data (a batch generator)."""
    if loader is None:
        return tuple(x.shape[1:])
    data = getattr(loader, "x", None)
    if data is None:
        return None
    transform = getattr(loader, "transform", None)
    if transform is None:
        return tuple(data.shape[1:])
    from .data.transforms import Transform

    if not isinstance(transform, Transform):  # an arbitrary callable may keep state: do not call it
        return None
    return tuple(np.asarray(transform(np.array(data[:1]), np.random.default_rng(0))).shape[1:])


def _targets(loss, out_shape, rng):
    if isinstance(loss, SoftmaxCrossEntropy):
        return rng.integers(0, out_shape[1], out_shape[0])
    if isinstance(loss, BCELoss):
        return rng.uniform(0.0, 1.0, out_shape).astype(np.float32)
    if isinstance(loss, MSELoss):
        return rng.standard_normal(out_shape).astype(np.float32)
    return None


class _Kept:
    """Buffers, random generators, gradient hooks and modes of every module, put back on exit."""

    def __init__(self, model, be):
        self.model, self.be = model, be

    def __enter__(self):
        be, self.items = self.be, []
        for m in self.model.modules():
            for name in getattr(m, "buffer_names", ()):
                value = getattr(m, name, None)
                if be.is_array(value):
                    self.items.append((m, name, value, be.copy(value)))
                elif isinstance(value, np.ndarray):
                    self.items.append((m, name, value, value.copy()))
                else:
                    self.items.append((m, name, value, None))
            gens = [(k, v, v.bit_generator.state) for k, v in vars(m).items() if isinstance(v, np.random.Generator)]
            hooks = getattr(m, "_grad_hooks", None)
            self.items.append((m, None, (gens, hooks, m.training), None))
            if hooks:
                m._grad_hooks = []  # data-parallel hooks would start gradient reductions
        return self

    def __exit__(self, *exc):
        for m, name, value, copy in self.items:
            if name is None:
                gens, hooks, training = value
                for k, gen, state in gens:
                    gen.bit_generator.state = state
                    setattr(m, k, gen)
                if hooks is not None:
                    m._grad_hooks = hooks
                m.training = training
                continue
            setattr(m, name, value)
            if copy is not None:
                if isinstance(value, np.ndarray):
                    value[...] = copy
                else:
                    self.be.copy_into(value, copy)
        weights_changed()  # statistics written back in place: eval-mode folds rebuild
        release = getattr(self.model, "release_caches", None)
        if release is not None:
            release()


def verify_for_fit(model, x, loader, batch_size, loss, xv, dp) -> None:
    """Run the backend's device check for this fit (nothing for backends without one)."""
    be = model.backend
    verify = getattr(be, "verify", None)
    if verify is None:
        return
    shape = sample_shape(x, loader)
    if shape is None:  # the samples' shape is not known before training: the fixed checks only
        verify()
        return
    n = loader.num_samples if loader is not None else x.shape[0]
    train = batch_sizes(n, batch_size, bool(getattr(loader, "drop_last", False)), dp)
    # eval mode runs other fused ops (Conv2d -> BatchNorm2d folded, BatchNorm on running statistics):
    # the validation batches, else the training batch (what evaluate runs after fit, tiled the same way)
    evals = train[-1:]
    if xv is not None:
        nv = getattr(xv, "num_samples", None) if hasattr(xv, "epoch") else xv.shape[0]
        eb = getattr(xv, "batch_size", None) if hasattr(xv, "epoch") else max(batch_size, 256)
        evals = batch_sizes(nv, eb, False, dp if not hasattr(xv, "epoch") else None) or evals

    def probe():
        rng = np.random.default_rng(0)
        with _Kept(model, be):
            for training, sizes in ((True, train), (False, evals)):
                model.train(training)
                for n_b in sizes:
                    out = model.forward(be.asarray(rng.standard_normal((n_b,) + shape).astype(np.float32)))
                    y = _targets(loss, tuple(out.shape), rng)
                    if y is not None:
                        prepared = loss.prepare_target(y, n_b if isinstance(loss, SoftmaxCrossEntropy) else None, be)
                        loss.forward(out, prepared, backend=be)
                        loss.count_correct(out, prepared)
                        dy = loss.backward() if training else None
                    else:
                        dy = be.asarray(rng.standard_normal(tuple(out.shape)).astype(np.float32)) if training else None
                    if training:
                        model.backward(dy)

    key = (repr(model), getattr(model, "fuse", None), shape, train, evals, type(loss).__name__)
    verify(probe=probe, key=key)
