"""The kernel modules compiled for the avx512 ISA level (picked by parconv._ext at import)."""
