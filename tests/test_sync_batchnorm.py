"""SyncBatchNorm on one process: exactly BatchNorm (without MPI, and without importing mpi4py), its
conversion of a model, save/load, fusion and ONNX export. The reductions over ranks are tested under
``mpiexec`` in ``test_distributed.py``."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import parconv as pc

BACKENDS = pc.available_backends()


def bn_and_sync_bn(shape, backend, momentum=0.1, affine=True):
    """A BatchNorm and a SyncBatchNorm with the same state (also used by the MPI tests)."""
    C = shape[1]
    ref = (pc.BatchNorm2d if len(shape) == 4 else pc.BatchNorm1d)(C, momentum=momentum, affine=affine,
                                                                   backend=backend)
    sync = pc.SyncBatchNorm(C, momentum=momentum, affine=affine, backend=backend)
    if affine:
        rng = np.random.default_rng(C)
        ref.load_state_dict(dict(ref.state_dict(), weight=rng.standard_normal(C).astype(np.float32),
                                 bias=rng.standard_normal(C).astype(np.float32)))
    sync.load_state_dict(ref.state_dict())
    return ref, sync


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape, relu, momentum, affine", [
    ((4, 3, 5, 5), False, 0.1, True), ((4, 3, 5, 5), True, 0.1, True), ((6, 4), False, None, False),
    ((3, 2, 7), False, 0.5, True)])
def test_one_process_is_exactly_batchnorm(backend, shape, relu, momentum, affine):
    ref, sync = bn_and_sync_bn(shape, backend, momentum, affine)
    rng = np.random.default_rng(0)
    for _ in range(2):
        x = (rng.standard_normal(shape) * 3 + 1).astype(np.float32)
        dy = rng.standard_normal(shape).astype(np.float32)
        np.testing.assert_array_equal(pc.to_numpy(sync.forward(x, relu=relu)), pc.to_numpy(ref.forward(x, relu=relu)))
        np.testing.assert_array_equal(pc.to_numpy(sync.backward(dy)), pc.to_numpy(ref.backward(dy)))
        if affine:
            np.testing.assert_array_equal(pc.to_numpy(sync.weight.grad), pc.to_numpy(ref.weight.grad))
    for k, v in ref.state_dict().items():
        np.testing.assert_array_equal(sync.state_dict()[k], v, err_msg=k)
    sync.eval()
    ref.eval()
    np.testing.assert_array_equal(pc.to_numpy(sync(x)), pc.to_numpy(ref(x)))


def test_checks_its_arguments():
    with pytest.raises(TypeError, match="SyncBatchNorm: comm must be an mpi4py communicator.*got str"):
        pc.SyncBatchNorm(3, comm="world")
    with pytest.raises(ValueError, match="num_features"):
        pc.SyncBatchNorm(0)
    with pytest.raises(ValueError, match=r"x must be 2-D \(N, C\), 3-D \(N, C, L\) or 4-D"):
        pc.SyncBatchNorm(3, backend="numpy")(np.zeros((2, 3, 1, 1, 1), np.float32))
    with pytest.raises(TypeError, match="module must be a parconv layer or Sequential, got dict"):
        pc.SyncBatchNorm.convert_sync_batchnorm({})


@pytest.mark.parametrize("backend", BACKENDS)
def test_convert_sync_batchnorm_replaces_every_batchnorm_and_trains_the_same(backend, tmp_path):
    """resnet20's 21 BatchNorm2d layers (inside residual bodies and shortcuts too) become SyncBatchNorm that
    share their parameters and buffers and keep their mode; training, the fused eval path, save and load give
    the same numbers as the original."""
    x = np.random.default_rng(1).standard_normal((4, 3, 32, 32)).astype(np.float32)
    y = np.arange(4) % 10
    ref = pc.models.resnet20(backend=backend, rng=0)
    model = pc.models.resnet20(backend=backend, rng=0)
    opt = pc.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # built before the conversion
    model.layers[1].eval()
    converted = pc.SyncBatchNorm.convert_sync_batchnorm(model)
    assert converted is model
    kinds = [type(m).__name__ for m in model.modules()]
    assert kinds.count("SyncBatchNorm") == 21 and "BatchNorm2d" not in kinds
    assert model.layers[1].training is False and model.layers[4].layers[0].body.layers[1].training is True
    model.layers[1].train()
    assert len(opt.params) == len(model.parameters())
    assert all(a is b for a, b in zip(opt.params, model.parameters()))
    for net, o in ((ref, pc.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)), (model, opt)):
        net.fit(x, y, epochs=2, batch_size=4, optimizer=o, verbose=False, seed=0)
    for k, v in ref.state_dict().items():
        np.testing.assert_allclose(model.state_dict()[k], v, rtol=1e-6, atol=1e-7, err_msg=k)
    np.testing.assert_allclose(model.predict(x), ref.predict(x), rtol=1e-5, atol=1e-6)
    model.save(tmp_path / "sync.npz")
    loaded = pc.load(tmp_path / "sync.npz", backend=backend)
    assert type(loaded.layers[1]) is pc.SyncBatchNorm
    np.testing.assert_allclose(loaded.predict(x), ref.predict(x), rtol=1e-5, atol=1e-6)
    single = pc.SyncBatchNorm.convert_sync_batchnorm(pc.BatchNorm1d(3))
    assert type(single) is pc.SyncBatchNorm and single.num_features == 3


def test_works_without_mpi4py():
    """Outside MPI the layer never imports mpi4py: it is BatchNorm."""
    code = ("import sys, numpy as np, parconv as pc\n"
            "m = pc.SyncBatchNorm.convert_sync_batchnorm(pc.models.resnet20(backend='numpy', rng=0))\n"
            "m.fit(np.zeros((2, 3, 32, 32), np.float32), np.zeros(2, int), epochs=1, batch_size=2, verbose=False)\n"
            "assert 'mpi4py' not in sys.modules\n"
            "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPIR_", "OMPI_"))}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(pc.__file__)) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout + res.stderr


def test_onnx_export_of_a_converted_model(tmp_path):
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    model = pc.SyncBatchNorm.convert_sync_batchnorm(
        pc.Sequential(pc.Conv2d(1, 3, 3, rng=0), pc.BatchNorm2d(3), pc.ReLU(), pc.Flatten(),
                      pc.Linear(3 * 4 * 4, 4, rng=1), pc.BatchNorm1d(4), backend="numpy"))
    x = np.random.default_rng(2).standard_normal((5, 1, 6, 6)).astype(np.float32)
    model.fit(x, np.arange(5) % 4, epochs=1, batch_size=5, verbose=False)
    model.eval()
    pc.onnx.export(model, tmp_path / "m.onnx", (1, 1, 6, 6))
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"))
    out = sess.run(None, {sess.get_inputs()[0].name: x})[0]
    np.testing.assert_allclose(out, model.predict(x), rtol=1e-4, atol=1e-5)
