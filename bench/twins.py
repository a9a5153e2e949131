"""PyTorch twins of parconv models for the ``nets`` workload: the same layer tree built from torch.nn.

A ``Residual`` becomes a module with ``body``/``shortcut`` children, so the
twin's state-dict keys are parconv's and ``load_state_dict(strict=True)``
checks every key. Imports torch lazily: the suite runs without it.
"""

from __future__ import annotations

import numpy as np


def _residual_class():
    from torch import nn

    class TorchResidual(nn.Module):
        """``body(x) + shortcut(x)``; ``shortcut`` None is the identity."""

        def __init__(self, body, shortcut=None):
            super().__init__()
            self.body = body
            self.shortcut = shortcut

        def forward(self, x):
            return self.body(x) + (x if self.shortcut is None else self.shortcut(x))

    return TorchResidual


def module(layer):
    """The ``torch.nn.Module`` equivalent to one parconv layer (containers recursively)."""
    from torch import nn

    t = type(layer).__name__
    if t == "Sequential":
        return nn.Sequential(*[module(child) for child in layer.layers])
    if t == "Residual":
        return _residual_class()(module(layer.body), None if layer.shortcut is None else module(layer.shortcut))
    if t == "Conv2d":
        return nn.Conv2d(layer.in_channels, layer.out_channels, layer.kernel_size, stride=layer.stride,
                         padding=layer.padding, dilation=layer.dilation, groups=layer.groups,
                         bias=layer.bias is not None)
    if t == "Linear":
        return nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    if t == "MaxPool2d":
        return nn.MaxPool2d(layer.kernel_size, layer.stride, layer.padding)
    if t == "AvgPool2d":
        return nn.AvgPool2d(layer.kernel_size, layer.stride, layer.padding)
    if t == "AdaptiveAvgPool2d":
        return nn.AdaptiveAvgPool2d(layer.output_size)
    if t in ("BatchNorm2d", "BatchNorm1d"):
        return getattr(nn, t)(layer.num_features, eps=layer.eps, momentum=layer.momentum, affine=layer.affine,
                              track_running_stats=layer.track_running_stats)
    if t == "Dropout":
        return nn.Dropout(layer.p)
    if t == "LeakyReLU":
        return nn.LeakyReLU(layer.negative_slope)
    if t == "ELU":
        return nn.ELU(layer.alpha)
    if t == "Softmax":
        return nn.Softmax(dim=layer.dim)
    simple = {"ReLU": nn.ReLU, "Sigmoid": nn.Sigmoid, "Tanh": nn.Tanh, "Flatten": nn.Flatten, "Identity": nn.Identity}
    if t not in simple:
        raise ValueError(f"twins.module: no torch.nn equivalent known for parconv layer {t}")
    return simple[t]()


def twin(model, state: dict | None = None):
    """A torch model with ``model``'s structure, ``state`` (default: ``model``'s) and training mode."""
    import torch

    torch_model = module(model)
    state = model.state_dict() if state is None else state
    torch_model.load_state_dict({k: torch.from_numpy(np.array(v, copy=True)) for k, v in state.items()},
                                strict=True)
    torch_model.train(model.training)
    return torch_model
