/* What AMX tile kernels need besides the instructions: whether the CPU and OS have a tile unit, the
 * tile configuration's layout, and asking Linux for the tile registers (the _bf16 kernels; _cpu
 * reports the units).
 *
 * A process may use the tiles once the kernel grants it the XTILEDATA state (Linux 5.16 or newer,
 * arch_prctl(ARCH_REQ_XCOMP_PERM)); the permission is the whole process's, so asking twice is
 * harmless. PC_AMX is defined where this compiler can emit the tile instructions. */
#ifndef PARCONV_PC_AMX_H
#define PARCONV_PC_AMX_H

#include <stdint.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>

/* CPUID leaf 7 EDX bits of the AMX units */
#define PC_AMX_BF16 22
#define PC_AMX_TILE 24
#define PC_AMX_INT8 25

/* Whether the CPU has AMX-TILE and the unit whose CPUID bit is `unit` (PC_AMX_BF16, PC_AMX_INT8) and the
 * OS enables the tile state in XCR0. */
static inline int pc_amx_cpu(int unit)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0; /* OSXSAVE */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!(d & (1u << PC_AMX_TILE)) || !(d & (1u << unit))) return 0;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (lo & (3u << 17)) == (3u << 17); /* XTILECFG, XTILEDATA */
}
#endif

#if defined(__linux__) && defined(__x86_64__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define PC_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} pc_tilecfg;

/* Whether this process may run the tile unit `unit`: pc_amx_cpu, and Linux grants the permission. */
static inline int pc_amx_request(int unit)
{
    return pc_amx_cpu(unit) && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

/* GCC's tile loads are asm without a memory clobber: order stores to a tile's operands before it. */
#define PC_AMX_FENCE() __asm__ volatile("" ::: "memory")
#endif

#endif /* PARCONV_PC_AMX_H */
