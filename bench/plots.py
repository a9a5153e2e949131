"""PNG plots of a results dict (the ``results.json`` the suite writes)."""

from __future__ import annotations

import io
import os

from parconv._io import atomic_open


def _save(fig, path: str) -> None:
    """Render ``fig`` to PNG and write it atomically (a kill mid-write keeps the old plot)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    with atomic_open(path, "wb") as f:
        f.write(buf.getvalue())


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _pick(cases: list, k: int = 4) -> list:
    """At most ``k`` cases, spread over the list (first and last always in)."""
    if len(cases) <= k:
        return cases
    idx = sorted({round(i * (len(cases) - 1) / (k - 1)) for i in range(k)})
    return [cases[i] for i in idx]


def _ok_cases(wl: dict) -> list:
    return [c for c in wl.get("cases", []) if c.get("results")]


def _title(results: dict, text: str) -> str:
    return text + (" (quick mode: tiny shapes, not a measurement)" if results.get("quick") else "")


def plot_speedup(results: dict, name: str, wl: dict, out_dir: str) -> str | None:
    plt = _plt()
    cases = _pick(_ok_cases(wl))
    lines = []
    for case in cases:
        by_impl = {}
        for row in case["results"]:
            if row.get("speedup") is not None:
                by_impl.setdefault(row["impl"], []).append((row["threads"], row["speedup"]))
        for impl, pts in by_impl.items():
            if len(pts) > 1:
                lines.append((impl, case["name"], sorted(pts)))
    if not lines:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ts = sorted({t for _, _, pts in lines for t, _ in pts})
    ax.plot([1, ts[-1]], [1, ts[-1]], "k:", lw=1, label="ideal")
    colors = {name: f"C{k}" for k, name in enumerate(dict.fromkeys(c for _, c, _ in lines))}
    styles = {impl: st for impl, st in zip(dict.fromkeys(i for i, _, _ in lines), ("-", "--", "-.", ":"))}
    markers = dict(zip(styles, "osD^v"))
    for impl, cname, pts in lines:
        ax.plot([t for t, _ in pts], [s for _, s in pts], color=colors[cname], linestyle=styles.get(impl, "-"),
                marker=markers.get(impl, "o"), label=f"{impl} {cname}")
    ax.set_xticks(ts)
    ax.set_xlabel("threads")
    ax.set_ylabel("speedup vs 1 thread (median)")
    ax.set_title(_title(results, f"{name}: speedup"), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, f"speedup_{name}.png")
    _save(fig, path)
    plt.close(fig)
    return path


def plot_cnn_sweep(results: dict, wl: dict, out_dir: str) -> list[str]:
    """Images/s vs batch size (one panel per d) and vs filters d (one panel per batch)."""
    plt = _plt()
    cases = _ok_cases(wl)
    if not cases:
        return []
    filters = sorted({c["params"]["d"] for c in cases})
    batches = sorted({c["params"]["N"] for c in cases})
    data = {}  # (config label) -> {(d, N): images/s}
    for c in cases:
        for row in c["results"]:
            if row.get("items_per_s"):
                data.setdefault(row["config"], {})[(c["params"]["d"], c["params"]["N"])] = \
                    row["items_per_s"]
    paths = []
    for x_key, panels, fname, xlabel in (("N", filters, "throughput_vs_batch_cnn-mnist.png", "batch size"),
                                          ("d", batches, "throughput_vs_filters_cnn-mnist.png", "filters d")):
        n = len(panels)
        cols = min(n, 4)
        rows = (n + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(3.3 * cols, 3.0 * rows), squeeze=False, sharey=False)
        for k, panel in enumerate(panels):
            ax = axes[k // cols][k % cols]
            for label, pts in sorted(data.items()):
                if x_key == "N":
                    xy = sorted((N, v) for (d, N), v in pts.items() if d == panel)
                else:
                    xy = sorted((d, v) for (d, N), v in pts.items() if N == panel)
                if xy:
                    ax.plot([a for a, _ in xy], [b for _, b in xy], marker="o", label=label)
            ax.set_title(f"d = {panel}" if x_key == "N" else f"batch = {panel}", fontsize=9)
            ax.set_xlabel(xlabel, fontsize=8)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ticks = batches if x_key == "N" else filters
            ax.set_xticks(ticks)
            ax.set_xticklabels([str(t) for t in ticks], fontsize=7)
            ax.minorticks_off()
            ax.grid(alpha=0.3, which="both")
            if k % cols == 0:
                ax.set_ylabel("images / s (training)", fontsize=8)
        for k in range(n, rows * cols):
            axes[k // cols][k % cols].set_visible(False)
        axes[0][0].legend(fontsize=7)
        fig.suptitle(_title(results, "cnn-mnist training throughput"), fontsize=10)
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        _save(fig, path)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_layers(results: dict, name: str, wl: dict, out_dir: str) -> str | None:
    """Grouped bars: per-layer forward/backward milliseconds for every config."""
    import numpy as np

    plt = _plt()
    cases = _ok_cases(wl)
    if not cases:
        return None
    case = cases[0]
    rows = [r for r in case["results"] if r.get("breakdown_s")]
    if not rows:
        return None
    keys = list(rows[0]["breakdown_s"])
    fig, ax = plt.subplots(figsize=(max(6.4, 0.55 * len(keys) * max(1, len(rows) / 3)), 4.6))
    width = 0.8 / len(rows)
    x = np.arange(len(keys))
    for k, row in enumerate(rows):
        vals = [1e3 * row["breakdown_s"].get(key, 0.0) for key in keys]
        ax.bar(x + (k - (len(rows) - 1) / 2) * width, vals, width, label=row["config"])
    ax.set_xticks(x)
    ax.set_xticklabels(keys, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("ms (median)")
    ax.set_yscale("log")
    ax.set_title(_title(results, f"{name}: per-layer forward / backward time ({case['name']})"), fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, f"layers_{name}.png")
    _save(fig, path)
    plt.close(fig)
    return path


def plot_amdahl(results: dict, out_dir: str) -> str | None:
    plt = _plt()
    entries = [a for a in results.get("amdahl", []) if a.get("rows")]
    if not entries:
        return None
    n = len(entries)
    cols = min(n, 3)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.2 * rows), squeeze=False)
    for k, a in enumerate(entries):
        ax = axes[k // cols][k % cols]
        ts = [r["threads"] for r in a["rows"]]
        ax.plot(ts, ts, "k:", lw=1, label="ideal")
        ax.set_xticks(ts)
        ax.plot(ts, [r["amdahl_bound"] for r in a["rows"]], marker="s", label=f"Amdahl bound (p={a['p']:.3f})")
        ms = [(r["threads"], r["measured_speedup"]) for r in a["rows"] if r.get("measured_speedup")]
        if ms:
            ax.plot([t for t, _ in ms], [s for _, s in ms], marker="o", label="measured")
        ax.set_title(f"{a['workload']} {a['case']} [{a['impl']}]", fontsize=8)
        ax.set_xlabel("threads", fontsize=8)
        ax.set_ylabel("speedup", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    for k in range(n, rows * cols):
        axes[k // cols][k % cols].set_visible(False)
    fig.suptitle(_title(results, "Amdahl analysis of training steps"), fontsize=10)
    fig.tight_layout()
    path = os.path.join(out_dir, "amdahl.png")
    _save(fig, path)
    plt.close(fig)
    return path


def make_plots(results: dict, out_dir: str) -> list[str]:
    """Write every plot the results allow; returns the PNG paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, wl in results.get("workloads", {}).items():
        if not isinstance(wl, dict) or "cases" not in wl:
            continue
        p = plot_speedup(results, name, wl, out_dir)
        if p:
            paths.append(p)
        if name == "cnn-mnist":
            paths += plot_cnn_sweep(results, wl, out_dir)
        if any(r.get("breakdown_s") for c in _ok_cases(wl) for r in c["results"]):
            p = plot_layers(results, name, wl, out_dir)
            if p:
                paths.append(p)
    p = plot_amdahl(results, out_dir)
    if p:
        paths.append(p)
    return paths
