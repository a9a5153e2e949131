"""Model zoo: the networks people train, as plain :class:`parconv.Sequential` models.

Every builder takes ``num_classes`` and ``in_channels`` (defaults that fit its
usual data: 1x28x28 for ``cnn_mnist`` and ``lenet5``, 3x32x32 for the rest),
plus ``backend`` and ``rng`` (a seed or numpy Generator for the initial
weights; default :func:`parconv.manual_seed`'s generator). The model records
the input shape it was built for as ``model.input_shape``, so
``model.summary()`` needs no argument. The layer structure
and state-dict keys are those of the equivalent ``torch.nn.Sequential``
(a residual block is a module with ``body`` and ``shortcut``), so weights move
between the two with a dict of arrays.

>>> import parconv as pc
>>> model = pc.models.resnet20(backend="numpy", rng=0)
>>> model.num_parameters()
272474
"""

from __future__ import annotations

import numpy as np

from ..layers import (
    AdaptiveAvgPool2d,
    BatchNorm2d,
    Conv2d,
    Dropout,
    Flatten,
    Linear,
    MaxPool2d,
    ReLU,
    Residual,
    _rng,
)
from .._validation import check_int
from ..model import Sequential

__all__ = ["cnn_mnist", "lenet5", "vgg_small", "resnet20", "mobilenet_small", "ZOO", "build"]


def _gen(rng) -> np.random.Generator:
    return _rng(rng)


def _classes_channels(num_classes, in_channels, where):
    return check_int(num_classes, "num_classes", where, 1), check_int(in_channels, "in_channels", where, 1)


def cnn_mnist(filters: int = 32, num_classes: int = 10, in_channels: int = 1, image_size: int = 28,
              kernel_size: int = 3, backend=None, rng=None) -> Sequential:
    """The seed study's CNN: conv KxK x ``filters``, ReLU, maxpool 2, flatten, fully connected.

    Runs as one fused conv+ReLU+maxpool(+classifier head) op on backends that fuse it.
    """
    num_classes, in_channels = _classes_channels(num_classes, in_channels, "cnn_mnist")
    filters = check_int(filters, "filters", "cnn_mnist", 1)
    image_size = check_int(image_size, "image_size", "cnn_mnist", 2)
    kernel_size = check_int(kernel_size, "kernel_size", "cnn_mnist", 1)
    side = (image_size - kernel_size + 1) // 2
    if side < 1:
        raise ValueError(f"cnn_mnist: image_size {image_size} is too small for kernel_size {kernel_size}")
    g = _gen(rng)
    return Sequential(
        Conv2d(in_channels, filters, kernel_size=kernel_size, rng=g), ReLU(), MaxPool2d(2), Flatten(),
        Linear(filters * side * side, num_classes, rng=g), backend=backend,
        input_shape=(in_channels, image_size, image_size))


def lenet5(num_classes: int = 10, in_channels: int = 1, backend=None, rng=None) -> Sequential:
    """LeNet-5 (LeCun et al. 1998) with ReLU and max pooling, for 28x28 input.

    conv 5x5 x 6 (padding 2) -> ReLU -> maxpool 2 -> conv 5x5 x 16 -> ReLU -> maxpool 2 ->
    FC 400-120 -> ReLU -> FC 120-84 -> ReLU -> FC 84-``num_classes``.
    """
    num_classes, in_channels = _classes_channels(num_classes, in_channels, "lenet5")
    g = _gen(rng)
    return Sequential(
        Conv2d(in_channels, 6, 5, padding=2, rng=g), ReLU(), MaxPool2d(2),
        Conv2d(6, 16, 5, rng=g), ReLU(), MaxPool2d(2),
        Flatten(), Linear(16 * 5 * 5, 120, rng=g), ReLU(), Linear(120, 84, rng=g), ReLU(),
        Linear(84, num_classes, rng=g), backend=backend, input_shape=(in_channels, 28, 28))


def _conv_bn_relu(cin, cout, g, stride=1, groups=1, kernel_size=3):
    pad = kernel_size // 2
    return [Conv2d(cin, cout, kernel_size, stride=stride, padding=pad, groups=groups, bias=False, rng=g),
            BatchNorm2d(cout), ReLU()]


def vgg_small(num_classes: int = 10, in_channels: int = 3, input_size: int = 32, backend=None,
              rng=None) -> Sequential:
    """A small VGG: three stages of two conv3x3-BatchNorm-ReLU (32, 64, 128 channels) and a max pool,
    then Dropout(0.5)-FC 256-ReLU-Dropout(0.5)-FC. ``input_size`` is the side of the square input, at least
    8; the poolings floor as PyTorch's do, so 28x28 MNIST images give 3x3 maps to the classifier."""
    num_classes, in_channels = _classes_channels(num_classes, in_channels, "vgg_small")
    input_size = check_int(input_size, "input_size", "vgg_small", 8)
    g = _gen(rng)
    layers, c = [], in_channels
    for width in (32, 64, 128):
        layers += _conv_bn_relu(c, width, g) + _conv_bn_relu(width, width, g) + [MaxPool2d(2)]
        c = width
    side = input_size // 8  # three floor-mode 2x2 poolings: ((n // 2) // 2) // 2
    layers += [Flatten(), Dropout(0.5, rng=g), Linear(128 * side * side, 256, rng=g), ReLU(), Dropout(0.5, rng=g),
               Linear(256, num_classes, rng=g)]
    return Sequential(*layers, backend=backend, input_shape=(in_channels, input_size, input_size))


def _basic_block(cin, cout, stride, g) -> Sequential:
    """He et al.'s basic block: conv3x3-BN-ReLU-conv3x3-BN plus the shortcut, then ReLU.

    The shortcut is the identity, or a 1x1 strided conv + BN where the shape changes.
    """
    body = Sequential(*_conv_bn_relu(cin, cout, g, stride=stride),
                      Conv2d(cout, cout, 3, padding=1, bias=False, rng=g), BatchNorm2d(cout))
    shortcut = None
    if stride != 1 or cin != cout:
        shortcut = Sequential(Conv2d(cin, cout, 1, stride=stride, bias=False, rng=g), BatchNorm2d(cout))
    return Sequential(Residual(body, shortcut), ReLU())


def resnet20(num_classes: int = 10, in_channels: int = 3, backend=None, rng=None) -> Sequential:
    """ResNet-20 for CIFAR (He et al. 2016, section 4.2): conv3x3 x 16, three stages of three basic
    blocks (16, 32, 64 channels; the second and third start with stride 2 and a projection
    shortcut), global average pooling and a fully connected classifier. 0.27 M parameters."""
    num_classes, in_channels = _classes_channels(num_classes, in_channels, "resnet20")
    g = _gen(rng)
    layers = _conv_bn_relu(in_channels, 16, g)
    c = 16
    for width, stride in ((16, 1), (32, 2), (64, 2)):
        for i in range(3):
            layers.append(_basic_block(c, width, stride if i == 0 else 1, g))
            c = width
    layers += [AdaptiveAvgPool2d(1), Flatten(), Linear(64, num_classes, rng=g)]
    return Sequential(*layers, backend=backend, input_shape=(in_channels, 32, 32))


def mobilenet_small(num_classes: int = 10, in_channels: int = 3, backend=None, rng=None) -> Sequential:
    """A small MobileNet (Howard et al. 2017): conv3x3 x 16, then six depthwise-separable blocks
    (depthwise conv3x3-BN-ReLU, pointwise conv1x1-BN-ReLU) widening to 256 channels with three
    stride-2 steps, global average pooling and a fully connected classifier."""
    num_classes, in_channels = _classes_channels(num_classes, in_channels, "mobilenet_small")
    g = _gen(rng)
    layers = _conv_bn_relu(in_channels, 16, g)
    c = 16
    for width, stride in ((32, 1), (64, 2), (64, 1), (128, 2), (128, 1), (256, 2)):
        layers += _conv_bn_relu(c, c, g, stride=stride, groups=c)  # depthwise
        layers += _conv_bn_relu(c, width, g, kernel_size=1)        # pointwise
        c = width
    layers += [AdaptiveAvgPool2d(1), Flatten(), Linear(c, num_classes, rng=g)]
    return Sequential(*layers, backend=backend, input_shape=(in_channels, 32, 32))


#: builder by command-line name, with its default input shape (C, H, W)
ZOO = {
    "cnn-mnist": (cnn_mnist, (1, 28, 28)),
    "lenet5": (lenet5, (1, 28, 28)),
    "vgg-small": (vgg_small, (3, 32, 32)),
    "resnet20": (resnet20, (3, 32, 32)),
    "mobilenet-small": (mobilenet_small, (3, 32, 32)),
}


def build(name: str, input_shape=None, **kwargs) -> Sequential:
    """Build a zoo network by its command-line name for inputs of ``input_shape`` (C, H, W)."""
    if name not in ZOO:
        raise ValueError(f"unknown model {name!r}; the zoo has {sorted(ZOO)}")
    builder, default = ZOO[name]
    c, h, w = default if input_shape is None else tuple(int(s) for s in input_shape)
    kwargs.setdefault("in_channels", c)
    if builder is cnn_mnist:
        kwargs.setdefault("image_size", h)
    if builder is vgg_small:
        kwargs.setdefault("input_size", h)
    model = builder(**kwargs)
    model.input_shape = (kwargs["in_channels"], h, w)
    return model
