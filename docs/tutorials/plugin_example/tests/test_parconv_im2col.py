"""Tests of the im2col backend: every op it overrides agrees with the NumPy reference.

Run with ``pytest tests`` from the plugin directory (after ``pip install .``);
parconv's own test suite runs them too (tests/test_docs_plugin.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from importlib import import_module
from pathlib import Path

import numpy as np
import pytest

import parconv as pc
import parconv.functional as F
from parconv.backends.numpy_ref import NumpyBackend
from parconv_im2col import Im2colBackend

PLUGIN_ROOT = Path(__file__).resolve().parents[1]
im2col = Im2colBackend()
oracle = NumpyBackend()

# (N, C, H, W, O, K, stride, padding): square and odd sizes, 1x1 kernels,
# strides that do and do not divide the input, padding wider than the kernel
CASES = [
    (2, 3, 8, 8, 4, 3, 1, 0),
    (1, 1, 5, 7, 2, 3, 1, 1),
    (3, 2, 9, 6, 5, 3, 2, 1),
    (2, 4, 7, 7, 3, 1, 1, 0),
    (1, 2, 10, 11, 3, 5, 3, 2),
    (2, 3, 6, 6, 2, 2, 2, 3),
]


def _inputs(case, seed=0):
    N, C, H, W, O, K, stride, padding = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, C, H, W)).astype(np.float32)
    w = rng.standard_normal((O, C, K, K)).astype(np.float32)
    b = rng.standard_normal(O).astype(np.float32)
    P, Q = (H + 2 * padding - K) // stride + 1, (W + 2 * padding - K) // stride + 1
    dy = rng.standard_normal((N, O, P, Q)).astype(np.float32)
    return x, w, b, dy, stride, padding


@pytest.mark.parametrize("case", CASES)
def test_conv2d_forward_matches_reference(case):
    x, w, b, _, stride, padding = _inputs(case)
    y = F.conv2d(x, w, b, stride, padding, backend=im2col)
    expected = F.conv2d(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), stride, padding,
                        backend=oracle)
    assert y.dtype == np.float32 and y.flags.c_contiguous
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", CASES)
def test_conv2d_backward_matches_reference(case):
    x, w, _, dy, stride, padding = _inputs(case)
    got = F.conv2d_backward(x, w, dy, stride, padding, backend=im2col)
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
    expected = oracle.conv2d_backward(x64, w64, dy64, stride, padding)
    for name, g, e in zip(("dx", "dw", "db"), got, expected):
        assert g.shape == e.shape and g.dtype == np.float32, name
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4, err_msg=name)


def test_optional_gradients_are_skipped():
    x, w, _, dy, stride, padding = _inputs(CASES[0])
    dx, dw, db = im2col.conv2d_backward(x, w, dy, stride, padding, need_dx=False, need_db=False)
    assert dx is None and db is None and dw.shape == w.shape


def test_a_model_trains_the_same_on_both_backends():
    x, y = pc.datasets.load_mnist("test")
    x, y = x[:64], y[:64]
    losses = {}
    for backend in (im2col, oracle):
        model = pc.Sequential(pc.Conv2d(1, 4, 3, rng=0), pc.ReLU(), pc.MaxPool2d(2), pc.Flatten(),
                              pc.Linear(4 * 13 * 13, 10, rng=1), backend=backend)
        history = model.fit(x, y, epochs=2, batch_size=16, seed=0, verbose=False)
        losses[backend.name] = history["loss"]
    np.testing.assert_allclose(losses["im2col"], losses["numpy"], rtol=1e-4)


def test_entry_point_names_the_backend_class():
    meta = tomllib.loads((PLUGIN_ROOT / "pyproject.toml").read_text())
    target = meta["project"]["entry-points"]["parconv.backends"]["im2col"]
    module, _, attr = target.partition(":")
    assert getattr(import_module(module), attr) is Im2colBackend


def test_registered_by_name_in_a_fresh_process():
    code = ("import numpy as np, parconv as pc\n"
            "pc.backends.register('im2col', 'parconv_im2col:Im2colBackend')\n"
            "conv = pc.Conv2d(1, 2, 3, backend='im2col')\n"
            "print(conv(np.ones((1, 1, 5, 5))).shape, 'im2col' in pc.backends.registered())\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PLUGIN_ROOT)] + sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["(1,", "2,", "3,", "3)", "True"]
