"""bfloat16 convolution and linear kernels (bf16 inputs, fp32 accumulation)."""

cdef extern from "pc_bf16.h":
    pass


def native():
    """Whether this build level and CPU run the AVX512_BF16 instructions."""
    return False
