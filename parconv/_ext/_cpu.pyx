# This module has no array kernels: it asks the CPU (cpuid, and the OS through xgetbv, as
# libgcc/compiler-rt do) which vector instruction sets it can run, so that parconv._ext picks
# the kernels once at import. It is compiled once, for the baseline of the target.
"""The CPU's vector features, as the compiler's runtime reports them."""

cdef extern from *:
    """
    #if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    #define PC_CPU_X86 1
    #include <cpuid.h>
    #include "pc_amx.h"
    static int pc_cpu_has(int which) {
        __builtin_cpu_init();
        switch (which) {
            case 0: return __builtin_cpu_supports("avx") != 0;
            case 1: return __builtin_cpu_supports("avx2") != 0;
            case 2: return __builtin_cpu_supports("fma") != 0;
            case 3: return __builtin_cpu_supports("bmi") != 0;
            case 4: return __builtin_cpu_supports("bmi2") != 0;
            case 5: return __builtin_cpu_supports("avx512f") != 0;
            case 6: return __builtin_cpu_supports("avx512bw") != 0;
            case 7: return __builtin_cpu_supports("avx512cd") != 0;
            case 8: return __builtin_cpu_supports("avx512dq") != 0;
            case 9: return __builtin_cpu_supports("avx512vl") != 0;
            case 10: return __builtin_cpu_supports("avx512vnni") != 0;
    #if defined(__clang__) || __GNUC__ >= 12
            case 11: return __builtin_cpu_supports("avx512bf16") != 0;
    #endif
    #if !defined(__clang__) && __GNUC__ >= 12
            /* the x86-64 psABI levels the kernels are built for (every feature of the level) */
            case 12: return __builtin_cpu_supports("x86-64-v3") != 0;
            case 13: return __builtin_cpu_supports("x86-64-v4") != 0;
    #endif
            /* CPUID leaf 7 subleaf 1, EAX bit 4 (clang's __builtin_cpu_supports has no name for it) */
            case 14: { /* and AVX2's check, which includes the OS saving the YMM state */
                unsigned a, b, c, d;
                return __builtin_cpu_supports("avx2") && __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 4 & 1u);
            }
            /* AMX-BF16, AMX-INT8 with the OS enabling the tile state (Linux still grants each process
             * the registers: pc_amx_request) */
            case 15: return pc_amx_cpu(PC_AMX_BF16);
            case 16: return pc_amx_cpu(PC_AMX_INT8);
            default: return -1;
        }
    }
    #else
    #define PC_CPU_X86 0
    static int pc_cpu_has(int which) { (void)which; return -1; }
    #endif
    """
    int PC_CPU_X86
    int pc_cpu_has(int which) noexcept nogil


_NAMES = ("avx", "avx2", "fma", "bmi1", "bmi2", "avx512f", "avx512bw", "avx512cd", "avx512dq",
          "avx512vl", "avx512_vnni", "avx512_bf16", "x86-64-v3", "x86-64-v4", "avx_vnni", "amx_bf16", "amx_int8")


def is_x86():
    """Whether this module was compiled for x86 (where cpuid answers)."""
    return bool(PC_CPU_X86)


def features():
    """Feature name -> whether the CPU (and the OS) supports it; empty off x86.

    A feature the compiler cannot ask about is left out rather than guessed.
    """
    out = {}
    cdef int i, r
    for i, name in enumerate(_NAMES):
        r = pc_cpu_has(i)
        if r >= 0:
            out[name] = bool(r)
    return out
