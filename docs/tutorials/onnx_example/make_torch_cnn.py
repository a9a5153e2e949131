"""Train a small residual CNN in PyTorch on the bundled MNIST sample and export it to ONNX.

Writes ``torch_cnn.onnx`` next to this script with PyTorch's default
(``torch.export``-based) exporter and a dynamic batch dimension; the ONNX
tutorial loads that file into parconv. Needs torch and onnxscript::

    python docs/tutorials/onnx_example/make_torch_cnn.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

import parconv as pc


class Residual(nn.Module):
    """``body(x) + x``: parconv's ``Residual(body)``."""

    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x):
        return self.body(x) + x


def build() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        Residual(nn.Sequential(nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                               nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16))),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )


def main() -> None:
    torch.manual_seed(0)
    x, y = pc.datasets.load_mnist("test")
    order = np.random.default_rng(1234).permutation(len(x))  # the split of the tutorials
    train = order[:8000]
    mean, std = x[train].mean(), x[train].std()
    xt, yt = torch.from_numpy((x[train] - mean) / std), torch.from_numpy(y[train].astype(np.int64))
    net = build()
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for epoch in range(3):
        perm = torch.randperm(len(xt))
        for i in range(0, len(xt), 64):
            idx = perm[i:i + 64]
            loss = nn.functional.cross_entropy(net(xt[idx]), yt[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"epoch {epoch + 1}: last batch loss {loss.item():.3f}")
    # BatchNorm's running statistics lag the weights that Adam moves fast: recompute them over the
    # training set with the final weights (a cumulative average), as the eval-mode export uses them
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.reset_running_stats()
                m.momentum = None
        for i in range(0, len(xt), 500):
            net(xt[i:i + 500])
    net.eval()
    test = order[8000:]
    with torch.no_grad():
        pred = net(torch.from_numpy((x[test] - mean) / std)).argmax(1).numpy()
    print(f"PyTorch test accuracy: {(pred == y[test]).mean():.2%}")
    out = Path(__file__).with_name("torch_cnn.onnx")
    torch.onnx.export(net, (xt[:2],), str(out), dynamic_shapes=({0: torch.export.Dim("batch")},),
                      external_data=False)
    print(f"wrote {out} ({out.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
