"""The kernel modules compiled for the avx2 ISA level (picked by parconv._ext at import)."""
