"""The PyTorch twin of a parconv model: the same layer tree built from torch.nn (tests only).

Residual blocks become a module with ``body``/``shortcut`` children, so the
twin's state-dict keys are parconv's; ``twin(model)`` copies the weights over
with ``load_state_dict(strict=True)``, which is itself the key check.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import parconv as pc


class TorchResidual(nn.Module):
    """``body(x) + shortcut(x)``; ``shortcut`` None is the identity."""

    def __init__(self, body, shortcut=None):
        super().__init__()
        self.body = body
        self.shortcut = shortcut

    def forward(self, x):
        return self.body(x) + (x if self.shortcut is None else self.shortcut(x))


def _pair(v):
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


def module(layer) -> nn.Module:
    """The torch.nn module equivalent to one parconv layer (containers recursively)."""
    t = type(layer).__name__
    if t == "Sequential":
        return nn.Sequential(*[module(child) for child in layer.layers])
    if t == "Residual":
        return TorchResidual(module(layer.body), None if layer.shortcut is None else module(layer.shortcut))
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
    if t == "Softmax":
        return nn.Softmax(dim=layer.dim)
    simple = {"ReLU": nn.ReLU, "Sigmoid": nn.Sigmoid, "Tanh": nn.Tanh, "Flatten": nn.Flatten, "Identity": nn.Identity}
    return simple[t]()


def twin(model) -> nn.Module:
    """A torch model with ``model``'s structure and weights (float32, same training mode)."""
    torch_model = module(model)
    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in model.state_dict().items()}
    torch_model.load_state_dict(state, strict=True)
    torch_model.train(model.training)
    return torch_model


def to_pc_state(torch_model) -> dict:
    return {k: v.detach().cpu().numpy() for k, v in torch_model.state_dict().items()}


def grads(torch_model) -> dict:
    return {k: p.grad.detach().numpy() for k, p in torch_model.named_parameters() if p.grad is not None}


__all__ = ["TorchResidual", "module", "twin", "to_pc_state", "grads", "pc"]
