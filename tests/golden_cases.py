"""Cases whose outputs are pinned bit for bit by tests/test_golden.py.

Each case builds its model from fixed seeds through the public API only, so a
refactor of the layers, the container or the training loop that changes any
bit of a forward pass, a gradient or an SGD step shows up here. Regenerate the
pinned values (only when a change of numerics is intended) with
``python tests/golden_cases.py``.
"""

from __future__ import annotations

import os
import platform
import sys

import numpy as np

import parconv as pc

#: (backend, threads) pairs the goldens cover; numpy ignores the thread count
CONFIGS = (("numpy", 1), ("openmp", 1), ("openmp", 2))


def _cnn_mnist():
    pc.manual_seed(3)
    return pc.Sequential(pc.Conv2d(1, 8, kernel_size=3), pc.ReLU(), pc.MaxPool2d(2), pc.Flatten(),
                         pc.Linear(8 * 13 * 13, 10))


def _two_conv():
    pc.manual_seed(5)
    return pc.Sequential(pc.Conv2d(3, 6, kernel_size=3, padding=1), pc.ReLU(), pc.MaxPool2d(2),
                         pc.Conv2d(6, 4, kernel_size=3, stride=2, padding=1), pc.ReLU(), pc.Flatten(),
                         pc.Linear(4 * 4 * 4, 5), pc.Sigmoid())


def _mlp():
    pc.manual_seed(7)
    return pc.Sequential(pc.Linear(2, 16), pc.ReLU(), pc.Linear(16, 1), pc.Sigmoid())


def _data(shape, n_classes, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape).astype(np.float32), rng.integers(0, n_classes, shape[0])


def _run(build, x, y, loss_fn, backend, steps=3, momentum=0.9):
    """Forward, every gradient and ``steps`` SGD steps; returns the arrays to pin."""
    model = build()
    model.to(backend)
    out = {}
    logits = model(x)
    out["forward"] = pc.to_numpy(logits).copy()
    loss_fn(logits, y)
    dx = model.backward(loss_fn.backward(), need_dx=True)
    out["dx"] = pc.to_numpy(dx).copy()
    for name, p in model.named_parameters():
        out[f"grad.{name}"] = pc.to_numpy(p.grad).copy()
    opt = pc.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    for s in range(steps):
        opt.zero_grad()
        logits = model(x)
        out[f"loss.{s}"] = np.float64(loss_fn(logits, y))
        model.backward(loss_fn.backward())
        opt.step()
    for name, value in model.state_dict().items():
        out[f"weight.{name}"] = value
    return out


def cases():
    """name -> callable(backend) returning a dict of arrays."""
    x1, y1 = _data((6, 1, 28, 28), 10, 11)
    x2, y2 = _data((4, 3, 16, 16), 2, 12)
    x3, _ = _data((9, 2), 2, 13)
    y3 = (x3[:, :1] * x3[:, 1:] > 0).astype(np.float32)
    y2f = np.random.default_rng(14).random((4, 5)).round().astype(np.float32)
    return {
        "cnn_mnist": lambda be: _run(_cnn_mnist, x1, y1, pc.SoftmaxCrossEntropy(), be),
        "two_conv": lambda be: _run(_two_conv, x2, y2f, pc.BCELoss(), be),
        "mlp": lambda be: _run(_mlp, x3, y3, pc.BCELoss(), be, momentum=0.0),
    }


def fingerprint() -> str:
    """What the pinned bits depend on: the kernels' vector ISA, the CPU and NumPy."""
    from parconv._ext import _conv

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{_conv.kernel_isa()}|{cpu}|numpy {np.__version__}"


def golden_path() -> str:
    from parconv._ext import _conv

    return os.path.join(os.path.dirname(__file__), "data", f"golden_{_conv.kernel_isa()}.npz")


def compute() -> dict:
    arrays = {}
    for name, case in cases().items():
        for backend, threads in CONFIGS:
            with pc.num_threads(threads):
                for key, value in case(backend).items():
                    arrays[f"{name}/{backend}-{threads}/{key}"] = np.asarray(value)
    return arrays


if __name__ == "__main__":
    arrays = compute()
    arrays["__fingerprint__"] = np.array(fingerprint())
    np.savez_compressed(golden_path(), **arrays)
    print(f"wrote {len(arrays) - 1} arrays to {golden_path()} ({fingerprint()})", file=sys.stderr)
