"""The kernel modules compiled for the generic ISA level (picked by parconv._ext at import)."""
