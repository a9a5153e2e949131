"""Build the Cython kernels once per CPU instruction-set level, with OpenMP, in parallel.

Every hot kernel module is Cythonized once and its C compiled once per ISA level the
target supports (x86-64: ``generic`` = the x86-64 baseline, ``avx2`` = x86-64-v3,
``avx512`` = x86-64-v4; other targets: ``generic`` only, which is NEON on aarch64) into
``parconv/_ext/_isa_<level>/``. ``parconv._ext`` picks the best level the CPU runs at
import, so one build (one wheel) is fast on every CPU; ``PARCONV_ISA`` forces a lower one.

The build compiles a tiny OpenMP program first. Where that fails (for example Apple clang
without libomp) the kernels are built serial and a warning says so;
``PARCONV_REQUIRE_OPENMP=1`` turns that into an error.

Build knobs (environment):

* ``PARCONV_BUILD_JOBS=N``: parallel compile jobs (default: the CPUs this process may use).
* ``PARCONV_BUILD_LEVELS=avx512,generic``: build only these levels (a faster in-place
  rebuild while editing); ``level:flags`` replaces a level's flags, e.g.
  ``avx512:-march=native`` (the benchmark's ``-march=native`` twin).
* ``PARCONV_BUILD_ONLY=_conv,_pool``: rebuild only these modules.
* ``PARCONV_FAST_MATH=1``: ``-ffast-math`` (not IEEE; for experiments only).
"""

import concurrent.futures
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import threading
import time
import warnings

import numpy as np
from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

# The kernel modules: compiled once per ISA level (largest first, so the parallel build
# starts the long compiles first).
HOT_NAMES = ["_conv", "_conv_general", "_pool", "_dense", "_norm", "_activations", "_losses", "_optim", "_bf16",
             "_int8"]
# Built once, for the baseline: build facts, the BLAS thread hooks (process-wide state) and
# the CPU feature probe that chooses the level.
ONCE_NAMES = ["_threads", "_cpu"]
EXT_NAMES = ONCE_NAMES + HOT_NAMES

HEADERS = ["pc_common.h", "pc_conv.h", "pc_winograd.h", "pc_winograd4.h", "pc_fused.h", "pc_dense.h", "pc_gemm.h",
           "pc_optim.h", "pc_pool.h", "pc_conv_general.h", "pc_pool.pxd", "pc_helpers.pxd", "pc_conv.pxd", "pc_bf16.h",
           "pc_int8.h", "pc_norm.h", "pc_amx.h"]

_INCLUDE = re.compile(r'^include\s+["\']([^"\']+)["\']', re.M)


def _included(pyx):
    """The files a .pyx pulls in with Cython's ``include`` (its .pxi files, recursively), as paths."""
    found, todo = [], [pyx]
    while todo:
        with open(todo.pop(), encoding="utf-8") as f:
            text = f.read()
        for name in _INCLUDE.findall(text):
            path = os.path.join(os.path.dirname(pyx), name)
            if path not in found:
                found.append(path)
                todo.append(path)
    return found

# level -> (flags, fallback flags for compilers without the x86-64-vN names); highest first
X86_LEVELS = {
    "avx512": (["-march=x86-64-v4"],
               ["-march=x86-64", "-mavx2", "-mfma", "-mbmi", "-mbmi2", "-mf16c", "-mlzcnt", "-mmovbe",
                "-mavx512f", "-mavx512bw", "-mavx512cd", "-mavx512dq", "-mavx512vl"]),
    "avx2": (["-march=x86-64-v3"],
             ["-march=x86-64", "-mavx2", "-mfma", "-mbmi", "-mbmi2", "-mf16c", "-mlzcnt", "-mmovbe"]),
    "generic": (["-march=x86-64"], []),
}
ALL_LEVELS = list(X86_LEVELS)

OMP_TEST = textwrap.dedent(
    """
    #include <omp.h>
    #include <stdio.h>
    int main(void) {
        int n = 0;
        #pragma omp parallel reduction(+:n)
        n += 1;
        printf("%d\\n", n > 0 && omp_get_max_threads() > 0);
        return 0;
    }
    """
)


def _say(msg):
    # stderr, flushed: pip shows it with -v, a plain `setup.py build_ext` always
    print(f"parconv build: {msg}", file=sys.stderr, flush=True)


def _is_x86_target():
    plat = sysconfig.get_platform().lower()
    if "universal2" in plat:
        return False  # one set of flags for two architectures: the portable C path only
    return any(a in plat for a in ("x86_64", "amd64", "i686")) or (
        plat.startswith("linux") and platform.machine().lower() in ("x86_64", "amd64"))


def _compiler_accepts(compiler_cmd, flags, code="int main(void) { return 0; }\n"):
    """Whether the compiler builds a trivial C file with ``flags``."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write(code)
        cmd = compiler_cmd + flags + ["-c", src, "-o", os.path.join(tmp, "probe.o")]
        try:
            subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            return False
    return True


def _optimisation_flags(compiler_cmd):
    """Vectorisation flags that keep IEEE results (NaN/inf survive, no reassociation).

    * ``-fno-math-errno``: lets sqrtf/expf be inlined and vectorised; errno is never read.
    * ``-fno-trapping-math``: lets branches become blends; no code relies on FP traps.
    * ``-ffp-contract=off``: no silent FMA contraction, so elementwise kernels round exactly
      like NumPy evaluating the same expression in float32.

    The instruction set is not here: each ISA level adds its own ``-march`` (see ``_levels``).
    """
    return [flag for flag in ["-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]
            if _compiler_accepts(compiler_cmd, [flag])]


# the level's defining instructions must compile (an assembler too old for AVX-512 fails here)
_LEVEL_PROBE = {
    "avx512": "#include <immintrin.h>\n__m512 f(__m512 a, __m512 b) { return _mm512_fmadd_ps(a, b, a); }\n",
    "avx2": "#include <immintrin.h>\n__m256 f(__m256 a, __m256 b) { return _mm256_fmadd_ps(a, b, a); }\n",
    "generic": "int f(int a) { return a + 1; }\n",
}


def _levels(compiler_cmd):
    """([(level, flags)], {level: why it is not built}) for this target and compiler."""
    wanted = {}
    spec = os.environ.get("PARCONV_BUILD_LEVELS", "").strip()
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        name, _, flags = item.partition(":")
        if name not in ALL_LEVELS:
            raise SystemExit(f"PARCONV_BUILD_LEVELS: unknown level {name!r} (levels: {', '.join(ALL_LEVELS)})")
        wanted[name] = shlex.split(flags) if flags else None
    built, skipped = [], {}
    if not _is_x86_target():
        for level in ALL_LEVELS[:-1]:
            skipped[level] = f"not an x86-64 target ({sysconfig.get_platform()})"
        if wanted and "generic" not in wanted:
            raise SystemExit("PARCONV_BUILD_LEVELS: only 'generic' exists on this target")
        flags = wanted.get("generic") or []
        return [("generic", flags)], skipped
    for level, (flags, fallback) in X86_LEVELS.items():
        if wanted and level not in wanted:
            skipped[level] = "left out by PARCONV_BUILD_LEVELS"
            continue
        if wanted.get(level):
            built.append((level, wanted[level]))
            continue
        for candidate in (flags, fallback):
            if candidate is not None and (candidate or level == "generic") and \
                    _compiler_accepts(compiler_cmd, candidate, _LEVEL_PROBE[level]):
                built.append((level, candidate))
                break
        else:
            skipped[level] = f"the compiler rejects {' '.join(flags)} (and {' '.join(fallback) or 'no fallback'})"
    if not any(level == "generic" for level, _ in built) and not wanted:
        raise SystemExit("parconv build: the compiler cannot build the x86-64 baseline (-march=x86-64)")
    return built, skipped


def _openmp_flags(compiler_cmd):
    """Return (compile_args, link_args) giving OpenMP, or None when none works."""
    candidates = [(["-fopenmp"], ["-fopenmp"])]
    if sys.platform == "darwin":
        candidates.append((["-Xpreprocessor", "-fopenmp"], ["-lomp"]))
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "omp_test.c")
        with open(src, "w") as f:
            f.write(OMP_TEST)
        for cflags, lflags in candidates:
            exe = os.path.join(tmp, "omp_test")
            # the user's CFLAGS/LDFLAGS (e.g. Homebrew libomp's -I/-L on macOS) take part in the probe too
            env_c = shlex.split(os.environ.get("CFLAGS", "") + " " + os.environ.get("CPPFLAGS", ""))
            env_l = shlex.split(os.environ.get("LDFLAGS", ""))
            cmd = compiler_cmd + env_c + cflags + [src, "-o", exe] + env_l + lflags
            try:
                subprocess.run(cmd, check=True, capture_output=True, timeout=120)
                out = subprocess.run([exe], check=True, capture_output=True, timeout=60).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            if out.strip() == b"1":
                return cflags, lflags
    return None


def _jobs(parallel):
    env = os.environ.get("PARCONV_BUILD_JOBS", "").strip()
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise SystemExit(f"PARCONV_BUILD_JOBS must be a whole number, got {env!r}") from None
    if parallel and parallel is not True:
        return int(parallel)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


CYTHON_DIRECTIVES = {
    "boundscheck": False,
    "wraparound": False,
    "cdivision": True,
    "initializedcheck": False,
    "nonecheck": False,
}
# Cython's runtime and memoryview code, compiled once and shared by every module (3.1+): it is
# most of each module's C, and compiling it per module and per level would double the build.
SHARED_UTILITY = "parconv._ext._cyutility"


def _compiler_cmd():
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or shutil.which("cc") or "cc"
    return shlex.split(cc)


def _write_if_changed(path, text):
    # an unchanged wrapper keeps its timestamp, so an up-to-date module is not rebuilt
    if os.path.exists(path):
        with open(path) as f:
            if f.read() == text:
                return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


class BuildExt(build_ext):
    """Cythonizes the modules, then compiles every (module, level) in a pool, one line each."""

    def finalize_options(self):
        # The per-level module list replaces the placeholders before setuptools prepares them.
        self.distribution.ext_modules = self._pc_extensions()
        super().finalize_options()

    def _pc_extensions(self):
        cc = _compiler_cmd()
        flags = _openmp_flags(cc)
        if flags is None:
            msg = (
                "parconv: the C compiler does not support OpenMP; building the kernels SERIAL "
                "(one thread). Install an OpenMP runtime (libgomp with gcc, libomp with clang) "
                "and reinstall for parallel kernels."
            )
            if os.environ.get("PARCONV_REQUIRE_OPENMP", "") not in ("", "0"):
                raise RuntimeError(msg + " PARCONV_REQUIRE_OPENMP is set, so this is an error.")
            warnings.warn(msg)
            print("WARNING: " + msg, file=sys.stderr)
            cflags, lflags = [], []
        else:
            cflags, lflags = flags
        opt = _optimisation_flags(cc)
        levels, skipped = _levels(cc)
        baseline = X86_LEVELS["generic"][0] if _is_x86_target() else []
        only = {n.strip() for n in os.environ.get("PARCONV_BUILD_ONLY", "").split(",") if n.strip()}
        self._pc_only = only
        self._pc_levels, self._pc_skipped = levels, skipped

        headers = [f"parconv/_ext/{h}" for h in HEADERS]
        extra = ["-O3", "-ffast-math" if os.environ.get("PARCONV_FAST_MATH") else "-fno-fast-math",
                 "-Wno-unreachable-code", "-Wno-unused-function"]
        if _compiler_accepts(cc, ["-Wno-psabi"]):
            extra.append("-Wno-psabi")  # the portable path's 16-float vector types, never passed across an ABI
        common = dict(
            include_dirs=[np.get_include()],
            extra_link_args=list(lflags),
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"),
                           ("PARCONV_OPENMP", "1" if flags else "0")],
        )
        exts = []
        for level, level_flags in levels:
            for n in HOT_NAMES:
                if only and n not in only:
                    continue
                # a one-line C file per level (its own object path) including the Cythonized module
                wrapper = f"parconv/_ext/_isa_{level}/{n}.c"
                _write_if_changed(wrapper, f'/* {n} compiled for the {level} ISA level */\n#include "../{n}.c"\n')
                ext = Extension(f"parconv._ext._isa_{level}.{n}", [wrapper], depends=[f"parconv/_ext/{n}.c"] + headers,
                                extra_compile_args=extra + cflags + opt + level_flags, **common)
                ext._pc_level, ext._pc_c = level, f"parconv/_ext/{n}.pyx"
                exts.append(ext)
        for n in ONCE_NAMES + [SHARED_UTILITY.rsplit(".", 1)[1]]:
            if only and n not in only:
                continue
            ext = Extension(f"parconv._ext.{n}", [f"parconv/_ext/{n}.c"], depends=headers,
                            extra_compile_args=extra + cflags + opt + baseline, **common)
            ext._pc_level, ext._pc_c = "baseline", f"parconv/_ext/{n}.pyx"
            exts.append(ext)
        # the largest modules first: the long compiles start at once
        size = {n: sum(os.path.getsize(f) for f in [f"parconv/_ext/{n}.pyx"] + _included(f"parconv/_ext/{n}.pyx"))
                for n in EXT_NAMES}
        size[SHARED_UTILITY.rsplit(".", 1)[1]] = size["_conv"] - 1  # big C, but no kernels
        exts.sort(key=lambda e: -size[e.name.rsplit(".", 1)[1]])
        self._pc_config = dict(
            compiler=" ".join(cc),
            compiler_version=self._compiler_version(cc),
            target=sysconfig.get_platform(),
            openmp=bool(flags),
            common_flags=extra + cflags + opt,
            user_cflags=os.environ.get("CFLAGS", ""),
            levels={level: " ".join(fl) for level, fl in levels},
            not_built=skipped,
        )
        return exts

    @staticmethod
    def _compiler_version(cc):
        try:
            return subprocess.run(cc + ["--version"], capture_output=True, text=True,
                                  timeout=60).stdout.splitlines()[0].strip()
        except (OSError, subprocess.SubprocessError, IndexError):
            return "unknown"

    def _cythonize(self, jobs):
        """Each .pyx to C once (every level compiles the same C), plus the shared utility module.

        A module is regenerated only when its .pyx, a .pxi it includes or one of our .pxd files is
        newer than its C, or the C came from another Cython version. Cython's own check also counts its bundled
        .pxd files, which a fresh isolated build environment (every ``pip install .``) writes
        anew, so it would redo every module and, through the new C, every compile.
        """
        import Cython
        from Cython.Build import cythonize

        t0 = time.perf_counter()
        names = [n for n in EXT_NAMES if not self._pc_only or n in self._pc_only]
        ours = [os.path.join("parconv", "_ext", f) for f in os.listdir(os.path.join("parconv", "_ext"))
                if f.endswith(".pxd")]
        marker = f"Generated by Cython {Cython.__version__} "

        def current(c_file, sources):
            if not os.path.exists(c_file):
                return False
            with open(c_file, errors="replace") as f:
                text = f.read()
            if marker not in text[:200] or (sources and SHARED_UTILITY not in text):
                return False  # another Cython, or C from before the shared utility module
            c_time = os.path.getmtime(c_file)
            return all(os.path.getmtime(s) <= c_time for s in sources)

        stale = [n for n in names if not current(f"parconv/_ext/{n}.c", [f"parconv/_ext/{n}.pyx"] + ours
                                                 + _included(f"parconv/_ext/{n}.pyx"))]
        utility_c = SHARED_UTILITY.replace(".", "/") + ".c"
        if stale or not current(utility_c, []):
            modules = [Extension(f"parconv._ext.{n}", [f"parconv/_ext/{n}.pyx"]) for n in stale]
            modules.append(Extension(SHARED_UTILITY, [utility_c]))
            cythonize(modules, nthreads=jobs if jobs > 1 and len(stale) > 1 else 0, quiet=True, force=True,
                      language_level=3, compiler_directives=CYTHON_DIRECTIVES,
                      shared_utility_qualified_name=SHARED_UTILITY)
        _say(f"cythonized {len(stale)} of {len(names)} modules ({len(names) - len(stale)} up to date) "
             f"in {time.perf_counter() - t0:.1f} s")

    def run(self):
        super().run()
        if self.inplace:
            # setuptools builds into build/ and copies the modules into the tree; the config too
            self._write_build_config(os.path.join("parconv", "_ext"))

    def build_extensions(self):
        jobs = _jobs(self.parallel)
        self._cythonize(jobs)
        exts = self.extensions
        described = ", ".join("%s (%s)" % (lv, " ".join(fl) or "compiler default") for lv, fl in self._pc_levels)
        not_built = "; ".join(f"{k}: {v}" for k, v in self._pc_skipped.items())
        _say(f"compiling {len(exts)} extension modules on {jobs} parallel job(s); "
             f"ISA levels {described}" + (f"; not built: {not_built}" if not_built else ""))
        done = [0]
        lock = threading.Lock()
        t_all = time.perf_counter()

        def one(ext):
            t = time.perf_counter()
            target = self.get_ext_fullpath(ext.name)
            before = os.path.getmtime(target) if os.path.exists(target) else None
            self.build_extension(ext)
            fresh = before is None or os.path.getmtime(target) != before
            with lock:
                done[0] += 1
                took = f"{time.perf_counter() - t:6.1f} s" if fresh else "up to date"
                _say(f"[{done[0]:2d}/{len(exts)}] {ext.name} ({ext._pc_level}) {took}")

        if jobs > 1:
            with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
                futures = [pool.submit(one, ext) for ext in exts]
                for fut in concurrent.futures.as_completed(futures):
                    fut.result()  # the first failure stops the build with its message
        else:
            for ext in exts:
                one(ext)
        _say(f"compiled in {time.perf_counter() - t_all:.1f} s")
        self._write_build_config(os.path.dirname(self.get_ext_fullpath("parconv._ext._threads")))

    def _write_build_config(self, out_dir):
        """parconv/_ext/_build_config.py: what was built and why (read by parconv.show_config)."""
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "_build_config.py")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write('"""Written by setup.py: how the compiled kernels were built."""\n\n')
            f.write(f"BUILD = {self._pc_config!r}\n")
        os.replace(tmp, path)


def extensions():
    # Placeholders naming every module, so setuptools builds a platform wheel; BuildExt
    # replaces them with the per-level list once it knows the compiler.
    return [Extension(f"parconv._ext.{n}", [f"parconv/_ext/{n}.pyx"]) for n in EXT_NAMES]


setup(
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExt},
    package_dir={"parconv.kernels_cl": "kernels_cl"},
    # Every package under parconv/ ships; a hand-written list silently dropped new ones.
    packages=find_packages(include=["parconv", "parconv.*"]) + ["parconv.kernels_cl"],
)
