#!/usr/bin/env python
"""Time one epoch of the augmented DataLoader (the CIFAR-10 training recipe's input pipeline).

Random 3x32x32 float32 images go through ``RandomCrop(32, padding=4)``,
``RandomHorizontalFlip()`` and ``Normalize`` on the loader's worker thread;
the consumer only takes the batches, so the wall time is the pipeline's own
cost. The CPU time counts every thread of the process, which is what the
pipeline takes away from training on the same cores.

Examples
--------
::

    python bench/data_pipeline.py                      # 50,000 images, batch 128, 5 epochs
    python bench/data_pipeline.py --prefetch 0 --repeat 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from parconv.data import DataLoader
from parconv.data import transforms as T


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=50_000, help="images per epoch (default 50000)")
    p.add_argument("--batch-size", type=int, default=128, help="batch size (default 128)")
    p.add_argument("--prefetch", type=int, default=2, help="batches made ahead; 0 = no worker thread (default 2)")
    p.add_argument("--repeat", type=int, default=5, help="epochs timed (default 5)")
    args = p.parse_args(argv)
    x = np.random.default_rng(0).random((args.n, 3, 32, 32), dtype=np.float32)
    y = np.arange(args.n) % 10
    augment = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(),
                         T.Normalize([0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616])])
    loader = DataLoader(x, y, batch_size=args.batch_size, transform=augment, seed=0, prefetch=args.prefetch)
    wall, cpu = [], []
    for epoch in range(args.repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        seen = sum(xb.shape[0] for xb, _ in loader.epoch(epoch))
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        assert seen == args.n
    print(f"{args.n} images, batch {args.batch_size}, prefetch {args.prefetch}: "
          f"wall per epoch median {statistics.median(wall):.2f} s (min {min(wall):.2f}), "
          f"CPU per epoch median {statistics.median(cpu):.2f} s (min {min(cpu):.2f})")


if __name__ == "__main__":
    main()
