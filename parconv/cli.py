"""Command line: ``parconv train``, ``parconv info``, ``parconv selftest``."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text}")
    return value


def _nonneg_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


def _plural(n: int, word: str) -> str:
    """``1 epoch``, ``2 epochs``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


class _HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` once, and only where the help text does not already explain the default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (not action.option_strings or "default" in text or action.default is None
                or action.default is False or action.default is argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"

    def _fill_text(self, text, width, indent):
        if "\n" in text:  # a table (the recipes): keep its lines
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


class _OnEveryRank(Exception):
    """An error found on rank 0 before training and raised on every rank at the same point.

    ``abort_on_error`` lets it through (no rank is left waiting), and
    :func:`main` reports it once, from rank 0.
    """

    def __init__(self, error: BaseException, rank: int):
        super().__init__(str(error))
        self.error, self.rank = error, rank


def _on_rank0(comm, check):
    """Run ``check()`` on rank 0 only (or serially) and share its result or error with every rank."""
    if comm is None:
        return check()
    payload = None
    if comm.Get_rank() == 0:
        try:
            payload = (True, check())
        except (ValueError, OSError) as exc:
            payload = (False, exc)
    ok, value = comm.bcast(payload, root=0)
    if not ok:
        raise _OnEveryRank(value, comm.Get_rank())
    return value


def _resume_differences(args, model=None) -> tuple[list, list, str | None]:
    """Compare the command line with the checkpoint named by ``--resume``.

    Returns ``(adjustable, fixed, network)``: lists of ``(option, checkpoint
    value, command-line value)`` and the first layer in which ``model``
    differs from the checkpoint's network (None when they agree). Adjustable
    ones (learning rate, momentum, weight decay, batch size) take the
    checkpoint's value with ``--force``; fixed ones (optimizer, number of
    training images) and the network cannot change mid-run.
    """
    from parconv import _checkpoint

    state = _checkpoint.load_training_checkpoint(args.resume)
    network = None if model is None else _checkpoint.architecture_difference(state.model_config, model)
    hyper = state.optimizer_state.get("hyper", {})
    optimizer = {"SGD": "sgd", "Adam": "adam", "AdamW": "adamw", "RMSprop": "rmsprop"}.get(
        state.optimizer_type, state.optimizer_type)
    adjustable, fixed = [], []
    if optimizer != args.optimizer:
        fixed.append(("--optimizer", optimizer, args.optimizer))
    if args.train_size is not None and "n" in state.fit and state.fit["n"] != args.train_size:
        fixed.append(("--train-size", state.fit["n"], args.train_size))
    wanted = [("--lr", "lr", args.lr), ("--weight-decay", "weight_decay", args.weight_decay)]
    if state.scheduler_state:
        # a schedule moves the optimizer's lr (and OneCycleLR its momentum) step by step: the
        # checkpoint's values are the schedule's, restored with it, not settings to compare
        hyper = {k: v for k, v in hyper.items() if k not in ("lr", "momentum", "betas")}
    if args.optimizer == "sgd":
        wanted.insert(1, ("--momentum", "momentum", args.momentum))
    for option, key, value in wanted:
        if key in hyper and hyper[key] != value:
            adjustable.append((option, hyper[key], value))
    if "batch_size" in state.fit and state.fit["batch_size"] != args.batch_size:
        adjustable.append(("--batch-size", state.fit["batch_size"], args.batch_size))
    return adjustable, fixed, network


def _check_resume(args, comm, say, model=None) -> None:
    """Refuse a resume whose settings differ from the checkpoint's, or with ``--force`` take the checkpoint's."""
    adjustable, fixed, network = _on_rank0(comm, lambda: _resume_differences(args, model))
    listing = "; ".join(f"{opt} {ck} in the checkpoint, {cl} on the command line" for opt, ck, cl in fixed + adjustable)
    where = f"--resume {args.resume}: the checkpoint was written with other settings: {listing}"
    error = None
    if fixed:
        error = ValueError(f"{where}. {' and '.join(opt for opt, _, _ in fixed)} cannot change within a run: "
                           "start a new run instead")
    elif network:
        # another network is not a setting --force may override: its weights would not fit, or fit and mean nothing
        error = ValueError(f"--resume {args.resume}: the checkpoint holds another network than --model "
                           f"{args.model} builds: {network}. Resume with the options that built it (--model, "
                           "--filters, the same data), or start a new run; --force overrides only --lr, "
                           "--momentum, --weight-decay and --batch-size")
    elif adjustable and not args.force:
        error = ValueError(f"{where}. Give the checkpoint's values, or add --force to go on with them (the "
                           "optimizer state and the epoch in progress are restored as they were written)")
    if error is not None:
        # every rank found the same differences: each stops here, reported once, with nothing to abort
        raise error if comm is None else _OnEveryRank(error, comm.Get_rank())
    for option, ck, _ in adjustable:
        setattr(args, option[2:].replace("-", "_"), ck)
    if adjustable:
        say("--force: continuing with the checkpoint's " + ", ".join(f"{opt} {ck}" for opt, ck, _ in adjustable)
            + " (the command line's values are ignored)")


def build_cnn(filters: int = 32, kernel_size: int = 3, image_size: int = 28, n_classes: int = 10, backend=None,
              seed: int | None = 0):
    """The ``cnn-mnist`` network: conv KxK x filters, ReLU, maxpool 2, flatten, FC to ``n_classes``."""
    import parconv as pc

    rng = np.random.default_rng(seed)
    side = (image_size - kernel_size + 1) // 2
    return pc.Sequential(
        pc.Conv2d(1, filters, kernel_size=kernel_size, rng=rng),
        pc.ReLU(),
        pc.MaxPool2d(2),
        pc.Flatten(),
        pc.Linear(filters * side * side, n_classes, rng=rng),
        backend=backend,
    )


#: --dataset name -> (loader name in parconv.datasets, what it is)
DATASETS = {
    "mnist-sample": (None, "bundled MNIST sample (10,000 real test-set images)"),
    "mnist": ("load_mnist", "MNIST"),
    "fashion-mnist": ("load_fashion_mnist", "Fashion-MNIST"),
    "cifar10": ("load_cifar10", "CIFAR-10"),
}


def _load_data(args):
    """``(train, test, source, (mean, std))``: raw host arrays and the training set's per-channel statistics.

    The data stay as they are on disk: the statistics become the model's first
    layer (:class:`parconv.Normalize`), so the saved model takes raw pixels.
    """
    import parconv as pc

    if args.dataset == "mnist-sample":
        if args.data is None:
            x, y = pc.datasets.load_mnist("test")
            source = DATASETS["mnist-sample"][1]
        else:  # MNIST IDX files in a directory, one split of them divided as the sample is
            x, y = pc.datasets.load_mnist(args.split, path=args.data)
            source = f"{args.data} ({args.split})"
        n_train = 8000 if args.train_size is None else args.train_size
        if n_train >= x.shape[0]:
            raise SystemExit(f"parconv train: --train-size {n_train} leaves no test images out of {x.shape[0]}")
        # one fixed permutation so the held-out split is the same for every run and seed
        order = np.random.default_rng(1234).permutation(x.shape[0])
        tr, te = order[:n_train], order[n_train:]
        xtr, ytr, xte, yte = x[tr], y[tr], x[te], y[te]
    else:
        loader_name, what = DATASETS[args.dataset]
        load = getattr(pc.datasets, loader_name)
        try:
            xtr, ytr = load("train", path=args.data, download=args.download)
            xte, yte = load("test", path=args.data, download=args.download)
        except FileNotFoundError as exc:
            raise SystemExit(f"parconv train: --dataset {args.dataset} needs the {what} files: pass --data PATH "
                             f"(a directory holding them) or --download to fetch them ({exc})") from None
        if args.train_size is not None:
            if args.train_size > len(xtr):
                raise SystemExit(f"parconv train: --train-size {args.train_size} is more than the "
                                 f"{len(xtr)} training images of {what}")
            xtr, ytr = xtr[:args.train_size], ytr[:args.train_size]
        source = f"{what} ({len(xtr) + len(xte):,} images" + (f" from {args.data})" if args.data else ")")
    axes = (0, 2, 3) if xtr.ndim == 4 else (0,)
    mean = xtr.mean(axis=axes, keepdims=True, dtype=np.float64).astype(np.float32)[:1]
    std = xtr.std(axis=axes, keepdims=True, dtype=np.float64).astype(np.float32)[:1]
    std[std == 0] = 1.0
    return (xtr, ytr), (xte, yte), source, ([float(v) for v in mean.reshape(-1)], [float(v) for v in std.reshape(-1)])


def default_checkpoint(model: str) -> str:
    """The checkpoint ``parconv train --model MODEL`` writes without ``--checkpoint``: ``parconv-MODEL.npz``."""
    return f"parconv-{model}.npz"


#: each model's training recipe: what --epochs, --batch-size, --lr, --scheduler, --weight-decay and
#: --augment default to (SGD with momentum 0.9 unless --optimizer says otherwise)
RECIPES = {
    "cnn-mnist": dict(epochs=10, batch_size=50, lr=0.02, scheduler="none", weight_decay=0.0, augment=False),
    "lenet5": dict(epochs=20, batch_size=64, lr=0.1, scheduler="onecycle", weight_decay=0.0, augment=True),
    "vgg-small": dict(epochs=8, batch_size=64, lr=0.05, scheduler="onecycle", weight_decay=5e-4, augment=True),
    "resnet20": dict(epochs=8, batch_size=64, lr=0.1, scheduler="onecycle", weight_decay=5e-4, augment=True),
    "mobilenet-small": dict(epochs=8, batch_size=64, lr=0.1, scheduler="onecycle", weight_decay=5e-4,
                            augment=True),
}


def _apply_recipe(args) -> None:
    """Fill the training options the command line left out from the model's recipe."""
    for key, value in RECIPES[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def _recipes_epilog() -> str:
    lines = ["training recipes (what the options default to, per --model):"]
    for name, r in RECIPES.items():
        lines.append(f"  {name:16s} {r['epochs']} epochs, batch {r['batch_size']}, lr {r['lr']}, "
                     f"{r['scheduler']} schedule, weight decay {r['weight_decay']:g}"
                     + (", augmented" if r["augment"] else ""))
    return "\n".join(lines)


def _build_model(args, input_shape, backend, stats=None):
    """The ``--model`` network, behind a :class:`parconv.Normalize` of the training statistics ``stats``."""
    import parconv as pc

    rng = np.random.default_rng(args.seed)
    if args.model == "cnn-mnist":
        c, h, _ = input_shape
        net = pc.models.cnn_mnist(args.filters, in_channels=c, image_size=h, backend=backend, rng=rng)
    else:
        net = pc.models.build(args.model, input_shape, backend=backend, rng=rng)
    if stats is None:
        return net
    # the preprocessing belongs to the model: what is saved and exported takes raw pixels
    return pc.Sequential(pc.Normalize(*stats, backend=backend), *net.layers, backend=backend, fuse=net.fuse)


def _make_optimizer(args, model):
    import parconv as pc

    params = model.parameters()
    if args.optimizer == "sgd":
        return pc.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    if args.optimizer == "adam":
        return pc.optim.Adam(params, lr=args.lr, weight_decay=args.weight_decay)
    if args.optimizer == "adamw":
        return pc.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    return pc.optim.RMSprop(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)


def _make_scheduler(args, opt, steps_per_epoch: int):
    from parconv.optim import lr_scheduler as sched

    if args.scheduler == "none":
        return None
    if args.scheduler == "step":
        return sched.StepLR(opt, step_size=max(1, args.epochs // 3), gamma=0.1)
    if args.scheduler == "cosine":
        return sched.CosineAnnealingLR(opt, T_max=args.epochs)
    if args.scheduler == "onecycle":
        return sched.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * steps_per_epoch)
    return sched.ReduceLROnPlateau(opt, mode="min", factor=0.1, patience=2)


def _augmentation(args, shape):
    """Random crop with 4 pixels of padding, plus horizontal flips for natural images (not digits)."""
    from parconv.data import transforms as T

    steps = [T.RandomCrop(shape[1:], padding=4 if shape[1] >= 32 else 2)]
    if args.dataset == "cifar10":
        steps.append(T.RandomHorizontalFlip())
    return T.Compose(steps)


def cmd_train(args) -> int:
    _apply_recipe(args)
    if getattr(args, "sync_bn", False) and not args.distributed:
        raise SystemExit("parconv train: --sync-bn synchronises BatchNorm over MPI ranks; it needs --distributed "
                         "(run: mpiexec -n N parconv train --distributed --sync-bn)")
    if not args.distributed:
        return _train(args, None)
    try:
        from parconv import distributed as dist
    except ImportError as exc:
        raise SystemExit(f"parconv train --distributed: {exc}") from None
    comm = dist.MPI.COMM_WORLD
    dist.install_excepthook(comm)
    # an error on one rank (a bad --resume file, a full disk on rank 0, ...) must end every rank
    with dist.abort_on_error(comm, "parconv train --distributed", passthrough=(_OnEveryRank,)):
        return _train(args, comm)


def _train(args, comm) -> int:
    import parconv as pc

    rank, size = (0, 1) if comm is None else (comm.Get_rank(), comm.Get_size())
    say = print if rank == 0 else (lambda *a, **k: None)
    dp = None
    if comm is not None:
        from parconv import distributed as dist

        dist.configure_threads(comm, args.threads)  # default: cores // ranks on this node
    elif args.threads is not None:
        pc.set_num_threads(args.threads)
    backend = pc.backends.get(args.backend)
    if args.checkpoint is None:  # one default file per network: training one never overwrites another's
        args.checkpoint = default_checkpoint(args.model)
    if args.checkpoint:
        from parconv._io import check_writable_target

        # before any training, not when the first epoch's checkpoint is written
        _on_rank0(comm, lambda: check_writable_target(args.checkpoint))
    (xtr, ytr), (xte, yte), source, stats = _load_data(args)
    model = _build_model(args, xtr.shape[1:], backend, stats)
    synced = 0
    if getattr(args, "sync_bn", False):
        # before the DataParallel, which binds the new layers to its communicator
        model = pc.SyncBatchNorm.convert_sync_batchnorm(model)
        synced = sum(isinstance(m, pc.SyncBatchNorm) for m in model.modules())
    if args.resume:  # the checkpoint's network is compared with the one built here
        _check_resume(args, comm, say, model)
    if comm is not None:
        dp = dist.DataParallel(model, comm)
    opt = _make_optimizer(args, model)
    validation = None
    if args.early_stopping is not None or args.scheduler == "plateau":
        # the test images stay unseen: the last tenth of the training images is held out for validation
        n_val = max(1, len(xtr) // 10)
        validation = (xtr[-n_val:], ytr[-n_val:])
        xtr, ytr = xtr[:-n_val], ytr[:-n_val]
    train_data = xtr
    if args.augment:
        train_data = pc.data.DataLoader(xtr, ytr, batch_size=args.batch_size, shuffle=True,
                                        transform=_augmentation(args, xtr.shape[1:]), seed=args.seed)
    scheduler = _make_scheduler(args, opt, -(-len(xtr) // args.batch_size))
    callbacks = []
    if args.early_stopping is not None:
        callbacks.append(pc.callbacks.EarlyStopping(monitor="val_loss", patience=args.early_stopping,
                                                    restore_best_weights=True))
    threads = pc.get_num_threads() if backend.name == "openmp" else None
    say(f"parconv {pc.__version__} | backend {backend.name}"
        + (f" | {_plural(size, 'MPI rank')}" if comm is not None else "")
        + (f" | {_plural(threads, 'thread')}" + (" per rank" if comm is not None else "") if threads else "")
        + f" | data: {source}")
    what = (f"conv 3x3 x {args.filters} -> ReLU -> maxpool 2 -> FC {model[-1].in_features}->10"
            if args.model == "cnn-mnist" else args.model)
    say(f"model: {what} ({model.num_parameters():,} parameters) | {args.optimizer} lr {args.lr}"
        + (f", {args.scheduler} schedule" if args.scheduler != "none" else "") + f" | batch {args.batch_size}"
        + (" (global)" if comm is not None else "") + f" | {len(xtr)} train"
        + (f" / {len(validation[0])} validation" if validation is not None else "") + f" / {len(xte)} test images"
        + (" | augmented" if args.augment else "")
        + (f" | bf16 autocast ({pc.amp.bf16_support()['mode']})" if args.precision == "bf16" else "")
        + (f" | {_plural(synced, 'SyncBatchNorm layer')}" if getattr(args, "sync_bn", False) else ""))
    if args.resume:
        say(f"resuming from {args.resume}")
    checkpoint = args.checkpoint or None
    t0 = time.perf_counter()
    history = model.fit(train_data, ytr, epochs=args.epochs, batch_size=args.batch_size, optimizer=opt,
                        seed=args.seed, verbose=not args.quiet, distributed=dp if dp is not None else False,
                        checkpoint=checkpoint, checkpoint_every=args.checkpoint_every if checkpoint else None,
                        resume=args.resume, validation_data=validation, scheduler=scheduler,
                        callbacks=callbacks, precision=args.precision)
    train_time = time.perf_counter() - t0
    with pc.autocast(enabled=args.precision == "bf16"):  # tested in the precision it trained in
        result = dp.evaluate(xte, yte) if dp is not None else model.evaluate(xte, yte)
    total = time.perf_counter() - t0
    final_loss = f"{history['loss'][-1]:.4f}" if history.epochs else "n/a"
    say(f"test accuracy: {100 * result['accuracy']:.2f}% on {len(xte)} held-out images "
        f"(test loss {result['loss']:.4f}, final train loss {final_loss})")
    if args.early_stopping is not None and len(history.epochs) < args.epochs:
        say(f"early stopping: no better validation loss for {_plural(args.early_stopping, 'epoch')}; stopped "
            f"after epoch {history.epochs[-1]} and kept the best epoch's weights")
    if not args.resume:
        images = len(history.epochs) * len(xtr)
        epochs_run = _plural(len(history.epochs), "epoch")
        say(f"throughput: {images / train_time:,.0f} images/s training ({train_time:.1f} s for {epochs_run})")
    elif history.epochs:
        say(f"throughput: {history['samples_per_s'][-1]:,.0f} images/s training (last epoch)")
    say(f"wall time: {total:.1f} s" + (f" | checkpoint: {checkpoint}" if checkpoint else ""))
    return 0


def cmd_info(args) -> int:
    import parconv as pc
    from parconv import backends

    print(f"parconv {pc.__version__}")
    print(f"python {platform.python_version()} | numpy {np.__version__} | {platform.platform()}")
    cores, why = pc._config._cpu_count(), pc._config._cpu_count_why()
    env_threads = os.environ.get("OMP_NUM_THREADS")
    if pc._config._num_threads is not None:
        source = "set_num_threads"
    elif pc._config._threads_from_env() is not None:
        source = f"OMP_NUM_THREADS={env_threads}"
    else:
        source = why
    print(f"cpu cores available: {cores} | threads: {pc.get_num_threads()} ({source})")
    if source == why and cores > 1:
        cap = pc._config.team_limit()
        now = f"now at most {cap}, other processes are busy" if cap else "no cap now"
        print(f"teams under load: each parallel region starts at most the cores other processes leave "
              f"free ({now}); the results do not change; set a thread count to turn this off")
    try:
        from parconv._ext import WAIT_POLICY, _threads

        print(f"openmp build: {'yes' if _threads.openmp_enabled() else 'NO (serial kernels)'}")
        print(f"openmp wait policy: {WAIT_POLICY['policy']} ({WAIT_POLICY['source']})")
        if pc.get_num_threads() > 1:
            start = pc._config.region_start_ns()
            if start:
                print(f"small calls: starting a parallel region costs {start / 1e3:.1f} us here, so a call "
                      f"starts a thread per {pc._config.REGION_PAYBACK * start / 1e3:.0f} us of its estimated "
                      f"work; the results do not change")
    except ImportError as exc:
        print(f"openmp build: compiled kernels missing ({exc})")
    from parconv._buildinfo import build_info, format_config

    print(format_config(build_info()))
    print(f"default backend: {pc._config.get_default_backend_name()}")
    print("backends:")
    for name in backends.registered():
        reason = backends.why_unavailable(name)
        print(f"  {name:8s} {'available' if reason is None else 'unavailable: ' + reason}")
    try:
        from parconv.selftest import opencl_devices_info

        devices = opencl_devices_info()
    except ImportError:
        devices = []
    print("opencl devices:" if devices else "opencl devices: none (pip install \"parconv[opencl]\")")
    for d in devices:
        print(f"  [{d['platform_index']}:{d['device_index']}] {d['name']} | {d['vendor']} | {d['type']} | "
              f"{d['compute_units']} compute units | {d['global_mem_bytes'] / 2**30:.1f} GiB")
    try:
        import mpi4py

        from mpi4py import MPI

        print(f"mpi: mpi4py {mpi4py.__version__} | {MPI.Get_library_version().splitlines()[0].strip()}")
    except ImportError:
        print('mpi: not installed (pip install "parconv[mpi]")')
    return 0


def cmd_selftest(args) -> int:
    from parconv.backends import get
    from parconv.selftest import run_selftest

    get(args.backend)  # an unknown or unavailable backend is a usage error (exit 2), as for train
    ok = run_selftest(args.backend, seed=args.seed, n_random=args.random)
    return 0 if ok else 1


def _input_shape(text):
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints like 1,1,28,28 or 1,784, "
                                         f"got {text!r}") from None
    if len(shape) < 2 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected two or more positive ints (N,C,H,W or N,F), got {text!r}")
    return shape


def cmd_export(args) -> int:
    import parconv as pc

    model = pc.load(args.model, backend="numpy").eval()  # an export is for inference
    try:
        pc.onnx.export(model, args.out, args.input_shape)
    except ImportError as exc:
        raise SystemExit(f"parconv export: {exc}") from None
    print(f"wrote {args.out} (ONNX opset {pc.onnx.OPSET}, input {('N',) + args.input_shape[1:]}, "
          f"{model.num_parameters():,} parameters)")
    return 0


def _add_export_parser(sub) -> None:
    e = sub.add_parser("export", help="write a saved model (.npz) as an ONNX file for onnxruntime and others")
    e.add_argument("model", help="a model saved with Sequential.save (MODEL.npz)")
    e.add_argument("out", help="the ONNX file to write (OUT.onnx)")
    e.add_argument("--input-shape", type=_input_shape, required=True, metavar="N,C,H,W",
                   help="one input's shape, N,C,H,W or N,F (the batch size N is dynamic in the file)")
    e.set_defaults(func=cmd_export)


def _add_train_parser(sub) -> argparse.ArgumentParser:
    t = sub.add_parser("train", help="train a network (cnn-mnist by default) on the bundled MNIST sample",
                       description="Train a network of the model zoo (by default cnn-mnist: conv 3x3, ReLU, maxpool "
                                   "2, FC) and report its accuracy on held-out images.",
                       epilog=_recipes_epilog(), formatter_class=_HelpFormatter)
    run = t.add_argument_group("where it runs")
    run.add_argument("--backend", default=None,
                     help="numpy, openmp, opencl or a plugin's name (default: $PARCONV_BACKEND, else openmp)")
    run.add_argument("--threads", type=_positive_int, default=None,
                     help="OpenMP threads (default: every core; with --distributed, cores / ranks per rank)")
    run.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                     help="bf16: convolution and linear layers in bfloat16 with float32 accumulation and master "
                          "weights (pc.autocast); native on CPUs with AVX512_BF16, emulated elsewhere "
                          "(parconv info says which)")
    run.add_argument("--distributed", action="store_true",
                     help="data-parallel over MPI ranks: run under mpiexec -n N")
    run.add_argument("--sync-bn", action="store_true",
                     help="with --distributed: BatchNorm with the statistics of the global batch over the ranks "
                          "(pc.SyncBatchNorm) instead of each rank's share")
    data = t.add_argument_group("model and data")
    data.add_argument("--model", choices=("cnn-mnist", "lenet5", "vgg-small", "resnet20", "mobilenet-small"),
                      default="cnn-mnist", help="the network (pc.models); every one adapts to the data's channels")
    data.add_argument("--filters", type=_positive_int, default=32, help="convolution filters d of cnn-mnist")
    data.add_argument("--dataset", choices=tuple(DATASETS), default="mnist-sample",
                      help="training data; all but mnist-sample need --data PATH or --download")
    data.add_argument("--data", default=None, metavar="PATH",
                      help="directory holding the dataset's files (mnist-sample: MNIST IDX files to use instead "
                           "of the bundled sample)")
    data.add_argument("--download", action="store_true",
                      help="fetch the dataset's official files (checksum-verified, cached in the user cache dir)")
    data.add_argument("--split", choices=("train", "test"), default="test",
                      help="mnist-sample with --data: which IDX files to read")
    data.add_argument("--augment", action=argparse.BooleanOptionalAction, default=None,
                      help="random crops (and horizontal flips on cifar10), applied on a background thread "
                           "(default: the model's recipe)")
    data.add_argument("--train-size", type=_positive_int, default=None,
                      help="images used for training; the rest are held out for the test accuracy")
    opt = t.add_argument_group("training")
    opt.add_argument("--epochs", type=_positive_int, default=None,
                     help="passes over the training images (default: the model's recipe)")
    opt.add_argument("--batch-size", type=_positive_int, default=None,
                     help="images per optimizer step, over all ranks with --distributed (default: the model's recipe)")
    opt.add_argument("--optimizer", choices=("sgd", "adam", "adamw", "rmsprop"), default="sgd", help="update rule")
    opt.add_argument("--scheduler", choices=("none", "step", "cosine", "onecycle", "plateau"), default=None,
                     help="learning-rate schedule: step (x0.1 every third of the epochs), cosine, onecycle "
                          "(per batch, peaking at --lr), plateau (x0.1 when the validation loss stalls 2 epochs) "
                          "(default: the model's recipe)")
    opt.add_argument("--early-stopping", type=_positive_int, default=None, metavar="N",
                     help="stop when the validation loss has not improved for N epochs (a tenth of the training "
                          "images is held out for it) and keep the best weights")
    opt.add_argument("--lr", type=_positive_float, default=None,
                     help="learning rate; the peak with onecycle (default: the model's recipe)")
    opt.add_argument("--momentum", type=_nonneg_float, default=0.9, help="SGD/RMSprop momentum; adam(w) ignores it")
    opt.add_argument("--weight-decay", type=_nonneg_float, default=None,
                     help="L2 penalty: weight_decay * w is added to every weight's gradient (default: the model's "
                          "recipe)")
    opt.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the shuffling")
    opt.add_argument("--quiet", action="store_true", help="no progress bar")
    ck = t.add_argument_group("checkpoints")
    ck.add_argument("--checkpoint", default=None,
                    help="file written atomically after every epoch and every --checkpoint-every steps; it also "
                         "loads as a model with parconv.load, which takes raw pixels ('' to write none; "
                         "default: parconv-MODEL.npz, e.g. parconv-cnn-mnist.npz)")
    ck.add_argument("--checkpoint-every", type=_positive_int, default=100, metavar="K",
                    help="steps between checkpoints within an epoch")
    ck.add_argument("--resume", default=None, metavar="CHECKPOINT",
                    help="continue a stopped run from its checkpoint; it ends with the weights of an "
                         "uninterrupted run")
    ck.add_argument("--force", action="store_true",
                    help="with --resume: go on when --lr, --momentum, --weight-decay or --batch-size differ "
                         "from the checkpoint's; the checkpoint's values win")
    t.set_defaults(func=cmd_train)
    return t


def make_parser() -> argparse.ArgumentParser:
    from parconv import __version__

    parser = argparse.ArgumentParser(prog="parconv", description="Parallel CNN/MLP training on CPUs, OpenCL and MPI.")
    parser.add_argument("--version", action="version", version=f"parconv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train_parser(sub)

    i = sub.add_parser("info", help="version, OpenMP build, threads, backends, OpenCL devices, MPI")
    i.set_defaults(func=cmd_info)

    s = sub.add_parser("selftest", help="check a backend against the NumPy oracle", formatter_class=_HelpFormatter)
    s.add_argument("--backend", required=True, help="the backend to check (numpy, openmp, opencl, a plugin)")
    s.add_argument("--seed", type=int, default=0, help="seed of the random shapes and data")
    s.add_argument("--random", type=int, default=20, help="random shapes per op on top of the fixed ones")
    s.set_defaults(func=cmd_selftest)
    _add_export_parser(sub)
    return parser


def _report(args, exc: BaseException, quiet: bool = False) -> int | None:
    """One line on stderr for an error a user can act on; ``None`` for anything else (a bug: traceback)."""
    from parconv.backends import BackendUnavailableError

    if isinstance(exc, OSError):
        # disk full, read-only directory, a path through a file: the message, not a traceback
        where = f"{exc.filename}: " if exc.filename else ""
        line, code = f"parconv: error: {where}{exc.strerror or exc}", 1
    elif isinstance(exc, (BackendUnavailableError, ValueError)):
        line, code = f"parconv {args.command}: error: {exc}", 2
    else:
        return None
    if not quiet:
        print(line, file=sys.stderr)
    return code


def main(argv=None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # output piped into e.g. `head`, which closed early: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except _OnEveryRank as exc:
        code = _report(args, exc.error, quiet=exc.rank != 0)
        if code is None:
            raise exc.error from None
        return code
    except (ValueError, TypeError, RuntimeError, OSError) as exc:
        code = _report(args, exc)
        if code is None:
            raise
        return code


if __name__ == "__main__":
    sys.exit(main())
