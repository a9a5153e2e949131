"""Build the Cython kernels with OpenMP when the compiler supports it.

The build compiles a tiny OpenMP program first. Where that fails (for example
Apple clang without libomp) the kernels are built serial and a warning says
so; ``PARCONV_REQUIRE_OPENMP=1`` turns that into an error.
"""

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import warnings

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

EXT_NAMES = ["_threads", "_conv", "_pool", "_dense", "_activations", "_losses", "_optim", "_norm", "_conv_general"]

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


def _compiler_accepts(compiler_cmd, flags):
    """Whether the compiler builds a trivial C file with ``flags``."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write("int main(void) { return 0; }\n")
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
    * ``-march=native`` (skipped when ``PARCONV_PORTABLE=1``): AVX2/AVX-512 on the build machine.
    """
    flags = []
    for flag in ["-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]:
        if _compiler_accepts(compiler_cmd, [flag]):
            flags.append(flag)
    if os.environ.get("PARCONV_PORTABLE", "") in ("", "0") and _compiler_accepts(compiler_cmd, ["-march=native"]):
        flags.append("-march=native")
    return flags


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


class BuildExt(build_ext):
    def build_extensions(self):
        cc = self.compiler.compiler_so[:1] if hasattr(self.compiler, "compiler_so") else None
        if not cc:
            cc = [sysconfig.get_config_var("CC") or shutil.which("cc") or "cc"]
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
        for ext in self.extensions:
            ext.extra_compile_args = ext.extra_compile_args + cflags + opt
            ext.depends = list(ext.depends) + ["parconv/_ext/pc_common.h", "parconv/_ext/pc_conv.h",
                                                "parconv/_ext/pc_winograd.h", "parconv/_ext/pc_winograd4.h",
                                                "parconv/_ext/pc_fused.h",
                                                "parconv/_ext/pc_dense.h", "parconv/_ext/pc_optim.h",
                                                "parconv/_ext/pc_pool.h", "parconv/_ext/pc_conv_general.h",
                                                "parconv/_ext/pc_pool.pxd", "parconv/_ext/pc_helpers.pxd"]
            ext.extra_link_args = ext.extra_link_args + lflags
            ext.define_macros = ext.define_macros + [("PARCONV_OPENMP", "1" if flags else "0")]
        super().build_extensions()


def extensions():
    common = dict(
        include_dirs=[np.get_include()],
        extra_compile_args=["-O3", "-ffast-math" if os.environ.get("PARCONV_FAST_MATH") else "-fno-fast-math",
                            "-Wno-unreachable-code", "-Wno-unused-function"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
    # PARCONV_BUILD_ONLY=_conv,_pool rebuilds just those extensions (an in-place rebuild while editing one)
    only = {n.strip() for n in os.environ.get("PARCONV_BUILD_ONLY", "").split(",") if n.strip()}
    exts = [Extension(f"parconv._ext.{n}", [f"parconv/_ext/{n}.pyx"], **common)
            for n in EXT_NAMES if os.path.exists(f"parconv/_ext/{n}.pyx") and (not only or n in only)]
    return cythonize(
        exts,
        language_level=3,
        compiler_directives={
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
            "nonecheck": False,
        },
    )


setup(
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExt},
    package_dir={"parconv.kernels_cl": "kernels_cl"},
    # Every package under parconv/ ships; a hand-written list silently dropped new ones.
    packages=find_packages(include=["parconv", "parconv.*"]) + ["parconv.kernels_cl"],
)
