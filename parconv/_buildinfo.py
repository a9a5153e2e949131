"""How the compiled kernels were built and which of them this process runs."""

from __future__ import annotations

import importlib


def build_info() -> dict:
    """The kernel dispatch and build facts as a dict (see :func:`show_config`)."""
    info = {"kernels": {"available": False}, "build": {}}
    try:
        ext = importlib.import_module("parconv._ext")
    except ImportError as exc:
        info["kernels"]["error"] = str(exc)
        ext = None
    if ext is not None:
        state = ext.STATE
        info["kernels"].update(
            available=bool(state.get("level")),
            level=state.get("level"),
            why=state.get("why"),
            error=None if state.get("error") is None else str(state["error"]),
            requested=state.get("requested"),
            cpu_runs=list(state.get("supported", [])),
            built=list(state.get("built", [])),
            cpu_features=sorted(k for k, v in state.get("features", {}).items() if v),
            levels={lv: ext.DESCRIPTION[lv] for lv in ext.LEVELS},
        )
    try:
        from parconv.amp import bf16_support

        info["kernels"]["bf16"] = bf16_support()
    except Exception as exc:  # noqa: BLE001 - the report must print whatever the kernels' state
        info["kernels"]["bf16"] = {"mode": "emulated", "why": f"bf16 support unknown: {exc}"}
    try:
        from parconv._ext import _build_config

        info["build"] = dict(_build_config.BUILD)
    except ImportError:
        info["build"] = {}
    try:
        from parconv._ext import _threads

        info["build"]["openmp_runtime_threads"] = int(_threads.omp_max_threads())
    except ImportError:
        pass
    info["kernels"]["int8"] = _int8_path()
    return info


def _int8_path() -> str:
    """The int8 dot-product path quantized layers run (see :func:`parconv.quantization.int8_path`)."""
    try:
        from .quantization import int8_path
    except ImportError as exc:  # pragma: no cover - a broken install
        return f"unavailable ({exc})"
    return int8_path()


def show_config(mode: str = "stdout"):
    """Print (or return) which kernels run here and how they were built, like ``numpy.show_config``.

    Parameters
    ----------
    mode : {"stdout", "dicts"}
        ``"stdout"`` prints a short report; ``"dicts"`` returns it as a dict with
        ``"kernels"`` (the ISA level chosen, why, the levels the CPU runs and the
        levels built; ``"bf16"``: whether :class:`parconv.autocast` runs native
        AVX512_BF16 kernels or emulates them, and why) and ``"build"``
        (compiler, flags per level, levels not built and why).

    Examples
    --------
    >>> import parconv as pc
    >>> cfg = pc.show_config(mode="dicts")
    >>> sorted(cfg)
    ['build', 'kernels']
    >>> cfg["kernels"]["level"] in (None, "generic", "avx2", "avx512")
    True
    """
    if mode not in ("stdout", "dicts"):
        raise ValueError(f"show_config: mode must be 'stdout' or 'dicts', got {mode!r}")
    info = build_info()
    if mode == "dicts":
        return info
    print(format_config(info))
    return None


def format_config(info: dict) -> str:
    k, b = info["kernels"], info["build"]
    lines = []
    if k.get("error"):
        lines.append(f"kernels: ERROR: {k['error']}")
    if "level" in k:
        if k.get("level"):
            lines.append(f"kernels: {k['level']} ({k['levels'][k['level']]}) | chosen: {k['why']}")
        elif not k.get("error"):
            lines.append(f"kernels: none ({k.get('why')})")
        lines.append(f"  cpu runs: {', '.join(k['cpu_runs'])} | built: {', '.join(k['built']) or 'none'}")
        feats = [f for f in k["cpu_features"] if not f.startswith("x86-64")]
        lines.append(f"  cpu features: {', '.join(feats) or 'none reported (not x86)'}")
    if k.get("bf16"):
        mode = k["bf16"].get("mode", "emulated")
        what = "native AVX512_BF16 kernels" if mode == "native" else "emulated (rounded to bf16, float32 compute)"
        lines.append(f"  bf16 (autocast): {what} | {k['bf16'].get('why', '')}")
    if k.get("int8"):
        lines.append(f"  int8 inference: {k['int8']}")
    if b.get("levels"):
        lines.append(f"  build: {b.get('compiler_version', '?')} | target {b.get('target', '?')} | "
                     f"openmp {'yes' if b.get('openmp') else 'NO'}")
        for level, flags in b["levels"].items():
            lines.append(f"    {level:8s} {flags or '(compiler default)'}")
        for level, why in b.get("not_built", {}).items():
            lines.append(f"    {level:8s} not built: {why}")
        if b.get("user_cflags"):
            lines.append(f"    CFLAGS: {b['user_cflags']}")
    return "\n".join(lines)
