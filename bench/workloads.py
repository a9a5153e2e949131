"""The benchmark workloads (DESIGN.md, "Workloads") and their runners.

Every workload yields *cases* (one shape each). A case builds a *runner* for
any implementation: a parconv backend (``numpy``, ``openmp``, ``opencl``, ...)
or PyTorch CPU (``torch``), all computing the same maths from the same inputs
and the same initial weights, so their answers can be compared with the NumPy
oracle and with each other. Runners follow :mod:`harness`'s protocol.

Shapes: N batch, C in-channels, O filters, H, W input, K kernel, F in-features,
G out-features, d the filters of the cnn-mnist sweep.

FLOP counts are 2 per multiply-add of the convolution and linear layers
(elementwise ops, pooling and losses are not counted).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

import parconv as pc
import parconv.functional as PF
import twins  # torch is imported by its functions, when a twin is built
from harness import DEFAULT_THREADS  # noqa: E402

LOCAL_WORKLOADS = ("conv-small", "conv-large", "cnn-mnist", "cnn-5-50-100", "mlp-quadrants", "linear", "nets",
                   "contended")
MPI_WORKLOADS = ("data-parallel", "conv-large-mpi")
MPI_TITLES = {
    "data-parallel": "data-parallel: cnn-mnist training over MPI ranks (gradient-averaging SGD; bench/mpi_bench.py)",
    "conv-large-mpi": "conv-large-mpi: the conv-large layer split over output filters across MPI ranks "
                      "(bench/mpi_bench.py)",
}

CNN_FILTERS = (32, 64, 128, 256)
CNN_BATCHES = (100, 250, 500, 1000)
LR = 0.1


#: the precisions ``--precision`` times here; other names (int8) are skipped with a message
PRECISIONS = ("fp32", "bf16")


@dataclass
class Impl:
    """An implementation: a parconv backend (kind "parconv") or PyTorch (kind "torch") on ``device``,
    in ``precision``: "fp32", or "bf16" (parconv's ``pc.autocast("bf16")``, PyTorch's
    ``torch.autocast("cpu", dtype=torch.bfloat16)``)."""

    name: str
    kind: str
    backend: object = None
    device: str = "cpu"
    precision: str = "fp32"


def precision_scope(kind: str, precision: str):
    """The context a runner of ``kind`` computes in: float32, or bf16 autocast."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if kind == "torch":
        import torch

        return torch.autocast("cpu", dtype=torch.bfloat16)
    return pc.autocast("bf16")


@dataclass
class Case:
    """One shape of one workload."""

    workload: "Workload"
    name: str
    params: dict
    check_params: dict
    flops: float
    items: int | None = None
    item_unit: str = "images"
    amdahl: bool = False
    note: str = ""
    extra: dict = field(default_factory=dict)

    def inputs(self, params: dict) -> dict:
        return self.workload.inputs(params)

    def runner(self, impl: Impl, params: dict, inputs: dict):
        return self.workload.runner(impl, params, inputs)


# ============================================================================ runners
def _np(a):
    return None if a is None else np.asarray(pc.to_numpy(a), dtype=np.float32)


class _Runner:
    """Defaults of the runner protocol.

    ``restartable``: ``run`` changes state that ``prepare`` restores (a training
    step updates the weights), so a timing that calls ``run`` several times in a
    row calls ``prepare`` (untimed) before each call and every call times the
    same step (see ``harness._one_sample``).
    """

    restartable = False

    def prepare(self):
        pass

    def sync(self):
        pass


# ------------------------------------------------------------------------------ conv
class ParconvConv(_Runner):
    """``conv2d`` forward, or forward then backward (dx, dw, db), through :mod:`parconv.functional`."""

    def __init__(self, be, inp, padding, backward):
        self.be, self.padding, self.backward = be, padding, backward
        self.x, self.w, self.b = be.asarray(inp["x"]), be.asarray(inp["w"]), be.asarray(inp["b"])
        self.dy = be.asarray(inp["dy"]) if backward else None
        self.out = None

    def run(self):
        y = PF.conv2d(self.x, self.w, self.b, 1, self.padding, backend=self.be)
        grads = None
        if self.backward:
            grads = PF.conv2d_backward(self.x, self.w, self.dy, 1, self.padding, backend=self.be)
        self.out = (y, grads)

    def sync(self):
        self.be.synchronize()

    def answer(self):
        y, grads = self.out
        ans = {"y": _np(y)}
        if grads is not None:
            ans.update(dx=_np(grads[0]), dw=_np(grads[1]), db=_np(grads[2]))
        return ans


class _TorchRunner(_Runner):
    """PyTorch on ``device`` ("cpu" or "cuda"); on CUDA, in full float32 (no TF32) like parconv."""

    def _setup(self, device):
        import torch

        self.torch, self.device = torch, device
        if device != "cpu":
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False

    def _tensor(self, a, requires_grad=False):
        return self.torch.from_numpy(a).to(self.device).requires_grad_(requires_grad)

    def sync(self):
        if self.device != "cpu":
            self.torch.cuda.synchronize()


def _host(t):
    t = t.detach().cpu()
    return (t.float() if t.dtype == t.new_zeros(0, dtype=t.dtype).bfloat16().dtype else t).numpy()


class TorchConv(_TorchRunner):
    def __init__(self, inp, padding, backward, device="cpu"):
        self._setup(device)
        self.padding, self.backward = padding, backward
        self.x, self.w, self.b = (self._tensor(inp[k], backward) for k in ("x", "w", "b"))
        self.dy = self._tensor(inp["dy"]) if backward else None
        self.out = None

    def run(self):
        F = self.torch.nn.functional
        if not self.backward:
            with self.torch.no_grad():
                self.out = F.conv2d(self.x, self.w, self.b, 1, self.padding)
            return
        self.x.grad = self.w.grad = self.b.grad = None
        y = F.conv2d(self.x, self.w, self.b, 1, self.padding)
        y.backward(self.dy)
        self.out = y

    def answer(self):
        ans = {"y": _host(self.out)}
        if self.backward:
            ans.update(dx=_host(self.x.grad), dw=_host(self.w.grad), db=_host(self.b.grad))
        return ans


# ---------------------------------------------------------------------------- linear
class ParconvLinear(_Runner):
    def __init__(self, be, inp, backward):
        self.be, self.backward = be, backward
        self.x, self.w, self.b = be.asarray(inp["x"]), be.asarray(inp["w"]), be.asarray(inp["b"])
        self.dy = be.asarray(inp["dy"]) if backward else None
        self.out = None

    def run(self):
        y = PF.linear(self.x, self.w, self.b, backend=self.be)
        grads = PF.linear_backward(self.x, self.w, self.dy, backend=self.be) if self.backward else None
        self.out = (y, grads)

    sync = ParconvConv.sync
    answer = ParconvConv.answer


class TorchLinear(_TorchRunner):
    def __init__(self, inp, backward, device="cpu"):
        self._setup(device)
        self.backward = backward
        self.x, self.w, self.b = (self._tensor(inp[k], backward) for k in ("x", "w", "b"))
        self.dy = self._tensor(inp["dy"]) if backward else None
        self.out = None

    def run(self):
        F = self.torch.nn.functional
        if not self.backward:
            with self.torch.no_grad():
                self.out = F.linear(self.x, self.w, self.b)
            return
        self.x.grad = self.w.grad = self.b.grad = None
        y = F.linear(self.x, self.w, self.b)
        y.backward(self.dy)
        self.out = y

    answer = TorchConv.answer


# ------------------------------------------------------------------------- networks
# A network is a list of layer specs: ("conv", C, O, K, padding), ("relu",),
# ("sigmoid",), ("maxpool", K), ("flatten",), ("linear", F, G); the loss is
# "ce" (softmax cross-entropy, int labels) or "bce" (binary cross-entropy).
def layer_label(i: int, spec: tuple) -> str:
    kind = spec[0]
    if kind == "conv":
        return f"{i}:conv{spec[3]}x{spec[3]}x{spec[2]}"
    if kind == "linear":
        return f"{i}:fc{spec[1]}->{spec[2]}"
    if kind == "maxpool":
        return f"{i}:maxpool{spec[1]}"
    return f"{i}:{kind}"


def build_parconv(spec, backend, fuse=True):
    layers = []
    rng = np.random.default_rng(0)
    for s in spec:
        kind = s[0]
        if kind == "conv":
            layers.append(pc.Conv2d(s[1], s[2], kernel_size=s[3], padding=s[4], rng=rng, backend="numpy"))
        elif kind == "linear":
            layers.append(pc.Linear(s[1], s[2], rng=rng, backend="numpy"))
        elif kind == "relu":
            layers.append(pc.ReLU(backend="numpy"))
        elif kind == "sigmoid":
            layers.append(pc.Sigmoid(backend="numpy"))
        elif kind == "maxpool":
            layers.append(pc.MaxPool2d(s[1], backend="numpy"))
        elif kind == "flatten":
            layers.append(pc.Flatten(backend="numpy"))
        else:
            raise ValueError(f"unknown layer spec {s!r}")
    return pc.Sequential(*layers, backend=backend, fuse=fuse)


def build_torch(spec):
    from torch import nn

    mods = []
    for s in spec:
        kind = s[0]
        if kind == "conv":
            mods.append(nn.Conv2d(s[1], s[2], kernel_size=s[3], padding=s[4]))
        elif kind == "linear":
            mods.append(nn.Linear(s[1], s[2]))
        elif kind == "relu":
            mods.append(nn.ReLU())
        elif kind == "sigmoid":
            mods.append(nn.Sigmoid())
        elif kind == "maxpool":
            mods.append(nn.MaxPool2d(s[1]))
        elif kind == "flatten":
            mods.append(nn.Flatten())
        else:
            raise ValueError(f"unknown layer spec {s!r}")
    return nn.Sequential(*mods)


def initial_state(spec, seed: int) -> dict:
    """PyTorch-style initial weights (uniform ±1/sqrt(fan_in)) keyed like ``state_dict``."""
    rng = np.random.default_rng(seed)
    state = {}
    for i, s in enumerate(spec):
        if s[0] == "conv":
            fan_in = s[1] * s[3] * s[3]
            shape = (s[2], s[1], s[3], s[3])
        elif s[0] == "linear":
            fan_in, shape = s[1], (s[2], s[1])
        else:
            continue
        bound = 1.0 / np.sqrt(fan_in)
        state[f"{i}.weight"] = rng.uniform(-bound, bound, shape).astype(np.float32)
        state[f"{i}.bias"] = rng.uniform(-bound, bound, shape[0]).astype(np.float32)
    return state


def network_flops(spec, in_shape) -> float:
    """FLOPs of one training step (forward, backward; the first layer computes no dx)."""
    shape = tuple(in_shape)  # (N, C, H, W) or (N, F)
    total = 0.0
    first_param = True
    for s in spec:
        kind = s[0]
        if kind == "conv":
            N, C, H, W = shape
            K, pad = s[3], s[4]
            P, Q = H + 2 * pad - K + 1, W + 2 * pad - K + 1
            fwd = 2.0 * N * s[2] * P * Q * C * K * K
            total += fwd * (2 if first_param else 3)
            shape = (N, s[2], P, Q)
            first_param = False
        elif kind == "linear":
            N = shape[0]
            fwd = 2.0 * N * s[1] * s[2]
            total += fwd * (2 if first_param else 3)
            shape = (N, s[2])
            first_param = False
        elif kind == "maxpool":
            N, C, H, W = shape
            shape = (N, C, H // s[1], W // s[1])
        elif kind == "flatten":
            shape = (shape[0], int(np.prod(shape[1:])))
    return total


class ParconvTrainStep(_Runner):
    """One SGD training step: forward, loss, backward, update.

    ``prepare`` restores the initial weights, so every timed step is the same
    step and ``answer`` (the loss and each parameter's update) is comparable
    across implementations. With ``per_layer`` the layers run unfused and one
    at a time, and ``breakdown`` returns each layer's forward and backward
    seconds.
    """

    restartable = True

    def __init__(self, be, inp, per_layer=False):
        self.be, self.per_layer = be, per_layer
        self.model = build_parconv(inp["spec"], be, fuse=not per_layer)
        self.model.load_state_dict(inp["state"])
        self.params = self.model.named_parameters()
        self.init = [be.copy(p.data) for _, p in self.params]
        self.opt = pc.optim.SGD(self.model.parameters(), lr=LR)
        self.x = be.asarray(inp["x"])
        if inp["loss"] == "ce":
            self.loss_fn = pc.SoftmaxCrossEntropy()
            self.y = self.loss_fn.prepare_target(inp["y"], inp["y"].shape[0], be)
        else:
            self.loss_fn = pc.BCELoss()
            self.y = self.loss_fn.prepare_target(inp["y"], inp["y"].shape, be)
        self.labels = [layer_label(i, s) for i, s in enumerate(inp["spec"])]
        self.loss = None
        self._times = {}

    def prepare(self):
        for (_, p), p0 in zip(self.params, self.init):
            self.be.copy_into(p.data, p0)
            p.grad = None

    def run(self):
        if self.per_layer:
            return self._run_per_layer()
        out = self.model.forward(self.x)
        self.loss = self.loss_fn.forward(out, self.y, backend=self.be)
        self.model.backward(self.loss_fn.backward())
        self.opt.step()
        self.opt.zero_grad()

    def _run_per_layer(self):
        be, t, clock = self.be, {}, time.perf_counter
        h = self.x
        for label, layer in zip(self.labels, self.model.layers):
            t0 = clock()
            h = layer.forward(h)
            be.synchronize()
            t[f"{label} fwd"] = clock() - t0
        t0 = clock()
        self.loss = self.loss_fn.forward(h, self.y, backend=be)
        dy = self.loss_fn.backward()
        be.synchronize()
        t["loss fwd+bwd"] = clock() - t0
        for i in range(len(self.model.layers) - 1, -1, -1):
            t0 = clock()
            dy = self.model.layers[i].backward(dy, need_dx=i > 0)
            be.synchronize()
            t[f"{self.labels[i]} bwd"] = clock() - t0
        t0 = clock()
        self.opt.step()
        self.opt.zero_grad()
        be.synchronize()
        t["sgd"] = clock() - t0
        self._times = t

    def breakdown(self):
        return dict(self._times) if self.per_layer else None

    def sync(self):
        self.be.synchronize()

    def answer(self):
        ans = {"loss": np.array([self.loss], dtype=np.float64)}
        for (name, p), p0 in zip(self.params, self.init):
            ans[f"update:{name}"] = _np(p.data).astype(np.float64) - _np(p0)
        return ans


class TorchTrainStep(_TorchRunner):
    """PyTorch twin of :class:`ParconvTrainStep` (same network, weights, data, loss and SGD)."""

    restartable = True

    def __init__(self, inp, per_layer=False, device="cpu"):
        self._setup(device)
        torch = self.torch
        self.per_layer = per_layer
        self.model = build_torch(inp["spec"])
        self.model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in inp["state"].items()})
        self.model.to(device)
        self.params = list(self.model.named_parameters())
        self.init = [p.detach().clone() for _, p in self.params]
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.x = self._tensor(inp["x"])
        if inp["loss"] == "ce":
            self.loss_fn = torch.nn.CrossEntropyLoss()
            self.y = self._tensor(inp["y"].astype(np.int64))
        else:
            self.loss_fn = torch.nn.BCELoss()
            self.y = self._tensor(inp["y"].astype(np.float32))
        self.labels = [layer_label(i, s) for i, s in enumerate(inp["spec"])]
        self.loss = None
        self._times = {}

    def prepare(self):
        with self.torch.no_grad():
            for (_, p), p0 in zip(self.params, self.init):
                p.copy_(p0)
        self.opt.zero_grad(set_to_none=True)

    def run(self):
        if self.per_layer:
            return self._run_per_layer()
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        self.loss = loss.item()

    def _run_per_layer(self):
        # each layer's input is detached, so its backward can be timed on its own
        t = {}

        def clock():
            self.sync()  # a device's queued work belongs to the layer that queued it
            return time.perf_counter()

        self.opt.zero_grad(set_to_none=True)
        h, saved = self.x, []
        for i, (label, mod) in enumerate(zip(self.labels, self.model)):
            t0 = clock()
            xi = h.detach().requires_grad_(i > 0)
            h = mod(xi)
            t[f"{label} fwd"] = clock() - t0
            saved.append((xi, h))
        t0 = clock()
        logits = h.detach().requires_grad_(True)
        loss = self.loss_fn(logits, self.y)
        loss.backward()
        t["loss fwd+bwd"] = clock() - t0
        dy = logits.grad
        for i in range(len(saved) - 1, -1, -1):
            xi, out = saved[i]
            t0 = clock()
            out.backward(dy)
            dy = xi.grad
            t[f"{self.labels[i]} bwd"] = clock() - t0
        t0 = clock()
        self.opt.step()
        t["sgd"] = clock() - t0
        self.loss = loss.item()
        self._times = t

    def breakdown(self):
        return dict(self._times) if self.per_layer else None

    def answer(self):
        ans = {"loss": np.array([self.loss], dtype=np.float64)}
        for (name, p), p0 in zip(self.params, self.init):
            ans[f"update:{name}"] = _host(p).astype(np.float64) - _host(p0)
        return ans


# ============================================================================ workloads
class Workload:
    name = ""
    title = ""
    #: whether the NumPy backend is timed at every thread count (else at 1: the serial baseline)
    numpy_all_threads = False
    #: also time each CPU implementation with no thread count set (Config DEFAULT_THREADS)
    times_default_threads = False
    #: whether the NumPy backend is timed at all (else it is only the small-size oracle)
    numpy_timed = True
    per_layer = False
    #: the precisions its runners take (``PRECISIONS``); impls in others are not timed here
    precisions: tuple = ("fp32",)

    def cases(self, quick: bool, opts: dict) -> list[Case]:
        raise NotImplementedError

    def inputs(self, params: dict) -> dict:
        raise NotImplementedError

    def runner(self, impl: Impl, params: dict, inp: dict):
        raise NotImplementedError

    #: upper bounds on the suite's timing options for this workload (``gap``, ``idle_wait``, ``wait_cores``)
    harness_overrides: dict = {}

    def timing_context(self, params: dict):
        """What runs around a case's timed samples (the contended workload's busy neighbours)."""
        return contextlib.nullcontext()


class ConvWorkload(Workload):
    """One 3x3 convolution, 64 filters, padding 1, on 128x32x32 inputs (batch 1 or 64)."""

    def __init__(self, name, batch, title):
        self.name, self.batch, self.title = name, batch, title

    def cases(self, quick, opts):
        if quick:
            p = dict(N=min(self.batch, 2), C=8, H=8, W=8, O=8, K=3, padding=1)
            chk = dict(p)
        else:
            p = dict(N=self.batch, C=128, H=32, W=32, O=64, K=3, padding=1)
            chk = dict(N=min(self.batch, 4), C=16, H=12, W=12, O=8, K=3, padding=1)
        fwd = 2.0 * p["N"] * p["O"] * p["H"] * p["W"] * p["C"] * p["K"] ** 2  # padding 1 keeps P = H
        shape = f"x {p['N']}x{p['C']}x{p['H']}x{p['W']}, {p['O']} filters {p['K']}x{p['K']}"
        return [
            Case(self, "forward", dict(p, backward=False), dict(chk, backward=False), fwd, p["N"], note=shape),
            Case(self, "forward+backward", dict(p, backward=True), dict(chk, backward=True), 3 * fwd, p["N"],
                 note=shape),
        ]

    def inputs(self, p):
        rng = np.random.default_rng(1)
        scale = 1.0 / np.sqrt(p["C"] * p["K"] ** 2)
        arrays = {
            "x": rng.standard_normal((p["N"], p["C"], p["H"], p["W"])),
            "w": rng.standard_normal((p["O"], p["C"], p["K"], p["K"])) * scale,
            "b": rng.standard_normal(p["O"]),
            "dy": rng.standard_normal((p["N"], p["O"], p["H"], p["W"])),
        }
        return {k: v.astype(np.float32) for k, v in arrays.items()}

    def runner(self, impl, p, inp):
        if impl.kind == "torch":
            return TorchConv(inp, p["padding"], p["backward"], impl.device)
        return ParconvConv(impl.backend, inp, p["padding"], p["backward"])


class LinearWorkload(Workload):
    """``y = x @ w.T + b`` (and its backward) against NumPy matmul at equal threads."""

    name = "linear"
    title = "linear layer vs NumPy matmul"
    numpy_all_threads = True

    def cases(self, quick, opts):
        if quick:
            big, small = dict(N=8, F=16, G=8), dict(N=2, F=4, G=3)
        else:
            big, small = dict(N=512, F=2048, G=1024), dict(N=16, F=64, G=32)
        chk = dict(big, N=8)
        out = []
        for label, p, c, bwd in (("forward", big, chk, False), ("forward+backward", big, chk, True),
                                 ("forward, small", small, small, False)):
            fl = 2.0 * p["N"] * p["F"] * p["G"] * (3 if bwd else 1)
            out.append(Case(self, label, dict(p, backward=bwd), dict(c, backward=bwd), fl, p["N"], "rows",
                            note=f"x {p['N']}x{p['F']}, w {p['G']}x{p['F']}"))
        return out

    def inputs(self, p):
        rng = np.random.default_rng(2)
        arrays = {
            "x": rng.standard_normal((p["N"], p["F"])),
            "w": rng.standard_normal((p["G"], p["F"])) / np.sqrt(p["F"]),
            "b": rng.standard_normal(p["G"]),
            "dy": rng.standard_normal((p["N"], p["G"])),
        }
        return {k: v.astype(np.float32) for k, v in arrays.items()}

    def runner(self, impl, p, inp):
        if impl.kind == "torch":
            return TorchLinear(inp, p["backward"], impl.device)
        return ParconvLinear(impl.backend, inp, p["backward"])


_MNIST = None


def mnist_batch(n: int):
    """The first ``n`` images of the bundled real MNIST sample, standardised, and their labels."""
    global _MNIST
    if _MNIST is None:
        x, y = pc.datasets.load_mnist("test")
        x = (x - x.mean()) / x.std()
        _MNIST = (np.ascontiguousarray(x, dtype=np.float32), y.astype(np.int32))
    x, y = _MNIST
    if n > x.shape[0]:
        raise ValueError(f"cnn-mnist: batch {n} is larger than the {x.shape[0]} bundled images")
    return x[:n], y[:n]


class TrainingWorkload(Workload):
    """A training step of a network (forward, loss, backward, SGD update)."""

    def inputs(self, p):
        spec = self.spec(p)
        if p["data"] == "mnist":
            x, y = mnist_batch(p["N"])
        else:
            x, y = pc.datasets.quadrants(p["N"], seed=3)
        return {"spec": spec, "loss": p["loss"], "x": x, "y": y, "state": initial_state(spec, 4)}

    def runner(self, impl, p, inp):
        if impl.kind == "torch":
            return TorchTrainStep(inp, per_layer=self.per_layer, device=impl.device)
        return ParconvTrainStep(impl.backend, inp, per_layer=self.per_layer)

    def _case(self, name, p, chk, amdahl=False, note=""):
        in_shape = (p["N"], 1, 28, 28) if p["data"] == "mnist" else (p["N"], 2)
        return Case(self, name, p, chk, network_flops(self.spec(p), in_shape), p["N"],
                    "images" if p["data"] == "mnist" else "samples", amdahl=amdahl, note=note)


class CnnMnist(TrainingWorkload):
    """conv 3x3 x d, ReLU, maxpool 2, FC 169d -> 10, softmax cross-entropy, SGD lr 0.1 on real MNIST."""

    name = "cnn-mnist"
    title = "cnn-mnist training step (filter and batch-size sweep)"

    @staticmethod
    def spec(p):
        d = p["d"]
        return [("conv", 1, d, 3, 0), ("relu",), ("maxpool", 2), ("flatten",), ("linear", 169 * d, 10)]

    def cases(self, quick, opts):
        filters = opts.get("filters") or ((4, 8) if quick else CNN_FILTERS)
        batches = opts.get("batches") or ((8, 16) if quick else CNN_BATCHES)
        amdahl = {(filters[0], batches[0]), (filters[-1], batches[-1])}
        out = []
        for d in filters:
            for n in batches:
                p = dict(d=d, N=n, data="mnist", loss="ce")
                out.append(self._case(f"d={d} batch={n}", p, dict(p, N=min(n, 8)), amdahl=(d, n) in amdahl))
        return out


class Cnn55010(TrainingWorkload):
    """conv 5x5 x 50, ReLU, FC 100, ReLU, FC 10 on 28x28 MNIST: per-layer forward/backward times."""

    name = "cnn-5-50-100"
    title = "cnn-5-50-100 per-layer times"
    per_layer = True

    @staticmethod
    def spec(p):
        o, h = p["filters"], p["hidden"]
        return [("conv", 1, o, 5, 0), ("relu",), ("flatten",), ("linear", o * 24 * 24, h), ("relu",),
                ("linear", h, 10)]

    def cases(self, quick, opts):
        p = dict(filters=6, hidden=12, N=4, data="mnist", loss="ce") if quick else \
            dict(filters=50, hidden=100, N=100, data="mnist", loss="ce")
        return [self._case(f"batch={p['N']}", p, dict(p, N=min(p["N"], 4)), amdahl=True,
                           note=f"conv 5x5x{p['filters']} -> FC {p['hidden']} -> FC 10")]


class MlpQuadrants(TrainingWorkload):
    """Linear(2, H), ReLU, Linear(H, H), ReLU, Linear(H, 1), Sigmoid, BCE on the quadrants set."""

    name = "mlp-quadrants"
    title = "mlp-quadrants training step"

    @staticmethod
    def spec(p):
        h = p["hidden"]
        return [("linear", 2, h), ("relu",), ("linear", h, h), ("relu",), ("linear", h, 1), ("sigmoid",)]

    def cases(self, quick, opts):
        sizes = ((16, 32), (4, 8)) if quick else ((512, 2048), (32, 64))
        out = []
        for k, (h, n) in enumerate(sizes):
            p = dict(hidden=h, N=n, data="quadrants", loss="bce")
            out.append(self._case(f"hidden={h} batch={n}" + (", small" if k else ""), p, dict(p, N=min(n, 16)),
                                  amdahl=k == 0, note="2 -> H -> H -> 1"))
        return out


# ------------------------------------------------------------------------------ nets
# The zoo networks (pc.models.ZOO) and an MLP 784-512-512-10, each against a
# PyTorch twin with the same weights (bench/twins.py).
NETS_LR, NETS_MOMENTUM = 0.01, 0.9
NETS_TRAIN_BATCH = 128
#: the training step's batches in the nets table (NETS_TRAIN_BATCH carries the targets)
NETS_TRAIN_BATCHES = (32, NETS_TRAIN_BATCH)
NETS_INFER_BATCHES = (1, 64)
MLP_BATCHES = (1, 64, 256)
MLP_SIZES = (784, 512, 512, 10)
#: inference logits must agree this closely (normalised max error); a training step's loss,
#: gradients and weights within harness.DEFAULT_TOL
NETS_INFER_TOL = 1e-4
#: a training step at the timed size, against PyTorch: the loss and weights as above, the gradients
#: looser. At batch 128 the gradient sums of the deeper BatchNorm networks cancel (the softmax
#: gradient sums to zero per sample), and PyTorch's float32 CPU gradients then stray from a float64
#: computation by more than parconv's do; the small-size check against the oracle keeps 1e-3.
NETS_TRAIN_FULL_TOL = {"loss": 1e-3, "weights": 1e-3, "grads": 5e-2}
#: the same below batch 128: resnet20's first-layer weight gradient at batch 32 (every position's
#: terms nearly cancel behind the BatchNorm) is 8e-2 of the largest gradient away from PyTorch's,
#: which agrees with a float64 PyTorch step to 4e-6; docs/benchmarks.md gives the figures
NETS_TRAIN_FULL_TOL_SMALL = {"loss": 1e-3, "weights": 1e-3, "grads": 1.5e-1}
#: a bf16 answer against a float32 one (the full-size check) and PyTorch's bf16 autocast against the NumPy
#: model of parconv's bf16 (the small-size check; PyTorch also rounds each layer's output to bf16):
#: bf16 keeps 8 bits, 4e-3 of a value, and a network sums many such errors. A training step is checked by
#: its loss and the weights after it (which carry lr times the gradients' error), not by the gradients:
#: behind a BatchNorm the first layers' gradient terms cancel (see NETS_TRAIN_FULL_TOL_SMALL: float32's own
#: rounding moves them by 8e-2 of the largest), so bf16's rounding leaves their sums at its noise level,
#: in PyTorch's autocast as in parconv (both differ from float32 there by 0.6-1.3 of the largest gradient).
NETS_BF16_INFER_TOL = 5e-2
#: parconv's bf16 inference against the NumPy model of its own rounding: a sum in another order can land
#: an activation on the other side of a bf16 rounding boundary, one 2^-9 step that the layers after it
#: carry (resnet20 on the native kernels: 1.6e-4); float32 in place of bf16 misses it by 1e-2
NETS_BF16_MODEL_INFER_TOL = 1e-3
NETS_BF16_TRAIN_TOL = {"loss": 3e-2, "weights": 5e-2, "grads": 1e3}  # grads: compared, never failed


def build_net(net: str, backend, seed: int = 5, size: int | None = None):
    """``(model, input shape without the batch)`` of a zoo network or ``"mlp"`` on ``backend``.

    ``size`` shrinks the images of the 3x32x32 networks to ``size`` x ``size`` (a multiple of 8;
    quick mode); the MNIST-shaped networks keep 28x28.
    """
    if net == "mlp":
        layers = []
        for i, (f, g) in enumerate(zip(MLP_SIZES[:-1], MLP_SIZES[1:])):
            layers += [pc.Linear(f, g, rng=seed + i, backend="numpy")] + ([pc.ReLU(backend="numpy")]
                                                                       if i < len(MLP_SIZES) - 2 else [])
        return pc.Sequential(*layers, backend=backend), (MLP_SIZES[0],)
    builder, shape = pc.models.ZOO[net]
    shape = tuple(shape)
    if size is None or shape[1:] == (28, 28):
        return builder(backend=backend, rng=seed), shape
    extra = {"input_size": size} if net == "vgg-small" else {}
    return builder(backend=backend, rng=seed, **extra), (shape[0], size, size)


def _dropouts(model) -> list:
    return [m for m in model.modules() if type(m).__name__ == "Dropout"]


class ParconvNet(_Runner):
    """A parconv network: a training step (forward, softmax cross-entropy, backward, SGD with momentum)
    or, with ``inp["mode"] == "infer"``, an eval-mode forward pass.

    A training runner takes one step when built, so the optimizer's momentum
    buffers exist, and keeps that state: ``prepare`` restores the parameters,
    buffers (BatchNorm's running statistics) and momentum buffers, so every
    timed call is the same steady-state step. Until :meth:`answer` has been
    called (the suite checks the first answer and times later steps), Dropout
    runs with ``p = 0`` (two generators' masks cannot agree) and each step
    keeps a host copy of the gradients. The answer is the loss, the weights
    after the step and the gradients (an update smaller than a weight's float32
    spacing is lost in the weights). Weights and gradients are one key each, so
    their error is relative to the network's largest: a BatchNorm weight whose
    output feeds another BatchNorm has a gradient that nearly cancels (the next
    BatchNorm undoes its scale), about 1e-3 of the others, and float32 sums
    keep few of its digits in either framework; a BatchNorm bias starts at 0,
    so on its own it would compare the update only.
    """

    def __init__(self, be, inp, precision="fp32"):
        self.be, self.mode = be, inp["mode"]
        self.precision = precision
        self.restartable = self.mode == "train"
        self.model, _ = build_net(inp["net"], be, size=inp["size"])
        self.model.load_state_dict(inp["state"])
        self.x = be.asarray(inp["x"])
        self.out = self.loss = self._p = None
        if self.mode == "infer":
            self.model.eval()
            return
        self.model.train()
        self._p = [(d, d.p) for d in _dropouts(self.model)]
        for d, _ in self._p:
            d.p = 0.0
        self.loss_fn = pc.SoftmaxCrossEntropy()
        self.y = self.loss_fn.prepare_target(inp["y"], inp["y"].shape[0], be)
        self.opt = pc.optim.SGD(self.model.parameters(), lr=NETS_LR, momentum=NETS_MOMENTUM)
        self.params = self.model.named_parameters()
        self.run()
        self.init = [be.copy(p.data) for _, p in self.params]
        self.init_buffers = [b.copy() if isinstance(b, np.ndarray) else be.copy(b) for b in self.model.buffers()]
        self.init_opt = self.opt.state_dict()

    def prepare(self):
        if self.mode == "infer":
            return
        for (_, p), p0 in zip(self.params, self.init):
            self.be.copy_into(p.data, p0)
            p.grad = None
        for b, b0 in zip(self.model.buffers(), self.init_buffers):
            if isinstance(b, np.ndarray) and b.dtype != np.float32:
                np.copyto(b, b0)  # host counters (num_batches_tracked)
            else:
                self.be.copy_into(b, b0)
        self.opt.load_state_dict(self.init_opt)

    def run(self):
        with precision_scope("parconv", self.precision):
            self._run()

    def _run(self):
        if self.mode == "infer":
            with pc.no_grad():  # as predict() and the twin's inference_mode: nothing is kept for backward
                self.out = self.model.forward(self.x)
            return
        out = self.model.forward(self.x)
        self.loss = self.loss_fn.forward(out, self.y, backend=self.be)
        self.model.backward(self.loss_fn.backward())
        if self._p is not None:  # not yet checked: keep the gradients for answer()
            self.grads = {name: _np(p.grad) for name, p in self.params}
        self.opt.step()
        self.opt.zero_grad()

    def sync(self):
        self.be.synchronize()

    def answer(self):
        if self.mode == "infer":
            return {"logits": _np(self.out)}
        ans = {"loss": np.array([self.loss], dtype=np.float64)}
        ans["grads"] = np.concatenate([g.ravel() for g in self.grads.values()])
        ans["weights"] = np.concatenate([_np(p.data).ravel() for _, p in self.params])
        for d, p in self._p or ():
            d.p = p
        self._p = None
        return ans


class TorchNet(_TorchRunner):
    """PyTorch twin of :class:`ParconvNet`: the same layers and weights (``twins.twin``), loss and SGD."""

    def __init__(self, inp, device="cpu", precision="fp32"):
        self._setup(device)
        torch = self.torch
        self.mode = inp["mode"]
        self.precision = precision
        self.restartable = self.mode == "train"
        template, _ = build_net(inp["net"], "numpy", size=inp["size"])
        template.train(self.mode == "train")
        self.model = twins.twin(template, inp["state"]).to(device)
        self.x = self._tensor(inp["x"])
        self.out = self.loss = None
        if self.mode == "infer":
            return
        self._p = [(m, m.p) for m in self.model.modules() if isinstance(m, torch.nn.Dropout)]
        for m, _ in self._p:
            m.p = 0.0
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.y = self._tensor(inp["y"].astype(np.int64))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=NETS_LR, momentum=NETS_MOMENTUM)
        self.params = list(self.model.named_parameters())
        self.run()
        self.init = [p.detach().clone() for _, p in self.params]
        self.init_buffers = [b.detach().clone() for b in self.model.buffers()]
        self.init_opt = _clone_state(torch, self.opt.state_dict())

    def prepare(self):
        if self.mode == "infer":
            return
        with self.torch.no_grad():
            for (_, p), p0 in zip(self.params, self.init):
                p.copy_(p0)
            for b, b0 in zip(self.model.buffers(), self.init_buffers):
                b.copy_(b0)
        self.opt.load_state_dict(_clone_state(self.torch, self.init_opt))
        self.opt.zero_grad(set_to_none=True)

    def run(self):
        if self.mode == "infer":
            with self.torch.inference_mode(), precision_scope("torch", self.precision):
                self.out = self.model(self.x)
            return
        self.opt.zero_grad(set_to_none=True)
        with precision_scope("torch", self.precision):  # the forward and loss, as PyTorch's AMP recipe
            loss = self.loss_fn(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        self.loss = loss.item()

    def answer(self):
        if self.mode == "infer":
            return {"logits": _host(self.out)}
        ans = {"loss": np.array([self.loss], dtype=np.float64)}
        ans["grads"] = np.concatenate([_host(p.grad).ravel() for _, p in self.params])
        ans["weights"] = np.concatenate([_host(p).ravel() for _, p in self.params])
        for m, p in self._p:
            m.p = p
        self._p = []
        return ans


def _clone_state(torch, state):
    """A deep copy of an optimizer state dict (its tensors cloned)."""
    if isinstance(state, dict):
        return {k: _clone_state(torch, v) for k, v in state.items()}
    if isinstance(state, list):
        return [_clone_state(torch, v) for v in state]
    return state.clone() if isinstance(state, torch.Tensor) else state


class Nets(Workload):
    """The zoo networks and an MLP against PyTorch twins: training steps and inference."""

    name = "nets"
    title = ("nets: the zoo networks' training step (SGD with momentum) at batch 32 and 128 and inference at "
             "batch 1 and 64, and an MLP 784-512-512-10 training step and inference, against PyTorch twins with the "
             "same weights")
    numpy_timed = False
    precisions = PRECISIONS

    def cases(self, quick, opts):
        train_ns, infer_ns, mlp_ns, size = ((4,), (1, 2), (1, 4), 16) if quick else \
            (NETS_TRAIN_BATCHES, NETS_INFER_BATCHES, MLP_BATCHES, None)
        out = []
        for net in pc.models.ZOO:
            out += [self._case(net, "train", n, size) for n in train_ns]
            out += [self._case(net, "infer", n, size) for n in infer_ns]
        out += [self._case("mlp", mode, n, size) for mode in ("train", "infer") for n in mlp_ns]
        return out

    def _case(self, net, mode, n, size=None):
        model, shape = build_net(net, "numpy", size=size)
        macs = model.macs((n,) + shape)
        # a training step: forward, dx and dw of every layer (~3x the forward's multiply-adds)
        flops = 2.0 * macs * (3 if mode == "train" else 1)
        p = dict(net=net, mode=mode, N=n, size=size)
        chk = dict(p, N=min(n, 2))
        extra = {"tol": NETS_INFER_TOL} if mode == "infer" else \
            {"full_tol": NETS_TRAIN_FULL_TOL if n >= NETS_TRAIN_BATCH or net == "mlp" else NETS_TRAIN_FULL_TOL_SMALL}
        extra["bf16_tol"] = NETS_BF16_INFER_TOL if mode == "infer" else NETS_BF16_TRAIN_TOL
        extra["bf16_model_tol"] = NETS_BF16_MODEL_INFER_TOL if mode == "infer" else NETS_BF16_TRAIN_TOL
        return Case(self, f"{net} {'training step' if mode == 'train' else 'inference'} batch={n}", p, chk,
                    flops, n, "samples" if net == "mlp" else "images",
                    note=f"{net} input {'x'.join(map(str, shape))}", extra=extra)

    def inputs(self, p):
        model, shape = build_net(p["net"], "numpy", size=p["size"])
        n = p["N"]
        if shape in ((1, 28, 28), (784,)):  # the MNIST-shaped networks see real MNIST
            x, y = mnist_batch(n)
            x = x.reshape((n,) + shape)
        else:
            rng = np.random.default_rng(6)
            x = rng.standard_normal((n,) + shape).astype(np.float32)
            y = rng.integers(0, 10, n).astype(np.int32)
        return {"net": p["net"], "mode": p["mode"], "size": p["size"], "x": np.ascontiguousarray(x), "y": y,
                "state": model.state_dict()}

    def runner(self, impl, p, inp):
        if impl.kind == "torch":
            return TorchNet(inp, impl.device, impl.precision)
        return ParconvNet(impl.backend, inp, impl.precision)


# ------------------------------------------------------------------------- contended
#: the contended workload's cases: (network, batch) training steps, each with 0, 1 and 2 busy neighbours
CONTENDED_NETS = (("cnn-mnist", 100), ("resnet20", 32))
CONTENDED_BUSY = (0, 1, 2)
#: a busy neighbour stops by itself after this many seconds even if the suite is killed
CONTENDED_BOUND_S = 900.0


@contextlib.contextmanager
def busy_neighbours(k: int, bound_s: float = CONTENDED_BOUND_S):
    """``k`` other processes spinning in pure Python while the block runs, as on a shared machine.

    Each stops by itself after ``bound_s`` seconds; all are killed when the block ends.
    """
    code = f"import time\nend = time.monotonic() + {bound_s}\nwhile time.monotonic() < end:\n    pass\n"
    procs = []
    try:
        for _ in range(k):
            procs.append(subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL))
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


class Contended(Nets):
    """Training steps with k busy processes beside them: a CI runner, a shared server, co-tenants.

    Each case is a zoo network's training step (the nets workload's runners, checked the same way)
    timed while ``k`` pure-Python loops run in other processes. parconv at every thread count
    (the default is the core count) and PyTorch are timed interleaved under the same load, and
    without the suite's wait for idle threads before each sample: a user's training loop does
    not wait either.
    """

    name = "contended"
    precisions = ("fp32",)
    title = ("contended: cnn-mnist batch 100 and resnet20 batch 32 training steps with 0, 1 and 2 busy "
             "processes (pure-Python loops) beside them; parconv at 1 and 2 threads and at its default "
             "(no count set: every core, each parallel region's team capped at the cores the neighbours "
             "leave free) against PyTorch (at 1, 2 and its default) under the same load")
    times_default_threads = True
    # no wait for idle threads or for free cores (the neighbours take them on purpose): with
    # --wait-cores the core probe is still recorded before each multi-threaded sample
    harness_overrides = {"idle_wait": 0.0, "gap": 0.0, "wait_cores": 0.001}

    def cases(self, quick, opts):
        nets, busy, size = ((("cnn-mnist", 4), ("resnet20", 2)), (0, 1), 16) if quick else \
            (CONTENDED_NETS, CONTENDED_BUSY, None)
        out = []
        for net, n in nets:
            for k in busy:
                c = self._case(net, "train", n, size)
                c.name = f"{c.name}, {k} busy"
                c.params = dict(c.params, busy=k, default_threads=DEFAULT_THREADS)
                c.note = f"{c.note}; default: {pc._config._cpu_count()} threads, teams capped under load"
                out.append(c)
        return out

    def timing_context(self, params):
        return busy_neighbours(params.get("busy", 0))


WORKLOADS = {
    "conv-small": ConvWorkload("conv-small", 1, "conv-small: one conv layer, batch 1"),
    "conv-large": ConvWorkload("conv-large", 64, "conv-large: one conv layer, batch 64"),
    "cnn-mnist": CnnMnist(),
    "cnn-5-50-100": Cnn55010(),
    "mlp-quadrants": MlpQuadrants(),
    "linear": LinearWorkload(),
    "nets": Nets(),
    "contended": Contended(),
}
